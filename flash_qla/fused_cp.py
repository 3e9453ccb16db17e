"""Intra-card CP on the fused kernel: the forward of a few long sequences without gdn_prepare's round trip.

The split CP path (forward._cp_forward) runs gdn_prepare over every token and the chain kernel's pre-pass and output
pass over what it stored, so q / k are read twice and Agb / P make a round trip through memory. Here:
  1. gdn_plan (chunk offsets), then gdn_cp_scan: each chunk's summed g and largest beta |k|^2, all that
     gdn_cp_plan's warm-up walk reads (k, g and beta only);
  2. gdn_cp_plan: the segment and warm-up tables (flash_qla/cp.py);
  3. gdn_fwd_fused's "state" build over every (segment, v-head) warm-up and its "trans" build (fallback heads only,
     beside it on a side stream), then gdn_cp_combine: forward.cp_pre_pass_and_combine, as the split path;
  4. gdn_fwd_fused's out build over the segments as independent sequences from the combined entering states.
The output pass is the fused kernel at the segments' fill, so CP costs the fused kernel's time on the same tokens
spread over S x Hv chains, plus the scan, the warm-ups and the combine.
"""
from __future__ import annotations

import torch

from . import forward as fwd
from .gates import KernelGate
from .launch import CHUNK, FUSED_KERNEL, empty, launch
from .planner import FUSED_PERSISTENT_CTAS, ForwardPlan
from .tuning import settings
from .validation import Problem

SCAN_KERNEL = "gdn_cp_scan"


def scan_bounds(problem: Problem, tag: str, k, g, beta, gate: KernelGate, cu, offsets, l2norm: bool, stream) -> dict:
    """gdn_cp_scan's per-chunk tables, as forward._cp_tables reads them: gam_t [Hv, TC] (each chunk slot's last
    row: the chunk's summed g) and bkk_max [Hv, TC / 64], with the CP inputs' device, cu, offsets."""
    dev = k.device
    T, Hv, N = problem.batch * problem.tokens, problem.num_v_heads, problem.num_seqs
    TC = fwd.chunk_slots(problem) * CHUNK
    tiles = empty(Hv * TC + Hv * (TC // CHUNK), device=dev, dtype=torch.float32)  # one allocation for both
    gam_t, bkk_max = tiles[:Hv * TC].view(Hv, TC), tiles[Hv * TC:].view(Hv, TC // CHUNK)
    launch(SCAN_KERNEL, {"dtype": tag, "K": problem.head_dim_k}, dev,
           {"T": T, "TC": TC, "Hq": problem.num_qk_heads, "Hv": Hv, "N": N, "l2norm": int(l2norm),
            "gate_mode": gate.mode},
           {"k": k.data_ptr(), "g": g.data_ptr(), "beta": beta.data_ptr(), "cu_seqlens": cu.data_ptr(),
            "chunk_offsets": offsets.data_ptr(), "gam_t": gam_t.data_ptr(), "bkk_max": bkk_max.data_ptr(),
            **gate.pointers(g)}, stream)
    return dict(device=dev, gam_t=gam_t, bkk_max=bkk_max, cu=cu, offsets=offsets, TC=TC)


def forward(problem: Problem, plan: ForwardPlan, tag: str, q, k, v, g, beta, h0, cu_seqlens, output_final_state: bool,
            l2norm: bool, gate: KernelGate, stream):
    """(o [B, T, Hv, V], the final states: a forward.SegmentStates, or an empty tensor) of a plain forward on the
    plan's segments of plan.segment_chunks chunks, the out pass at V block plan.block_v. q, k, v, g, beta packed
    (g / beta float32), h0 [N, Hv, K, V] fp32 or None, cu_seqlens int32 on the device."""
    dev = q.device
    Hv, K, V = problem.num_v_heads, problem.head_dim_k, problem.head_dim_v
    cu, offsets, _, _ = fwd._offsets(problem, cu_seqlens, dev, stream)
    t = scan_bounds(problem, tag, k, g, beta, gate, cu, offsets, l2norm, stream)
    t["h0"] = h0
    seg, start, fallback, _ = fwd._cp_tables(problem, plan.segment_chunks, t["TC"], t, stream)
    o = empty(problem.batch, problem.tokens, Hv, V, device=dev, dtype=q.dtype, output="o")
    sizes, pointers = fwd.fused_args(problem, q, k, v, g, beta, gate, cu, o)
    ctas = settings.fused_ctas_max or FUSED_PERSISTENT_CTAS
    # the pre-pass builds read no h0, q or o and store [S, Hv, K, V] (their sizes' N, h0_rows and ht_rows: S)
    pre = dict(pointers, cu_seqlens=seg.cu.data_ptr(), start=start.data_ptr(), fallback=fallback.data_ptr(),
               h0=o.data_ptr(), state_idx=seg.cu.data_ptr())
    h_in = fwd.cp_pre_pass_and_combine(FUSED_KERNEL, problem, tag, seg, fallback,
                                       dict(sizes, use_h0=0, store_ht=1, max_ctas=ctas), pre, "ht", h0, False,
                                       stream, (start,), variant_axes={"l2norm": int(l2norm), "order": 0})
    S = seg.count
    ht_seg = empty(S, Hv, K, V, device=dev, dtype=torch.float32) if output_final_state else o
    launch(FUSED_KERNEL, fwd.fused_variant(problem, tag, plan.block_v, l2norm, "out"), dev,
           dict(sizes, N=S, use_h0=1, store_ht=int(output_final_state), state_mode=0, h0_rows=S, ht_rows=S,
                max_ctas=settings.fused_ctas_max or plan.fused_ctas or FUSED_PERSISTENT_CTAS),
           dict(pointers, cu_seqlens=seg.cu.data_ptr(), h0=h_in.data_ptr(), ht=ht_seg.data_ptr(),
                state_idx=seg.cu.data_ptr()), stream)
    if not output_final_state:
        return o, o.new_empty(0)
    # a zero-length sequence keeps its initial state
    return o, fwd.SegmentStates(ht_seg, seg.last, seg.last, h0, seg.count)
