"""Host time of one call of the bench's forward / backward rows, and where it goes (GPU machine; JSON lines).

For each selected row, it measures the wall time of CALLS calls issued back to back, with the device drained
before them and not waited for inside the loop. That is few enough launches that the launch queue never blocks,
so the figure is the host's cost per call. It then prints a cProfile of the same loop (top functions by own time),
which shows where that cost goes; with --cumulative, by cumulative time as well.
usage: python scripts/host_cost_rows.py ROW_SUBSTRING [...] [--calls N] [--profile [--cumulative] [--top N]]
"""
import cProfile
import io
import itertools
import json
import pstats
import sys

import torch

from flash_qla.bench.timing import host_us_per_call
from flash_qla.bench.workloads import backward_rows, forward_rows


def main():
    args = sys.argv[1:]
    calls = int(args[args.index("--calls") + 1]) if "--calls" in args else 20
    top = int(args[args.index("--top") + 1]) if "--top" in args else 22
    profile = "--profile" in args
    wants = [a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or args[i - 1] not in ("--calls", "--top"))]
    for row, _, fn in itertools.chain(forward_rows(wants), backward_rows(wants)):
        for _ in range(5):
            fn()
        samples = sorted(host_us_per_call(fn, torch.device("cuda"), calls) for _ in range(7))
        print(json.dumps({"row": row.key, "host_us_median": round(samples[3], 1), "host_us_min": round(samples[0], 1),
                          "calls": calls}), flush=True)
        if profile:
            torch.cuda.synchronize()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(calls):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            for order in ("tottime", "cumulative") if "--cumulative" in args else ("tottime",):
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats(order).print_stats(top)
                print(f"== {row.key} by {order} ({calls} calls)\n" + s.getvalue()[:top * 250], flush=True)


if __name__ == "__main__":
    main()
