"""A/B of the TMA descriptors' L2 promotion (GPU machine): the backward rows' graph medians with every tensor map of
the named kernels encoded at promotion P (0 none, 1 64 B, 2 128 B = TileLang's choice, 3 256 B) instead of the
manifest's. Host-side only: the promotion is a field of the tensor map the launcher encodes, not of the cubin.
One arm per process (the argument builders are compiled once per kernel); run arms in turns. JSON lines on stdout.
usage: python scripts/l2_promotion_ab.py ARM ROW_SUBSTRING [...]   ARM = base | KERNEL[+KERNEL...]:P
"""
import dataclasses
import json
import sys

import torch

from flash_qla import manifest
from flash_qla.bench.timing import graph_median_ms, prepare_device
from flash_qla.bench.workloads import backward_rows


def promote(kernels: set, level: int) -> None:
    """Every later argument builder of those kernels encodes its tensor maps at this L2 promotion."""
    build = manifest.compile_arg_builder

    def patched(entry):
        if entry.kernel in kernels:
            params = tuple(dataclasses.replace(p, l2_promotion=level) if p.kind == "tensormap" else p
                           for p in entry.params)
            entry = dataclasses.replace(entry, params=params)
        return build(entry)
    manifest.compile_arg_builder = patched


def main():
    arm, wants = sys.argv[1], sys.argv[2:]
    if arm != "base":
        names, level = arm.rsplit(":", 1)
        promote(set(names.split("+")), int(level))
    device = torch.device("cuda")
    prepare_device(device)
    for row, _, call in backward_rows(wants):
        ms, err = graph_median_ms(call, device)
        print(json.dumps({"row": row.key, "arm": arm, "graph_ms": round(ms, 4) if ms else None, "error": err,
                          "device": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
