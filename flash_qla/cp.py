"""Gate-driven intra-card context parallelism (CP) for the forward.

When sequences x v-heads cannot fill the GPU (one long sequence, few heads), each sequence is cut into
segments of L chunks that run in parallel:
  1. pre-pass (gdn_fwd_chain, mode "state"): for every segment s after a sequence's first, the state-only chain
     from S = 0 over the last w chunks of segment s - 1 (the warm-up) -> Z[s];
     (mode "trans", fallback heads only) the exact transition M[s] of segment s - 1 -> M[s];
  2. gdn_cp_combine: h_in[s] = Z[s] + (fallback ? M[s] h_in[s-1] : 0), serially over a sequence's segments;
  3. gdn_fwd_chain (the output pass) over the segments as independent sequences from h_in; the final state is the
     last segment's.
The forward may run the same three steps on the fused kernel instead (flash_qla/fused_cp.py: gdn_fwd_fused's "state"
/ "trans" builds and its out build, the tables' bounds from gdn_cp_scan rather than gdn_prepare).
Warm-up bound: with Phi the transition over w chunks, ||Phi||_2 <= exp(sum of g over them) as long as
every token's factor (I - beta k k^T) is non-expansive, i.e. 0 <= beta ||k||^2 <= 2. w is the fewest
trailing chunks of segment s - 1 whose summed g is <= WARMUP_LOG_DECAY (-10): dropping Phi S then errs by
at most e^-10 ~ 4.5e-5 of the state entering the warm-up, below bf16 resolution (2^-8). A (segment, head)
whose previous segment never decays that far (g = 0 heads), or has a token with beta ||k||^2 outside
[0, 2], falls back to the exact transition (w = L, M computed), so CP meets the non-CP tolerances.
Everything is computed on the device (no host synchronisation): the segment tables are padded to an
upper bound of the segment count, and padding segments are empty.
Backward (reverse) CP, for the dh chain gdn_bwd_dh, which walks chunks last to first: the gradient of the state
LEAVING segment s depends on everything after it. Its warm-up runs the dh chain from dS = 0 backwards over the
first w chunks of segment s + 1 (the fewest whose summed g is <= WARMUP_LOG_DECAY: ||Phi^T|| = ||Phi||, the same
bound), or over all of segment s + 1 with its exact transposed transition M^T for the fallback heads; the combine
then runs last segment to first from the user's dht (reverse_warmup_tables; FlashQLA's bidirectional warm-up).
The tables are one gdn_cp_plan launch (segment_tables / warmup_tables below are its torch form, the tested
specification), so eager calls plan CP too, with the path's host time in the cost (with ~80 torch ops
instead, ~1.2 ms of host time a call, CP used to be planned only under capture).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .planner import OUT_CHAIN_COST, chain_time
from .tuning import settings

CHUNK = 64
WARMUP_LOG_DECAY = -10.0
SEGMENT_CHUNKS = (8, 16, 32, 64, 128, 256)  # candidate segment lengths L, in chunks
PRE_PASS_COST = 0.6   # a state-only chain chunk (3 GEMMs, no output) relative to a forward chunk (5 GEMMs)
FALLBACK_SHARE = 0.5  # assumed share of (segment, head) pairs whose decay does not bound the warm-up
COMBINE_COST = 1.5    # one serial combine step with a fallback head, in forward-chunk times (H200, torch.profiler:
                      # 16 steps 0.059 ms, ~3.7 us a step against a ~2.5 us forward chunk)
LAUNCH_COST = 20.0    # CP's fixed GPU cost, in forward-chunk times: gdn_cp_plan and four more launches (~0.05 ms)
# The backward's segments run two chain kernels, gdn_bwd_recompute's save build and gdn_bwd_dh, two pre-passes (the
# recompute's warm-ups / transitions and the dh chain's reverse ones) and two serial combines, the dh chain's pre-pass
# and combine on a stream of their own beside the recompute's (flash_qla/backward.py): the two pre-passes' chains share
# the waves and the two combines' serial steps overlap, so one combine's steps count. The save build's CTAs (78 KB)
# pair up on an SM, the dh chain's do not: paired_share of the chain time counts waves of two CTAs per SM. Fitted on
# the H200 with the save chain beside the dh chain (a sweep of 21 shapes, hv 8-64, 8k-128k tokens, one to eight
# sequences): the chosen L is within 0.7% of the best swept one on each. Counting one pre-pass (a fit with the chains
# in order) kept CP on hv32 single sequences, 7-13% slower than without. Counting both combines and each pre-pass's
# waves apart left short single sequences at few heads without CP (H100, scripts/plan_sweep.py --pass bwd: 4096
# tokens at 4 / 8 v-heads 1.55x / 1.25x the best plan). CP is taken whenever predicted faster.
BACKWARD_PLAN = {"combines": 1, "paired_share": 0.4, "pre_passes": 2}


def plan_segment_chunks(tokens: int, num_seqs: int, num_v_heads: int, head_dim_k: int, head_dim_v: int,
                        num_sms: int, blocks, chain_costs=None, combines: int = 1, paired_share: float = 0.0,
                        pre_passes: int = 1) -> Optional[int]:
    """L (chunks per segment) for the backward's recompute (the forward's CP is part of planner.plan_forward), or
    None when CP does not pay. A cost model in forward-chunk times, from what the host knows without a
    synchronisation (tokens, sequence count; lengths assumed equal): time = waves x chain length x chain cost per
    chunk, for the plain chain and for each L (plus the pre-pass, whose long chains are the fallback pairs' Z and M:
    FALLBACK_SHARE of them assumed, the warm-ups of the others being a few chunks; the serial combine; the extra
    launches). Device time alone: a replayed plan's host work is the same few microseconds with or without CP.
    chain_costs: the per-chunk cost by V block of the chain kernel that runs the segments (STAGED_CHAIN_COST for the
    recompute). CP is taken when its predicted time is below the plain chain's. combines: serial combines per segment
    on the critical path; paired_share: the share of the chain time whose CTAs pair up on an SM (waves of two per SM);
    pre_passes: pre-pass builds per segment, side by side (their chains share the waves; BACKWARD_PLAN). Memoised:
    every backward asks."""
    if settings.force_segment_chunks is not None:
        return settings.force_segment_chunks or None
    costs = (tuple(SEGMENT_CHUNKS), PRE_PASS_COST, FALLBACK_SHARE, COMBINE_COST, LAUNCH_COST,
             tuple(sorted((chain_costs or OUT_CHAIN_COST).items())), combines, paired_share, pre_passes)
    return _plan(tokens, num_seqs, num_v_heads, head_dim_k, head_dim_v, num_sms, tuple(blocks), costs)


@functools.lru_cache(maxsize=4096)
def _plan(tokens, num_seqs, num_v_heads, head_dim_k, head_dim_v, num_sms, blocks, costs) -> Optional[int]:
    (segment_chunks, pre_pass_cost, fallback_share, combine_cost, launch_cost, chain_costs, combines,
     paired_share, pre_passes) = costs
    chain_costs = dict(chain_costs)
    if tokens == 0 or num_seqs == 0:
        return None
    per_seq = math.ceil(tokens / CHUNK / num_seqs)

    def waves_time(chains: int, length: float, slots: int) -> float:  # with the best of the built V blocks
        return length * min(chain_time(chains, head_dim_v, bv, num_sms * slots, chain_costs) for bv in blocks
                            if bv <= head_dim_v)

    def chains_time(chains: int, length: float) -> float:
        return paired_share * waves_time(chains, length, 2) + (1.0 - paired_share) * waves_time(chains, length, 1)

    best, best_l = chains_time(num_seqs * num_v_heads, per_seq), None
    for L in segment_chunks:
        if L >= per_seq:
            break
        per_seq_segments = math.ceil(per_seq / L)
        segments = num_seqs * per_seq_segments
        main = chains_time(segments * num_v_heads, L)
        pre_chains = segments * num_v_heads * (head_dim_v + head_dim_k) // 64 * fallback_share
        pre = max(1, math.ceil(pre_passes * pre_chains / num_sms)) * L * pre_pass_cost
        device = main + pre + per_seq_segments * combines * combine_cost + launch_cost
        if device < best:
            best, best_l = device, L
    return best_l


COMBINE_COLUMNS = (8, 16, 32)  # gdn_cp_combine's built V columns per CTA


def combine_variant(K: int, V: int, num_v_heads: int, num_seqs: int, num_sms: int) -> dict:
    """gdn_cp_combine's build: the fewest V columns per CTA whose grid still fits one CTA an SM. A step's products
    scale with the columns while its M load does not, so narrow CTAs shorten the serial walk; more CTAs than SMs (at
    K = 128 its two 64 KB M buffers leave room for one an SM) would queue a fallback walk behind another."""
    for bvc in COMBINE_COLUMNS:
        if bvc <= V and V // bvc * num_v_heads * num_seqs <= num_sms:
            return {"K": K, "V": V, "BVC": bvc}
    return {"K": K, "V": V, "BVC": min(COMBINE_COLUMNS[-1], V)}


def max_segments(tokens: int, num_seqs: int, L: int) -> int:
    """An upper bound of sum over sequences of ceil(chunks_n / L), from sizes the host knows."""
    return (math.ceil(tokens / CHUNK) + num_seqs + L - 1) // L + num_seqs


@dataclass
class Segments:
    L: int
    count: int              # S: segment slots (an upper bound of the segment count, max_segments)
    cu: torch.Tensor        # [S + 1] int32: token where segment i starts (padding: tokens)
    slot: torch.Tensor      # [S + 1] int32: chunk slot of segment i's first chunk
    base: torch.Tensor      # [N + 1] int32: first segment of sequence n
    last: torch.Tensor      # [N] integer: last segment of sequence n (-1: empty sequence)
    first: Optional[torch.Tensor] = None  # [S] bool (torch form only): starts its sequence or is padding


def segment_tables(cu: torch.Tensor, offsets: torch.Tensor, tokens: int, L: int) -> Segments:
    """cu, offsets: [N + 1] int32 on the device (cu_seqlens and gdn_plan's chunk offsets)."""
    N = cu.numel() - 1
    S = max_segments(tokens, N, L)
    cu64, off64 = cu.long(), offsets.long()
    nseg = (off64[1:] - off64[:-1] + L - 1) // L
    base = torch.cat([nseg.new_zeros(1), torch.cumsum(nseg, 0)])
    i = torch.arange(S, device=cu.device)
    n = torch.searchsorted(base[1:], i, right=True).clamp(max=max(N - 1, 0))
    j = i - base[n]
    valid = i < base[N]
    seg_cu = torch.where(valid, cu64[n] + j * (L * CHUNK), tokens)
    seg_slot = torch.where(valid, off64[n] + j * L, off64[N])
    tail_cu, tail_slot = seg_cu.new_full((1,), tokens), off64[N:]
    return Segments(L=L, count=S, cu=torch.cat([seg_cu, tail_cu]).int(), slot=torch.cat([seg_slot, tail_slot]).int(),
                    base=base.int(), last=torch.where(nseg > 0, base[1:] - 1, -1), first=(j == 0) | ~valid)


def warmup_tables(seg: Segments, gam_t: torch.Tensor, bkk_max: torch.Tensor):
    """(start [S, Hv] int32: the token where segment s's warm-up begins, fallback [S, Hv] int32).

    gdn_prepare's chunk-aligned outputs: gam_t [Hv, slots * 64], the chunk-local cumulative g (row 63 of a full
    chunk = its sum of g), and bkk_max [Hv, slots], each chunk's largest beta |k|^2 (-1 for no token): whether
    every factor (I - beta k k^T) of the previous segment is non-expansive, which the decay bound needs.
    The torch form of the gdn_cp_plan kernel's warm-up (the specification its GPU test compares against)."""
    L, S = seg.L, seg.count
    Hv = gam_t.shape[0]
    totals = gam_t.view(Hv, -1, CHUNK)[:, :, CHUNK - 1]                      # [Hv, slots]
    worst = bkk_max                                                          # [Hv, slots]
    prev = (seg.slot[:S, None].long() - L + torch.arange(L, device=gam_t.device)).clamp(min=0)
    suffix = totals[:, prev].flip(-1).cumsum(-1)                              # [Hv, S, L]: last w chunks' g
    hit = suffix <= WARMUP_LOG_DECAY
    decays = hit.any(-1)
    w = torch.where(decays, hit.int().argmax(-1) + 1, L)                      # [Hv, S]
    expands = (worst[:, prev].amax(-1) > 2.0).T                              # [S, Hv]
    end = seg.cu[:S].long()
    fallback = (~decays.T | expands) & ~seg.first[:, None]
    w = torch.where(fallback, L, w.T)
    w = torch.where(seg.first[:, None], 0, w)
    start = (end[:, None] - w * CHUNK).int()
    return start.contiguous(), fallback.int().contiguous()


def trailing_row(seg: Segments, num_seqs: int, start: torch.Tensor, fallback: torch.Tensor, gam_t: torch.Tensor,
                 bkk_max: torch.Tensor) -> torch.Tensor:
    """Extend the last sequence by one empty segment (the padding row after its last segment), in place: its warm-up
    (start, fallback) over the last segment's chunks as warmup_tables gives any segment's, and seg.base[N] past it,
    so the pre-pass and gdn_cp_combine give that row's h_in = the state LEAVING the last sequence, before the output
    chain runs (multi-GPU CP sends it on from there). Needs a padding row and a last sequence of whole chunks (the
    pre-pass chains end on a chunk boundary): the caller checks both. On the device, no host read; returns the
    row's index ([1] int64)."""
    L, Hv = seg.L, gam_t.shape[0]
    row = seg.base[num_seqs:].long()                                          # [1]: the first padding row
    slot = seg.slot.long()
    chunks = slot[row] - slot[row - 1]                                        # the last segment's, <= L
    j = torch.arange(L, device=gam_t.device)
    inside = j < chunks
    idx = (slot[row] - 1 - j).clamp(min=0)                                    # its chunks, last first
    totals = gam_t.view(Hv, -1, CHUNK)[:, idx, CHUNK - 1]                     # [Hv, L]
    suffix = torch.where(inside, totals, 0.0).cumsum(-1)
    hit = (suffix <= WARMUP_LOG_DECAY) & inside
    decays = hit.any(-1)
    expands = torch.where(inside, bkk_max[:, idx], -1.0).amax(-1) > 2.0
    back = ~decays | expands
    w = torch.where(back, chunks, hit.int().argmax(-1) + 1)                   # [Hv] chunks before the end
    start.index_copy_(0, row, (seg.cu.long()[row] - w * CHUNK).int()[None])
    fallback.index_copy_(0, row, back.int()[None])
    seg.base[num_seqs:] += 1
    return row


def reverse_warmup_tables(seg: Segments, cu: torch.Tensor, gam_t: torch.Tensor, bkk_max: torch.Tensor):
    """(end [S, Hv] int32, fallback [S, Hv] int32) for the backward: segment s's reverse warm-up is the token range
    [seg.cu[s + 1], end[s, h]) at the start of segment s + 1 (empty for a sequence's last segment and padding),
    fallback where segment s + 1's decay never reaches the bound or a token of it has beta |k|^2 outside [0, 2]
    (then the range is all of segment s + 1 and its exact transposed transition is used). Chunk totals are
    gamma's row 63 (gdn_prepare leaves g = 0 past a sequence's end, so a partial chunk's row 63 is its sum).
    The torch form of the gdn_cp_plan kernel's reverse walk (its GPU test compares against it)."""
    L, S = seg.L, seg.count
    Hv = gam_t.shape[0]
    dev = gam_t.device
    totals = gam_t.view(Hv, -1, CHUNK)[:, :, CHUNK - 1]                      # [Hv, slots]
    i = torch.arange(S, device=dev)
    n = torch.searchsorted(seg.base[1:].long(), i, right=True).clamp(max=cu.numel() - 2)
    seq_end = cu.long()[n + 1]
    nxt_cu = seg.cu[1:].long()                                                # segment s + 1's first token
    nxt_slot = seg.slot[1:].long()
    has_next = (i < seg.base[-1].long()) & (nxt_cu < seq_end)
    n_next = torch.where(has_next, torch.clamp((seq_end - nxt_cu + CHUNK - 1) // CHUNK, max=L), 0)   # [S]
    u = torch.arange(L, device=dev)
    inside = u[None, :] < n_next[:, None]                                     # [S, L]
    idx = (nxt_slot[:, None] + u).clamp(max=totals.shape[1] - 1)
    prefix = torch.where(inside, totals[:, idx], 0.0).cumsum(-1)              # [Hv, S, L]: first w chunks' g
    hit = (prefix <= WARMUP_LOG_DECAY) & inside
    decays = hit.any(-1)
    w = torch.where(decays, hit.int().argmax(-1) + 1, L).T                   # [S, Hv]
    expands = torch.where(inside, bkk_max[:, idx], -1.0).amax(-1).T > 2.0    # [S, Hv]
    fallback = (~decays.T | expands) & has_next[:, None]
    w = torch.where(fallback, L, w)
    end = torch.minimum(nxt_cu[:, None] + w * CHUNK, seq_end[:, None])
    end = torch.where(has_next[:, None], end, nxt_cu[:, None])
    return end.int().contiguous(), fallback.int().contiguous()
