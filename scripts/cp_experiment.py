"""Graph and eager medians of the forward with intra-card CP forced at segment length L vs off, on rows where
the planner's choice is in doubt (GPU machine): JSON lines for bench/results/experiments/.

usage: python scripts/cp_experiment.py "TP8 8192x4:32" "TP2 1x8192:32" ...   (kernel_experiment row : L)
"""
import json
import sys

import torch

import flash_qla
from flash_qla import cp
from flash_qla.bench.timing import eager_median_ms
from kernel_experiment import graph_ms, inputs

ROWS = {"TP8 8192x4": (2, 8, [8192] * 4), "TP2 1x8192": (8, 32, [8192]), "TP8 1x8192": (2, 8, [8192]),
        "2B-TP1 1x8192": (16, 16, [8192]), "TP8 1x32768": (2, 8, [32768]), "TP8 1x2048": (2, 8, [2048])}


def eager_ms(fn) -> float:
    """Eager median per call, host overhead included (flash_qla.bench.timing, the benchmark's own method)."""
    return eager_median_ms(fn, torch.device("cuda"), warmup=5, iters=50)


def main(specs):
    for spec in specs:
        name, L = spec.rsplit(":", 1)
        q, k, v, g, beta, cu, h0 = inputs(*ROWS[name])
        g[:, :, : -(-g.shape[2] // 4)] = 0.0  # as ../shared/bench/inputs.md: a quarter of the heads do not decay
        rec = {"row": name, "L": int(L)}
        for label, force in (("plain", 0), ("cp", int(L))):
            cp.FORCE_SEGMENT_CHUNKS = force

            def fn():
                return flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                        cu_seqlens=cu)
            rec[f"{label}_graph_ms"] = round(graph_ms(fn), 4)
            rec[f"{label}_eager_ms"] = round(eager_ms(fn), 4)
        cp.FORCE_SEGMENT_CHUNKS = None
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
