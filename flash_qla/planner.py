"""Launch planning for the chain kernels: how many V columns each CTA owns.

One CTA walks one (sequence, v-head, V-block) chain of chunks, so there are N * Hv * V / BV chains and
each SM runs one at a time (the chain kernels' shared memory allows one CTA per SM). A chain kernel's time
is about waves * chain time, waves = ceil(chains / SMs). A narrower block gives more chains but does not
make a chain proportionally shorter (the per-chunk latency chain of GEMMs stays), so narrow only when that
adds no wave; ties go to the wider block (less redundant work).
Chain costs (relative per-chunk time of one chain, H200, CUDA graphs):
  OUT_CHAIN_COST     gdn_fwd_chain (state in registers; one consumer warpgroup per 64 columns), plain forward minus
                     gdn_prepare (after the bank-conflict fixes): one wave either
                     way, BV = 128 costs 1.37-1.39x BV = 64 (TP8 1x32768 0.85 vs 1.16 ms, TP8 1x8192 0.21 vs 0.30,
                     TP2 1x8192 0.22 vs 0.30, TP8 1x2048 0.060 vs 0.083); TP1 4096x8 BV = 128 (4 waves) 0.65 ms
                     vs BV = 64 (8 waves) 0.85. (Was 1.25 before them; no matrix row's plan changes.)
  STAGED_CHAIN_COST  chains that stage through shared memory (gdn_bwd_recompute's save build, gdn_bwd_dh), measured
                     on gdn_bwd_recompute's former out build: BV = 32 0.86 of BV = 64 (TP8 1x32768: 2.82 -> 2.44 ms in
                     total), BV = 128 2.06 (TP1 4096x8: 3.74 ms at 8 waves of 64 vs 3.82 ms at 4 of 128).
"""
from __future__ import annotations

import functools
import math
from typing import Dict, Iterable

OUT_CHAIN_COST = {64: 1.0, 128: 1.38}
STAGED_CHAIN_COST = {32: 0.86, 64: 1.0, 128: 2.06}


