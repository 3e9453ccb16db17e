"""When each kernel of one eager backward call is launched, in host microseconds from the call's start (GPU machine).

Shows how long the GPU waits for the host before the first kernel (an eager call's lead-in) and whether the host
keeps ahead of the device afterwards (a launch that comes after the previous kernels would have finished means the
call is host-bound). The device is drained before the call; JSON lines on stdout.
usage: python scripts/launch_times.py ROW_SUBSTRING [...]
"""
import json
import sys
import time

import torch

from flash_qla import ops
from flash_qla.bench.workloads import backward_rows


def main():
    real = ops._launch
    for row, _, call in backward_rows(sys.argv[1:]):
        for _ in range(5):
            call()
        marks: list = []
        start = [0.0]

        def logged(name, *args, **kwargs):
            marks.append((name, round((time.perf_counter() - start[0]) * 1e6, 1)))
            return real(name, *args, **kwargs)
        ops._launch = logged
        try:
            for _ in range(5):  # the last of five calls is reported
                marks.clear()
                torch.cuda.synchronize()
                start[0] = time.perf_counter()
                call()
                total = round((time.perf_counter() - start[0]) * 1e6, 1)
        finally:
            ops._launch = real
        torch.cuda.synchronize()
        print(json.dumps({"row": row.key, "launch_us": marks, "call_us": total}), flush=True)


if __name__ == "__main__":
    main()
