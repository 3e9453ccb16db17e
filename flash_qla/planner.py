"""Launch planning for the forward: how many V columns each CTA owns.

One CTA walks one (sequence, v-head, V-block) chain of chunks, so there are N * Hv * V / BV chains and
each SM runs one at a time (the forward's shared memory allows one CTA per SM). The forward's time is
about waves * chain time, waves = ceil(chains / SMs). A narrower block gives more chains but does not
make a chain proportionally shorter (Q K^T, the gated inverse and the barriers are per chunk, whatever
the width). Measured on an H200 with the standard matrix, forward kernel time only (gdn_prepare's share
taken out): a BV = 32 chain costs 0.86 of a BV = 64 one (TP8 1x32768, one wave either way: 2.82 -> 2.44 ms
in total), a BV = 128 chain 2.06 (TP1 4096x8: 3.74 ms at 8 waves of BV = 64 vs 3.82 ms at 4 of BV = 128).
So narrow only when that adds no wave; ties go to the wider block (less redundant work).
"""
from __future__ import annotations

import math
from typing import Iterable

CHAIN_COST = {32: 0.86, 64: 1.0, 128: 2.06}  # relative per-chunk time of one chain (H200 measurements)


def chain_time(chains: int, head_dim_v: int, bv: int, num_sms: int) -> float:
    """Relative time per chunk of `chains` (sequence or CP segment, v-head) chains split into V blocks of bv:
    waves x one chain's per-chunk cost."""
    return math.ceil(chains * (head_dim_v // bv) / num_sms) * CHAIN_COST.get(bv, bv / 64)


def plan_block_v(num_seqs: int, num_v_heads: int, head_dim_v: int, available: Iterable[int], num_sms: int) -> int:
    blocks = sorted(set(available))
    if not blocks:
        raise ValueError(f"no V block is built for V = {head_dim_v}")
    # min keeps the first of equals: the widest block
    return min(reversed(blocks), key=lambda bv: chain_time(num_seqs * num_v_heads, head_dim_v, bv, num_sms))
