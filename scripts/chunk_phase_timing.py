"""Phase timings inside gdn_bwd_chunk from an instrumented build (GPU machine; an experiment, not a test).

The instrumented build (a patched aot/kernels/gdn_bwd_chunk.py compiled to a cubin) has thread 0 of each CTA stamp
clock64() deltas at the phase boundaries into shared memory and write them to dbeta[t0 + i, hk] (i < 22) at the end,
and stamp 22 as dbeta[t0 + 22, hk]: the CTA's duration in ns by %globaltimer (one CTA per item), or the cycles since
the previous item's end (the persistent kernel: PERSISTENT=1)
(its real dbeta stores are dropped). This script runs the recompute and the dh chain as the backward does, launches
the chunk kernel from that cubin, and prints each phase's median over the full chunks' CTAs as JSON.
The persistent kernel's build (the stamp patch applies to aot/kernels/gdn_bwd_chunk.py as of commit fa5ca78, before
the epilogue changes: `git checkout fa5ca78 -- aot/kernels/gdn_bwd_chunk.py` first, and port the stamps to use them on
a later kernel): `git apply bench/results/experiments/gdn_bwd_chunk_clock_stamps.diff`, then
`python scripts/compile_variant.py gdn_bwd_chunk "{'dtype': 'bf16', 'K': 128, 'V': 128}" stamps.cubin` (prints SMEM),
then `git checkout aot/kernels/gdn_bwd_chunk.py` (the stamp layout there: stamp 22 = cycles since the previous item).
usage: python scripts/chunk_phase_timing.py CUBIN SMEM_BYTES [ROW_SUBSTRING ...]  (SMEM_BYTES: the build's dynamic
shared memory, which the stamps' buffer makes larger than the manifest's)
"""
import json
import os
import statistics
import sys

import torch

from chunk_kernel_ab import chunk_stage_inputs, kernels, use
from flash_qla import backward
from flash_qla.bench.matrix import iter_rows, load_matrix

KEY = "gdn_bwd_chunk.bf16.K128.V128"
HEAD_MARKS = ["v_loop", "state_terms", "dP_part", "Agb_part", "dL_part", "dg_scan_stores", "running_sums"]


def main():
    use(kernels(KEY, [f"stamps={sys.argv[1]}:{sys.argv[2]}"])["stamps"])
    wants = sys.argv[3:] or ["hk16_hv32|32k_1seq"]
    for row in iter_rows(load_matrix(), ("bwd",), ""):
        if not any(w in row.key for w in wants):
            continue
        p, st, stage = chunk_stage_inputs(row)
        for _ in range(3):
            dq, dk, dbeta, dg = backward._chunk_kernel(p, st, *stage)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dq, dk, dbeta, dg = backward._chunk_kernel(p, st, *stage)
        b.record()
        torch.cuda.synchronize()
        rows = st["slot_rows"].cpu()
        marks = dbeta.cpu()
        R = p.num_v_heads // p.num_qk_heads
        per = {}
        for slot in range(rows.shape[0]):
            t0, valid = int(rows[slot, 0]), int(rows[slot, 1])
            if valid != 64:
                continue
            for hk in range(p.num_qk_heads):
                m = marks[t0:t0 + 23, hk].tolist()
                seq = [("qk_wait", m[1] - m[0])]
                prev = m[1]
                for r in range(R):
                    base = 2 + 9 * r
                    seq.append((f"h{r}_start", m[base] - prev))
                    for j, name in enumerate(HEAD_MARKS):
                        seq.append((f"h{r}_{name}", m[base + 1 + j] - m[base + j]))
                    prev = m[base + 7]
                seq.append(("final_sync", m[20] - prev))
                seq.append(("store_rows", m[21] - m[20]))
                seq.append(("total", m[21]))
                seq.append(("total_ns", m[22]))
                for name, val in seq:
                    per.setdefault(name, []).append(val)
        ctas = len(per["total"])
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        grid = rows.shape[0] * p.num_qk_heads
        kernel_ms = a.elapsed_time(b)
        persistent = os.environ.get("PERSISTENT") == "1"
        cta_ns = None if persistent else statistics.fmean(per["total_ns"])
        out = {"row": row.key, "kernel_ms": round(kernel_ms, 4), "ctas_sampled": ctas, "grid": grid,
               "clock_ghz": None if persistent else round(statistics.fmean(per["total"]) / cta_ns, 3),
               # an SM's time per CTA beyond the stamped span (launch, slot_rows read, exit): the gap between CTAs
               "gap_per_cta_ns": None if persistent else round(kernel_ms * 1e6 * sms / grid - cta_ns),
               "ns_per_item_per_sm": round(kernel_ms * 1e6 * sms / grid),
               "cycles_median": {k: round(statistics.median(v)) for k, v in per.items()},
               "cycles_mean": {k: round(statistics.fmean(v)) for k, v in per.items()}}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
