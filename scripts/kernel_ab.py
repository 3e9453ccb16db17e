"""A/B of kernel builds: the same benchmark rows timed with each kernel directory, in turns (GPU machine).

usage: python scripts/kernel_ab.py ROW [ROW ...] --arm NAME=DIR --arm NAME=DIR [--pass fwd|bwd] [--turns N]
ROW: a substring of a row key ("hk16_hv32|32k_8seq"). DIR: a kernel directory (manifest.json and cubins), e.g. a
copy of flash_qla/_kernels/sm90a taken before `python -m build_matrix build` rebuilt the changed kernel:

    cp -r flash_qla/_kernels/sm90a /tmp/before     # then edit aot/kernels/..., rebuild (build machine)
    python scripts/kernel_ab.py "hk16_hv32|32k" --pass bwd --arm before=/tmp/before --arm after=flash_qla/_kernels/sm90a

Each turn runs every arm in its own process (FLASH_QLA_KERNELS_DIR=DIR), arms alternating, so the arms see the
same card, clocks and inputs. Per row and arm it prints the median over turns of the call's CUDA-graph time and of
each kernel's profiler time, and whether the call's outputs equal the first arm's bit for bit: a build whose
outputs differ computes different arithmetic, and its timing says nothing about the change alone.
"""
import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(pass_: str, wants: list) -> None:
    """In one arm's process: per row, the graph time, each kernel's time and a digest of the outputs."""
    import torch

    from flash_qla.bench.timing import graph_median_ms
    from flash_qla.bench.workloads import backward_rows, forward_rows
    sys.path.insert(0, str(HERE))
    from kernel_split import split

    for row, _, call in (forward_rows if pass_ == "fwd" else backward_rows)(wants):
        digest = hashlib.sha256()
        for t in call():
            if t is not None:
                digest.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
        graph_ms, why = graph_median_ms(call, torch.device("cuda", torch.cuda.current_device()))
        print(json.dumps({"row": row.key, "graph_ms": graph_ms, "graph_error": why, "kernels": split(call),
                          "outputs": digest.hexdigest()}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", nargs="+")
    p.add_argument("--arm", action="append", default=[], help="NAME=DIR (at least two)")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.pass_, args.rows)
        return
    arms = dict(a.split("=", 1) for a in args.arm if "=" in a)
    if len(arms) < 2 or len(arms) != len(args.arm):
        raise SystemExit("kernel_ab: give at least two arms as --arm NAME=DIR")
    for name, folder in arms.items():
        if not (Path(folder) / "manifest.json").is_file():
            raise SystemExit(f"kernel_ab: arm {name}: {folder} holds no manifest.json")
    if args.turns < 1:
        raise SystemExit("kernel_ab: --turns must be >= 1")
    results = defaultdict(lambda: defaultdict(list))   # (row, arm) -> field -> values
    for turn in range(args.turns):
        for name, folder in arms.items():
            env = dict(os.environ, FLASH_QLA_KERNELS_DIR=str(Path(folder).resolve()))
            proc = subprocess.run([sys.executable, __file__, *args.rows, "--pass", args.pass_, "--worker"],
                                  env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"kernel_ab: arm {name} failed:\n{proc.stderr[-4000:]}")
            for line in proc.stdout.splitlines():
                r = json.loads(line)
                # each turn's times as they come (stderr): a call cut short by its time limit still reports them
                print(f"turn {turn} {name} {r['row']} graph_ms {r['graph_ms']} kernels "
                      f"{ {k: v for k, v in r['kernels'].items() if isinstance(v, (int, float))} }", file=sys.stderr,
                      flush=True)
                cell = results[(r["row"], name)]
                cell["graph_ms"].append(r["graph_ms"])
                cell["outputs"].append(r["outputs"])
                for kernel, ms in r["kernels"].items():
                    if isinstance(ms, (int, float)):  # kernel_split's per-kernel means (not its launch-order list)
                        cell[kernel].append(ms)
    first = next(iter(arms))
    for row in dict.fromkeys(r for r, _ in results):
        reference = results[(row, first)]["outputs"][0]
        for name in arms:
            cell = results[(row, name)]
            graph = [x for x in cell.pop("graph_ms") if x is not None]
            outputs = cell.pop("outputs")
            print(json.dumps({"row": row, "arm": name, "same_outputs_as_first_arm": set(outputs) == {reference},
                              "graph_ms": round(statistics.median(graph), 4) if graph else None,
                              **{k: round(statistics.median(v), 4) for k, v in cell.items()}}), flush=True)


if __name__ == "__main__":
    main()
