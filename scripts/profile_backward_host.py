"""Where the host time of one eager backward call goes (GPU machine): cProfile tables and a JSON line per row.

Per row: the host microseconds per call (flash_qla.bench.timing.host_us_per_call, the device kept busy), then the
call under cProfile, its functions by own time and by cumulative time (per call).
usage: python scripts/profile_backward_host.py OUT.jsonl CALLS ROW_SUBSTRING [...]
"""
import cProfile
import io
import json
import pstats
import sys

import torch

from flash_qla.bench.timing import host_us_per_call
from flash_qla.bench.workloads import backward_rows


def main():
    out_path, calls, wants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    device = torch.device("cuda", torch.cuda.current_device())
    with open(out_path, "a") as out:
        for row, _, call in backward_rows(wants):
            for _ in range(10):
                call()
            torch.cuda.synchronize()
            host_us = host_us_per_call(call, device, calls)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                call()
            prof.disable()
            torch.cuda.synchronize()
            for order in ("tottime", "cumulative"):
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats(order).print_stats(28)
                print(f"== {row.key} by {order} ({calls} calls)\n" + text.getvalue()[-7000:], flush=True)
            rec = {"row": row.key, "host_us_per_call": round(host_us, 1), "device": torch.cuda.get_device_name()}
            print(json.dumps(rec), flush=True)
            out.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
