"""Eager medians of forward rows under the CP planner's choice and under forced plans, in turns (GPU machine).

Each row is timed plain (no CP), as planned, and at forced segment lengths of 32 and 64 chunks, then plain and
planned again, so a host that drifts shows as a spread. The eager median is the bench's own
(flash_qla.bench.timing). The output is JSON lines.
usage: python scripts/eager_plan_ab.py ROW_SUBSTRING [...]     (e.g. "fwd|2B-TP1|28672+4096")
"""
import json
import sys

import torch

from flash_qla import cp
from flash_qla.bench.timing import eager_median_ms, prepare_device
from flash_qla.bench.workloads import forward_rows

PLANS = (("plain", 0), ("planned", None), ("cp32", 32), ("cp64", 64), ("plain2", 0), ("planned2", None))


def main():
    device = torch.device("cuda")
    prepare_device(device)
    for row, _, call in forward_rows(sys.argv[1:]):
        out = {"row": row.key}
        for name, force in PLANS:
            cp.FORCE_SEGMENT_CHUNKS = force
            out[name] = round(eager_median_ms(call, device, 10, 50), 4)
        cp.FORCE_SEGMENT_CHUNKS = None
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