def chain_time(chains: int, head_dim_v: int, bv: int, num_sms: int, costs: Dict[int, float] = OUT_CHAIN_COST) -> float:
    """Relative time per chunk of `chains` (sequence or CP segment, v-head) chains split into V blocks of bv:
    waves x one chain's per-chunk cost."""
    return math.ceil(chains * (head_dim_v // bv) / num_sms) * costs.get(bv, bv / 64)


def plan_block_v(num_seqs: int, num_v_heads: int, head_dim_v: int, available: Iterable[int], num_sms: int,
                 costs: Dict[int, float] = OUT_CHAIN_COST) -> int:
    blocks = tuple(sorted(set(available)))
    if not blocks:
        raise ValueError(f"no V block is built for V = {head_dim_v}")
    return _plan(num_seqs * num_v_heads, head_dim_v, blocks, num_sms, tuple(sorted(costs.items())))


@functools.lru_cache(maxsize=4096)  # every forward asks; eager calls of small rows are host-bound
def _plan(chains: int, head_dim_v: int, blocks: tuple, num_sms: int, costs: tuple) -> int:
    table = dict(costs)
    # min keeps the first of equals: the widest block
    return min(reversed(blocks), key=lambda bv: chain_time(chains, head_dim_v, bv, num_sms, table))


# gdn_prepare: one CTA per (chunk, group of hpc v-heads sharing a q / k head). The group shares the prologue
# (chunk lookup, q / k tiles, g / beta loads, both 64 x 64 x K products); each head adds its solve and stores.
PREPARE_MAX_HEADS = 4      # aot/kernels/gdn_prepare.py HPC_MAX
PREPARE_CTAS_PER_SM = 4    # its shared memory and register budget
PREPARE_SHARED_COST = 0.5  # the shared part and one head's part, relative to a one-head CTA (ncu samples)
PREPARE_HEAD_COST = 0.5


@functools.lru_cache(maxsize=4096)
def plan_heads_per_cta(chunk_slots: int, num_v_heads: int, num_qk_heads: int, num_sms: int) -> int:
    """v-heads per gdn_prepare CTA: a divisor of the GVA ratio Hv / Hq (so one CTA reads one q / k head), at
    most PREPARE_MAX_HEADS, minimising waves x CTA time (more heads per CTA: fewer, longer CTAs)."""
    ratio = num_v_heads // num_qk_heads
    slots = PREPARE_CTAS_PER_SM * num_sms

    def cost(d: int) -> float:
        return math.ceil(chunk_slots * num_v_heads / d / slots) * (PREPARE_SHARED_COST + d * PREPARE_HEAD_COST)

    candidates = [d for d in range(1, PREPARE_MAX_HEADS + 1) if ratio % d == 0]
    return min(reversed(candidates), key=cost)  # ties: the most heads per CTA


# The plain forward's two paths (flash_qla/forward.py): gdn_prepare + gdn_fwd_chain, or gdn_fwd_fused alone. Measured on the
# H200 (K = V = 128, bf16):
# gdn_fwd_fused: one chain's 64-token chunk by V block (BV = 64: its aux warpgroup sets the pace; BV = 128: two
# consumer warpgroups share the SM's tensor cores and issue slots with the aux, TP8 1x32768 CP off 1.76 ms / 512)
FUSED_CHUNK_US = {64: 2.35, 128: 3.44}
SPLIT_CHUNK_US = 1.70    # gdn_fwd_chain at BV = 64 (times OUT_CHAIN_COST for its other blocks)
PREPARE_CTA_US = 11.4    # a one-head gdn_prepare CTA at four CTAs per SM (an hpc-head CTA: PREPARE_SHARED_COST +
                         # hpc * PREPARE_HEAD_COST times that, as plan_heads_per_cta weighs it)
PREPARE_MIN_US = 10.0    # a launch's floor
# use_qk_l2norm_in_kernel: gdn_prepare normalises (and stores) each CTA's q / k rows, about one more one-head CTA's
# time per CTA; gdn_fwd_fused takes Q Q^T and the norms' scalings on its aux warpgroup (2B-TP1 4096x8: split 0.355 ->
# 0.537 ms, fused 0.333 -> 0.402; TP8 4096x8: 0.175 -> 0.205, 0.168 -> 0.227)
L2NORM_PREPARE_CTAS = 1.0
L2NORM_FUSED_CHUNK_US = 0.7


def _chain_us(chunks: float, chains: float, blocks_per_chain: int, num_sms: int, per_chunk_us: float) -> float:
    """`chunks` (summed over the chains) in `chains` chains of `blocks_per_chain` CTAs each, one CTA per SM: the
    longer of the average chain and the total work spread over the SMs (the host knows only the token and
    sequence counts, not the lengths)."""
    return max(chunks / chains, chunks * blocks_per_chain / num_sms) * per_chunk_us


def _fused_us(tokens: int, num_seqs: int, num_v_heads: int, head_dim_v: int, num_sms: int, bv: int,
              l2norm: bool) -> float:
    chunks = tokens / 64
    return _chain_us(chunks * num_v_heads, num_seqs * num_v_heads, head_dim_v // bv, num_sms,
                     FUSED_CHUNK_US[bv] + (L2NORM_FUSED_CHUNK_US if l2norm else 0.0))


# A packed batch of several sequences (no CP) gives chains of unequal lengths that the host does not see (it knows
# only the token and sequence counts). Its CTAs do not run in waves: gdn_plan dispatches the longest sequences first
# and the short chains fill in behind, so a chain kernel takes about the longest chain or all the work spread over
# the SMs, whichever is longer (_chain_us). The longest chain is taken as IRREGULAR_SKEW times the mean: the
# matrix's batches have 2.4x and 3.1x (32k_8seq, 8k_8seq). Measured on the H200 (gdn_bwd_dh):
# hk4_hv8 8k_8seq and 32k_8seq (64 chains) run 15% and 9%
# faster in the whole backward at BV = 32 (256 CTAs, "two waves") than at 64; hk16_hv32's (256 chains) stay at 64,
# as this model says.
IRREGULAR_SKEW = 2.0


@functools.lru_cache(maxsize=4096)
def plan_irregular_block_v(tokens: int, num_seqs: int, num_v_heads: int, head_dim_v: int, available: tuple,
                           num_sms: int, costs: tuple) -> int:
    """The V block for the chains of a batch of num_seqs > 1 sequences of unknown lengths (ties: the wider)."""
    table = dict(costs)
    chunks = tokens / 64 * num_v_heads
    # the longest chain, IRREGULAR_SKEW times the mean, is the mean of IRREGULAR_SKEW times fewer chains
    chains = num_seqs * num_v_heads / IRREGULAR_SKEW
    return min(sorted(set(available), reverse=True),
               key=lambda bv: _chain_us(chunks, chains, head_dim_v // bv, num_sms, table.get(bv, bv / 64)))


@functools.lru_cache(maxsize=4096)
def plan_fused_block_v(tokens: int, num_seqs: int, num_v_heads: int, head_dim_v: int, num_sms: int,
                       blocks: tuple, l2norm: bool = False) -> int:
    """gdn_fwd_fused's V block among the built ones: 64 while it keeps the chains within about a wave, 128 (half
    the CTAs, each chunk 1.46x as long) once narrower blocks would add waves. Ties: the wider block."""
    return min(sorted(blocks, reverse=True),
               key=lambda bv: _fused_us(tokens, num_seqs, num_v_heads, head_dim_v, num_sms, bv, l2norm))


@functools.lru_cache(maxsize=4096)
def prefer_fused(tokens: int, num_seqs: int, num_v_heads: int, head_dim_v: int, num_sms: int, split_bv: int,
                 heads_per_cta: int, l2norm: bool = False, fused_bv: int = 64) -> bool:
    """Whether gdn_fwd_fused at V block fused_bv (no materialised Agb / P, but slower chunks than gdn_fwd_chain)
    beats gdn_prepare + gdn_fwd_chain at V block split_bv. It wins where the prepare pass weighs most: one wave of
    chains with many heads (TP1 1x32768, 2B 8192x4), or where gdn_fwd_chain must take BV = 128."""
    chunks = tokens / 64  # of the packed batch, per head
    chains = num_seqs * num_v_heads
    fused = _fused_us(tokens, num_seqs, num_v_heads, head_dim_v, num_sms, fused_bv, l2norm)
    split_chain = _chain_us(chunks * num_v_heads, chains, head_dim_v // split_bv, num_sms,
                            SPLIT_CHUNK_US * OUT_CHAIN_COST.get(split_bv, split_bv / 64))
    prepare_ctas = (chunks + num_seqs) * num_v_heads / heads_per_cta
    per_cta = PREPARE_SHARED_COST + heads_per_cta * PREPARE_HEAD_COST + (L2NORM_PREPARE_CTAS if l2norm else 0.0)
    prepare = max(PREPARE_MIN_US, prepare_ctas * PREPARE_CTA_US * per_cta / (PREPARE_CTAS_PER_SM * num_sms))
    return fused < split_chain + prepare
