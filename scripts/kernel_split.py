"""Per-kernel GPU time of one benchmark row's call, for ours or a peer (GPU machine): JSON lines.

torch.profiler over repeated calls gives each kernel's mean time per call, so a row's time splits into its
kernels (which kernel bounds it, and against which kernel of a peer).
usage: python scripts/kernel_split.py {ours|qla|fla} ROW [ROW ...] [--pass fwd|bwd] [--peers-dir .peers]
                                     [--tune NAME=VALUE ...]
ROW: a substring of the row key ("TP1-397B|4096x8"). --tune pins flash_qla.tuning settings for ours (a plan to split:
force_segment_chunks=64 cp_fused=0; values are ints, 0 / 1 for the booleans, or none). A peer needs the staged peers folder (see scripts/README.md)
and must run in its environment: its input maker and calls come from that folder's peer_bench.py.
"""
import argparse
import dataclasses
import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

MATRIX_PY = Path(__file__).resolve().parent.parent / "flash_qla" / "bench" / "matrix.py"


def split(fn, iters: int = 10) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    kernels = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda ev: ev.time_range.start)
    for ev in kernels:
        per[ev.name[:60]] += ev.device_time / 1000.0 / iters
    out = {k: round(v, 4) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
    out["total_ms"] = round(sum(per.values()), 4)
    out["launches_per_call"] = len(kernels) / iters
    if len(kernels) % iters == 0:  # every call launches the same sequence: each launch's mean, in launch order
        n = len(kernels) // iters
        out["in_order"] = [[kernels[i].name[:40], round(sum(kernels[c * n + i].device_time for c in range(iters))
                                                        / 1000.0 / iters, 4)] for i in range(n)]
    return out


def ours_calls(pass_: str, wants: list):
    from flash_qla.bench.workloads import backward_rows, forward_rows
    for row, _, call in (forward_rows if pass_ == "fwd" else backward_rows)(wants):
        yield row, call


def matrix_module():
    """The benchmark matrix reader, loaded from its file (it imports only the standard library): in a peer's
    environment the name `flash_qla` is FlashQLA's package, which shadows this repository's."""
    spec = importlib.util.spec_from_file_location("_flash_qla_bench_matrix", MATRIX_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def peer_calls(lib: str, peers_dir: str, pass_: str, wants: list):
    sys.path.insert(0, peers_dir)
    import peer_bench  # the peers' input maker and call wrappers
    _, fwd, bwd = peer_bench.peer(lib)
    matrix = matrix_module()
    for row in matrix.iter_rows(matrix.load_matrix(str(Path(peers_dir) / "matrix.json")), (pass_,)):
        if any(w in row.key for w in wants):
            d = peer_bench.make(list(row.seqlens), row.hq, row.hv, row.head_dim)
            if pass_ == "fwd":
                yield row, (lambda d=d: fwd(d))
            else:
                gc, A = fwd(d)
                yield row, bwd(d, gc, A)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("lib", choices=("ours", "qla", "fla"))
    p.add_argument("rows", nargs="+")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="fwd")
    p.add_argument("--peers-dir", default=".peers")
    p.add_argument("--tune", nargs="*", default=[], metavar="NAME=VALUE")
    args = p.parse_args()
    if args.lib != "ours":  # in a peer's environment `flash_qla` is FlashQLA's package: no tuning to pin there
        if args.tune:
            p.error("--tune pins flash_qla.tuning settings: ours only")
        for row, call in peer_calls(args.lib, args.peers_dir, args.pass_, args.rows):
            print(json.dumps({"lib": args.lib, "row": row.key, **split(call)}), flush=True)
        return
    from flash_qla.tuning import Tuning, override
    kinds = {f.name: f.type for f in dataclasses.fields(Tuning)}
    pins = {}
    for item in args.tune:
        name, _, value = item.partition("=")
        if name not in kinds:
            p.error(f"--tune: flash_qla.tuning has no setting {name!r}")
        pins[name] = None if value == "none" else bool(int(value)) if "bool" in str(kinds[name]) else int(value)
    with override(**pins):
        for row, call in ours_calls(args.pass_, args.rows):
            print(json.dumps({"lib": args.lib, "row": row.key, **pins, **split(call)}), flush=True)


if __name__ == "__main__":
    main()
