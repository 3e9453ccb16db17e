"""Time the backward's stages on the standard backward rows (GPU machine): JSON lines on stdout.

Stages: recompute (plan + prepare + qk + gdn_fwd save build), gdn_bwd_dh, gdn_bwd_chunk (+ GVA sum), each a
median of CUDA-event timings over repeated eager calls, so the total's split is visible.
usage: python scripts/backward_stages.py [ROW_SUBSTRING]
"""
import json
import statistics
import sys

import torch

from flash_qla import backward, ops
from flash_qla.bench.inputs import draw_inputs
from flash_qla.bench.matrix import iter_rows, load_matrix
from flash_qla.validation import validate_inputs


def median_ms(fn, iters=20):
    fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    want = sys.argv[1] if len(sys.argv) > 1 else ""
    for row in iter_rows(load_matrix(), ("bwd",), want):
        x = draw_inputs(row, "cuda")
        problem = validate_inputs(x.q, x.k, x.v, x.g, x.beta, None, x.h0, x.cu_seqlens)
        st = {}

        def recompute():
            st.clear()
            ops.forward(problem, x.q, x.k, x.v, x.g, x.beta, x.h0, False, x.cu_seqlens, False,
                        want_gate_free_inverse=True, saved=st)
        t_re = median_ms(recompute)
        out = {}
        do_p = ops._packed(x.do)

        def dh():
            out["r"] = backward._reverse_recurrence(problem, st, do_p, x.dht.float().contiguous(), x.h0 is not None)
        t_dh = median_ms(dh)
        dv, xx, dhs, _ = out["r"]
        t_chunk = median_ms(lambda: backward._chunk_kernel(problem, st, do_p, xx, dv, dhs))
        print(json.dumps({"row": row.key, "recompute_ms": round(t_re, 3), "dh_ms": round(t_dh, 3),
                          "chunk_ms": round(t_chunk, 3), "sum_ms": round(t_re + t_dh + t_chunk, 3)}), flush=True)


if __name__ == "__main__":
    main()
