"""Eager medians of forward rows under the CP planner's choice and under forced plans, in turns (GPU machine).

Each row is timed plain (no CP), as planned, and at forced segment lengths of 32 and 64 chunks, then plain and
planned again, so a host that drifts shows as a spread. The eager median is the bench's own
(flash_qla.bench.timing). The output is JSON lines.
usage: python scripts/eager_plan_ab.py ROW_KEY [...]     (e.g. "fwd|2B-TP1|28672+4096")
"""
import sys, json, torch
from flash_qla import cp
from flash_qla.bench.inputs import draw_inputs
from flash_qla.bench.matrix import iter_rows, load_matrix
from flash_qla.bench.workloads import forward_call
from flash_qla.bench.timing import eager_median_ms, prepare_device
dev = torch.device("cuda"); prepare_device(dev)
for row in iter_rows(load_matrix(), ("fwd",), ""):
    if row.key not in sys.argv[1:]: continue
    x = draw_inputs(row, "cuda"); fn = forward_call(x, "kernels")
    out = {"row": row.key}
    for name, force in (("plain", 0), ("planned", None), ("cp32", 32), ("cp64", 64), ("plain2", 0), ("planned2", None)):
        cp.FORCE_SEGMENT_CHUNKS = force
        out[name] = round(eager_median_ms(fn, dev, 10, 50), 4)
    cp.FORCE_SEGMENT_CHUNKS = None
    print(json.dumps(out), flush=True)
