"""gdn_bwd_chunk builds that differ in their arithmetic (GPU machine; an experiment, not a test): JSON lines.

Like scripts/chunk_kernel_ab.py (same NAME=SPEC builds, same turns and medians), but the first build is the
reference and each other build's dq / dk / dbeta / dg are compared to it by relative L2 error and the largest
absolute difference, since a different order of sums cannot give the same bits.
usage: python scripts/chunk_kernel_compare.py KEY NAME=SPEC [NAME=SPEC ...] [--rows SUB[,SUB...]]
"""
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from chunk_kernel_ab import over_rows  # noqa: E402

NAMES = ("dq", "dk", "dbeta", "dg")


def differences(ref, out):
    """{name: (relative L2 error, max |difference|, NaN count)} of out against ref."""
    res = {}
    for n, a, b in zip(NAMES, ref, out):
        a, b = a.double(), b.double()
        res[n] = [float((b - a).norm() / a.norm().clamp_min(1e-30)), float((b - a).abs().max()),
                  int(torch.isnan(b).sum())]
    return res


def against_first(row, ref, rep, name, out) -> None:
    """The first call is the reference; at the first and last turn every other call is compared to it (a race shows
    as a build differing from itself)."""
    if rep in (0, 14):
        if not ref:
            ref.extend(t.clone() for t in out)
        else:
            print(json.dumps({"row": row.key, "build": name, "rep": rep, "vs_first": differences(ref, out)}),
                  flush=True)


def main():
    over_rows(["hk16_hv32|8k_8seq", "hk16_hv32|32k_8seq", "hk4_hv8|32k_1seq"], against_first)


if __name__ == "__main__":
    main()
