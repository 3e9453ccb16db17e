"""The backward's intra-card CP segment length, swept on single-sequence shapes (GPU machine): JSON lines.

For each shape, the CUDA-graph median of the low-level backward (chunk_gated_delta_rule_bwd, as the bench times
it) with CP off (L = 0), with each forced segment length L, and with the planner's own choice (L = None, whose pick
is recorded), so flash_qla/cp.py's backward cost model can be checked on shapes beyond the bench rows.
Inputs are drawn as the bench draws them (../shared/bench/inputs.md: a quarter of the heads never decay).
usage: python scripts/cp_backward_sweep.py [SHAPE ...]   SHAPE = hq,hv,tokens[,seqs] (seqs equal sequences, default
one; default shapes: a set of single sequences)
"""
import json
import sys

import torch

from flash_qla import cp
from flash_qla.bench import timing
from flash_qla.bench.inputs import draw_inputs
from flash_qla.bench.matrix import BenchRow
from flash_qla.bench.workloads import backward_call, forward_for_backward

DEFAULT_SHAPES = ["16,32,16384", "16,32,32768", "16,32,65536", "8,16,32768", "4,8,16384", "4,8,32768",
                  "4,8,65536"]
LENGTHS = [0, 16, 32, 64, 128, 256, None]


def main(shapes):
    device = torch.device("cuda")
    timing.prepare_device(device)
    chosen = {}
    original = cp.plan_segment_chunks

    def recording(*args, **kwargs):  # the planner's pick for the backward's recompute
        L = original(*args, **kwargs)
        if kwargs.get("paired_share", 0.0):  # only the backward's recompute asks with its paired share
            chosen["L"] = L
        return L
    cp.plan_segment_chunks = recording
    for shape in shapes:
        hq, hv, tokens, *rest = (int(s) for s in shape.split(","))
        seqs = rest[0] if rest else 1
        row = BenchRow("bwd", f"hk{hq}_hv{hv}", hq, hv, f"{tokens}_{seqs}seq", (tokens // seqs,) * seqs, 128)
        x = draw_inputs(row, "cuda")
        g_cumsum, A = forward_for_backward(x, "kernels")
        call = backward_call(x, g_cumsum, A, "kernels")
        for L in LENGTHS:
            if L is not None and L * 64 >= tokens // seqs:
                continue
            cp.FORCE_SEGMENT_CHUNKS = L
            chosen.clear()
            ms, err = timing.graph_median_ms(call, device)
            print(json.dumps({"shape": shape, "L": L, "planner_L": chosen.get("L") if L is None else None,
                              "graph_ms": round(ms, 4) if ms else None, "error": err}), flush=True)
        cp.FORCE_SEGMENT_CHUNKS = None
        del x, g_cumsum, A, call
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT_SHAPES)
