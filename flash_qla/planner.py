"""Launch planning for the chain kernels: how many V columns each CTA owns.

One CTA walks one (sequence, v-head, V-block) chain of chunks, so there are N * Hv * V / BV chains and
each SM runs one at a time (the chain kernels' shared memory allows one CTA per SM). A chain kernel's time
is about waves * chain time, waves = ceil(chains / SMs). A narrower block gives more chains but does not
make a chain proportionally shorter (the per-chunk latency chain of GEMMs stays), so narrow only when that
adds no wave; ties go to the wider block (less redundant work). The plain forward's whole plan (fused kernel,
prepare + chain, or intra-card CP; V block; gdn_prepare heads per CTA) is plan_forward's, below.
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
from typing import Dict, Iterable, NamedTuple, Optional

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


# use_qk_l2norm_in_kernel (H100 fits, scripts/plan_sweep.py --l2norm, scripts/plan_fit.py): gdn_fwd_fused's l2norm
# builds (the norms' scalings on its aux warpgroup: |q|^2 from Q Q^T at BV = 64, from row sums at BV = 128, 4.07 us a
# chunk against the plain build's 2.92) have fits of their own, L2NORM_FUSED_FIT_US as FUSED_FIT_US
# and L2NORM_STREAM_US as FUSED_STREAM_US; gdn_prepare normalises (and stores) each chunk's q / k rows once per q / k
# head, L2NORM_PREPARE_US per (chunk slot, q / k head) spread over the SMs. On batches of one-chunk sequences the
# split plan moves with the chunk's fill by L2NORM_SHORT_FILL_US = (a, b): (a + b x fill) us per round of (sequence,
# v-head) pairs over the SMs, below the multi-chunk fit at 16 tokens and above it at 64 (without it the planner took
# prepare + chain at 1.44x the fused kernel's time on 128 sequences of 64 tokens at 4 v-heads)
L2NORM_FUSED_FIT_US = {64: (2.521, 6.92), 128: (4.074, 10.12)}
L2NORM_STREAM_US = {64: (5.606, -0.307, 2.906, 2.403), 128: (8.432, 1.009, 3.331, 3.930)}
L2NORM_SHORT_FILL_US = (-3.929, 3.569)
L2NORM_PREPARE_US = 3.71


def _chain_us(chunks: float, chains: float, blocks_per_chain: int, num_sms: int, per_chunk_us: float) -> float:
    """`chunks` (summed over the chains) in `chains` chains of `blocks_per_chain` CTAs each, one CTA per SM: the
    longer of the average chain and the total work spread over the SMs (the host knows only the token and
    sequence counts, not the lengths)."""
    return max(chunks / chains, chunks * blocks_per_chain / num_sms) * per_chunk_us


# A packed batch of several sequences (no CP) gives chains of unequal lengths that the host does not see (it knows
# only the token and sequence counts). Its CTAs do not run in waves: gdn_plan dispatches the longest sequences first
# and the short chains fill in behind, so a chain kernel takes about the longest chain or all the work spread over
# the SMs, whichever is longer (_chain_us). Without the lengths on the host the longest chain is taken as IRREGULAR_SKEW
# times the mean (with them, the batch's own longest over mean, chain_skew): the
# matrix's batches have 2.4x and 3.1x (32k_8seq, 8k_8seq). Measured on the H200 (gdn_bwd_dh):
# hk4_hv8 8k_8seq and 32k_8seq (64 chains) run 15% and 9%
# faster in the whole backward at BV = 32 (256 CTAs, "two waves") than at 64; hk16_hv32's (256 chains) stay at 64,
# as this model says.
IRREGULAR_SKEW = 2.0


@functools.lru_cache(maxsize=4096)
def plan_irregular_block_v(tokens: int, num_seqs: int, num_v_heads: int, head_dim_v: int, available: tuple,
                           num_sms: int, costs: tuple, skew: float = IRREGULAR_SKEW) -> int:
    """The V block for the chains of a batch of num_seqs > 1 sequences whose longest is skew times the mean length
    (unknown lengths: IRREGULAR_SKEW; ties: the wider)."""
    table = dict(costs)
    chunks = tokens / 64 * num_v_heads
    # the longest chain, skew times the mean, is the mean of skew times fewer chains
    chains = num_seqs * num_v_heads / skew
    return min(sorted(set(available), reverse=True),
               key=lambda bv: _chain_us(chunks, chains, head_dim_v // bv, num_sms, table.get(bv, bv / 64)))


def chain_skew(tokens: int, num_seqs: int, longest: Optional[int]) -> float:
    """The longest sequence over the mean length, rounded to a tenth (plans keyed by it stay few), from the host-known
    longest sequence; IRREGULAR_SKEW when the lengths are not known."""
    if longest is None or tokens <= 0:
        return IRREGULAR_SKEW
    return max(1.0, round(longest * num_seqs / tokens, 1))


# The plain forward's plan (plan_forward), from a model fitted on an H100 by least squares over every plan of 130 grid
# and 24 standard shapes (scripts/plan_sweep.py; bench/results/h100/plan_sweep*.jsonl hold a later sweep that checks
# it, held-out shapes included). Each chain kernel runs one CTA per SM, so equal chains take rounds = ceil(CTAs / SMs)
# rounds, each (chunks per chain x a per-chunk time + a per-chain time: the state's load and store and the prologue).
# The per-chain time decides batches of short sequences: on 256 sequences of 32 tokens a fused chain costs 7.7 / 11.2
# us (BV 64 / 128) for one 2.4 / 3.5 us chunk, and gdn_prepare + gdn_fwd_chain wins by 5-24%. Counting rounds, not
# spreading chunks evenly over the SMs, sends 96 heads of one sequence to BV = 128 (one round; 1.33x faster than two
# rounds at 64). The host sees only token and sequence counts: lengths are taken equal, so a batch of unequal lengths
# can be planned far from its best (two sequences of 28672 + 4096 tokens: 1.3x).
# gdn_fwd_fused's per-chunk times (H100 sweep, bench/results/h100/plan_sweep*.jsonl, fitted by scripts/plan_fit.py):
# 2.03 / 2.92 us at BV 64 / 128 with the gated inverse made from 16-bit tiles (2.31 / 3.22 with its fp32 scratch).
# Every fit here is refitted when a kernel's time moves: fits left behind by a faster fused kernel priced it above
# its time and planned it on fewer shapes than it was best on (473 of 496 sweep rows within 3% of their best plan
# after the last refit, 427 before)
FUSED_FIT_US = {64: (2.028, 7.22), 128: (2.921, 11.21)}       # gdn_fwd_fused: (per chunk, per chain)
# gdn_fwd_fused runs at most FUSED_PERSISTENT_CTAS CTAs (aot/kernels/gdn_fwd_fused.PERSISTENT_CTAS); past that each
# walks several (sequence, v-head, V block) items, the next item's inputs and state in flight while one runs. Then,
# and for batches of one-chunk sequences below that count (H100 least squares over the batches past that count of
# scripts/short_batch_sweep.py and plan_sweep.py, scripts/plan_fit.py), an SM takes ceil(items / SMs) items of
# FUSED_STREAM_US[0] + [1] x the last chunk's fill (its tokens / 64) + [3] x the chunks before it us each, plus
# FUSED_STREAM_US[2] per round of CTAs (a CTA's first item and its ramp). Streaming, a full chunk costs [3], less than
# FUSED_FIT_US's per-chunk time: the next item's loads and products overlap the current one's chain (one persistent
# per-chunk time put 4-chunk batches of 4096+ items at 1.06-1.10x their time)
FUSED_PERSISTENT_CTAS = 528
# gdn_fwd_fused orders at most FUSED_ORDER_MAX sequences longest first (aot/kernels/gdn_fwd_fused.ORDER_MAX)
FUSED_ORDER_MAX = 128
# Batches of one-chunk sequences up to FUSED_ONE_ROUND_ITEMS items an SM run one CTA an SM instead: each CTA walks its
# items with the next item's inputs, products and state in flight, where a grid of 528 starts every item cold (H100,
# same call, bit-identical outputs, bench/results/h100/fused_ctas_ab.jsonl: 1.06-1.13x on 256-1024 items of 8-64
# tokens, e.g. TP8 64 x 8 0.0503 -> 0.0453 ms, TP1-397B 16 x 8 0.0904 -> 0.0803; 0.96-1.0x on 2048+ items of full
# chunks, which keep 528). The prediction keeps the 528-CTA model: the cap only shortens a plan it already chose.
FUSED_ONE_ROUND_ITEMS = 8
FUSED_STREAM_US = {64: (5.230, 0.192, 2.008, 2.003), 128: (8.146, 1.209, 2.712, 2.986)}
# gdn_fwd_chain "out": (per chunk, per chain), the split plan's time beyond gdn_prepare's predicted part (plan_fit.py)
CHAIN_FIT_US = {64: (1.224, 2.762), 128: (1.782, 3.703)}
# gdn_prepare: PREPARE_FIT_US[0] per CTA and [1] per CTA-head, over 4 CTAs per SM; [2] the launch's floor
PREPARE_FIT_US = (3.619, 9.625, 19.63)
# intra-card CP beyond its gdn_prepare (pre-pass, combine, out chain over segments, pick), over cp_features: a
# least-squares fit (scripts/plan_fit.py), not a physical split (the pre-pass and the out chain's rounds move
# together). Its last term, out-chain rounds x L x q/k heads / v-heads, is the q / k bytes a v-head's chain reads
# that no other v-head shares: without it the fit put CP at 18-21% under its time at 16 q/k heads for 16 v-heads
# (2B-TP1, every L), and chose CP for 2B-TP1 1x2048 at 1.16x the best plan
# Its first feature is the out chain's makespan in chunks (chain_makespan): a sequence's shorter last segment fills in
# behind the full ones, which whole rounds of L counted as a round of its own (CP up to 25% over its time on unequal
# lengths: 14336 + 2048 tokens at 32 v-heads planned at L = 32, 1.07x L = 64). The q / k megabytes gdn_prepare reads
# (the sixth): the grid's GVA ratios 2 and 4 left CP at 14% under its time at ratio 1 (2B-TP1 1x32768), where CP on
# the fused kernel, 17% faster, then lost the choice. The seventh, the makespan again on l2norm calls, is fitted on the
# l2norm rows' candidates within plan_fit.NEAR_BEST of their best with the plain terms held: without it the split CP
# was priced as if gdn_prepare's normalising were its only l2norm cost and took it over the fused CP at up to 1.19x the
# best plan (8 mixed lengths at 2 / 4 heads; 4 / 8 heads on 1x16384 and 14336 + 2048 at 1.10-1.12x)
CP_FIT_US = (2.276, -4.390, 17.005, 1.960, -0.414, 0.557, 0.064)
# intra-card CP on the fused kernel (flash_qla/fused_cp.py) beyond its out pass (the fused kernel's own model on the
# segments as sequences), over cp_fused_parts' features: (fixed: gdn_plan, gdn_cp_scan's and gdn_cp_plan's latency,
# the launches; per chunk of a fallback head's state / transition chain over a whole segment; per chunk of the
# pre-pass spread over the SMs; per serial combine step; per MB of k gdn_cp_scan reads; per round of (segment, v-head)
# pairs over the SMs: each item's ramp in the pre-pass and the out pass; with l2norm, the pre-pass chunks again: its
# builds normalise each v-head's q / k rows). A least-squares fit over the candidates within plan_fit.NEAR_BEST of
# their row's best (scripts/plan_fit.py)
CP_FUSED_US = (26.173, 1.077, 2.825, 0.688, 0.431, 30.688, 0.304)
# the share of (segment, v-head) pairs whose decay leaves them to the exact transition, as the fit's inputs have it (a
# quarter of the heads never decay: the benchmark's distribution)
CP_FUSED_FALLBACK = 0.25
WARMUP_CHUNKS = 4  # a decaying head's warm-up (the benchmark's g: -3.2 a chunk, to the -10 bound)
# use_qk_l2norm_in_kernel as a pass of its own (aot/kernels/gdn_l2norm.py: q and k read and written once), then the
# plain plan: PRENORM_US[0] + PRENORM_US[1] per MB of q and k moved (read and written; 0.395 us a MB is 2.5 TB/s, a
# copy's rate). Fitted (scripts/plan_fit.py) on each pn_ candidate of an l2norm sweep less the same plan's time in the
# plain sweep. The l2norm builds normalise algebraically on the fused kernel's aux warpgroup, its bound: at 4 v-heads
# a q / k head the pass and the plain BV = 128 kernel beat them where the heads fill the card (H100: TP1-397B 4096x8
# 1.29 ms at BV = 64, 1.06 at BV = 128, 1.014 with the pass; TP2 8192x4 0.645 / 0.533 / 0.510); at one v-head a q / k
# head (2B-TP1) the pass moves as many bytes as v and the l2norm build at BV = 128 is fastest (4096x8 0.269 ms)
PRENORM_US = (7.84, 0.395)


def prenorm_mb(tokens: int, num_qk_heads: int, head_dim_k: int, itemsize: int = 2) -> float:
    """The megabytes gdn_l2norm moves: q and k read and written once."""
    return 4 * tokens * num_qk_heads * head_dim_k * itemsize / 1e6


def prenorm_us(tokens: int, num_qk_heads: int, head_dim_k: int) -> float:
    """gdn_l2norm's predicted time."""
    return PRENORM_US[0] + PRENORM_US[1] * prenorm_mb(tokens, num_qk_heads, head_dim_k)


def after_prenorm(plain: ForwardPlan, tokens: int, num_qk_heads: int, head_dim_k: int) -> ForwardPlan:
    """The plain plan run after a gdn_l2norm pass, priced with it."""
    return plain._replace(prenorm=True,
                          predicted_us=plain.predicted_us + prenorm_us(tokens, num_qk_heads, head_dim_k))


def cheaper_l2norm(in_kernel: ForwardPlan, plain: ForwardPlan, tokens: int, num_qk_heads: int,
                   head_dim_k: int) -> ForwardPlan:
    """An l2norm forward's plan: the l2norm builds' best (in_kernel) or the plain plan after a gdn_l2norm pass,
    whichever is predicted faster."""
    return min(in_kernel, after_prenorm(plain, tokens, num_qk_heads, head_dim_k), key=lambda p: p.predicted_us)


class ForwardPlan(NamedTuple):
    path: str                        # "fused", "split" (gdn_prepare + gdn_fwd_chain), "cp" (on the split kernels) or
                                     # "cp_fused" (on gdn_fwd_fused, block_v its out pass's)
    block_v: Optional[int]           # the V block of the fused or split chain (CP: planned per segment count)
    heads_per_cta: Optional[int]     # gdn_prepare's (split)
    segment_chunks: Optional[int]    # CP's L
    predicted_us: float
    fused_ctas: Optional[int] = None  # gdn_fwd_fused's persistent grid cap (None: FUSED_PERSISTENT_CTAS)
    longest_first: bool = False       # gdn_fwd_fused walks the sequences longest first (host lengths out of order)
    prenorm: bool = False             # use_qk_l2norm_in_kernel by gdn_l2norm ahead of the plain (l2norm = 0) kernels


def _fit(table: dict, bv: int) -> tuple:
    if bv in table:
        return table[bv]
    c, f = table[64]
    return c * bv / 64, f  # a block outside the fit: per-chunk work in proportion


def _fused_stream_us(tokens: int, num_seqs: int, items: int, bv: int, num_sms: int, l2norm: bool) -> float:
    """gdn_fwd_fused with more items than CTAs (FUSED_STREAM_US): equal sequences of the mean length assumed."""
    table = L2NORM_STREAM_US if l2norm else FUSED_STREAM_US
    a, b, ramp, per_chunk = table.get(bv) or tuple(x * bv / 64 for x in table[64])
    mean = tokens / max(1, num_seqs)
    chunks = max(1, math.ceil(mean / 64))
    fill = min(1.0, max(0.0, mean - 64 * (chunks - 1)) / 64)
    per_item = a + b * fill + (chunks - 1) * per_chunk
    return (math.ceil(items / num_sms) * per_item
            + math.ceil(min(items, FUSED_PERSISTENT_CTAS) / num_sms) * ramp)


def _rounds(ctas: float, num_sms: int) -> int:
    return max(1, math.ceil(ctas / num_sms))


def short_fill_features(tokens: int, num_seqs: int, num_v_heads: int, num_sms: int) -> tuple:
    """L2NORM_SHORT_FILL_US's features on a batch of one-chunk sequences: (rounds, rounds x fill), rounds of (sequence,
    v-head) pairs over the SMs, fill the chunk's tokens / 64."""
    rounds = _rounds(num_seqs * num_v_heads, num_sms)
    return rounds, rounds * min(1.0, tokens / max(1, num_seqs) / 64)


def prepare_features(chunks: int, num_seqs: int, num_v_heads: int, num_qk_heads: int, hpc: int, num_sms: int,
                     l2norm: bool) -> tuple:
    """gdn_prepare's features, in the order of PREPARE_FIT_US + (L2NORM_PREPARE_US,): its CTAs and CTA-heads over
    PREPARE_CTAS_PER_SM an SM, the launch, and with l2norm the (chunk slot, q / k head) pairs over the SMs."""
    slots = chunks * num_seqs + num_seqs
    ctas = slots * num_v_heads / hpc
    return (ctas / (PREPARE_CTAS_PER_SM * num_sms), ctas * hpc / (PREPARE_CTAS_PER_SM * num_sms), 1.0,
            slots * num_qk_heads / num_sms if l2norm else 0.0)


def _prepare_us(chunks: int, num_seqs: int, num_v_heads: int, num_qk_heads: int, hpc: int, num_sms: int,
                l2norm: bool) -> float:
    features = prepare_features(chunks, num_seqs, num_v_heads, num_qk_heads, hpc, num_sms, l2norm)
    return sum(a * x for a, x in zip(PREPARE_FIT_US + (L2NORM_PREPARE_US,), features))


def cp_prepare_us(tokens: int, num_seqs: int, num_v_heads: int, num_qk_heads: int, num_sms: int,
                  l2norm: bool = False) -> float:
    """gdn_prepare's time under intra-card CP (the part of its plans outside CP_FIT_US), at the heads per CTA it
    plans for the chunk slots."""
    chunks = max(1, math.ceil(tokens / 64 / max(1, num_seqs)))
    hpc = plan_heads_per_cta(chunks * num_seqs + num_seqs, num_v_heads, num_qk_heads, num_sms)
    return _prepare_us(chunks, num_seqs, num_v_heads, num_qk_heads, hpc, num_sms, l2norm)


def length_groups(tokens: int, num_seqs: int, longest: Optional[int] = None) -> tuple:
    """The batch's sequences as the host sees them, ((chunks of a sequence, sequences of that length), ...): equal
    lengths, or with a known longest sequence it and the rest at their mean (rounded up to whole chunks)."""
    chunks = max(1, math.ceil(tokens / 64 / max(1, num_seqs)))
    if not longest or num_seqs < 2:
        return ((max(chunks, math.ceil(longest / 64)) if longest else chunks, num_seqs),)
    longest_chunks = max(chunks, math.ceil(longest / 64))
    rest = max(0.0, (tokens / 64 - longest_chunks) / (num_seqs - 1))
    return (longest_chunks, 1), (math.ceil(rest), num_seqs - 1)


def segment_lengths(groups: tuple, L: int) -> Dict[int, int]:
    """The segments of L chunks that length_groups' sequences cut into: segment chunks -> segments (each sequence's
    full segments and its shorter last one)."""
    lengths: Dict[int, int] = {}
    for seq_chunks, seqs in groups:
        if seqs <= 0:
            continue
        full, part = divmod(seq_chunks, L)
        lengths[L] = lengths.get(L, 0) + full * seqs
        if part:
            lengths[part] = lengths.get(part, 0) + seqs
    return lengths


def fused_out_us(tokens: int, num_seqs: int, num_v_heads: int, head_dim_v: int, num_sms: int, bv: int, l2norm: bool,
                 lengths: Dict[int, int]) -> float:
    """gdn_fwd_fused's time at V block bv over sequences of the given lengths (chunks -> sequences): rounds of one
    item an SM (the longest first, the shorter filling in behind), or the streaming model past its CTA cap."""
    c, f = _fit(L2NORM_FUSED_FIT_US if l2norm else FUSED_FIT_US, bv)
    blocks = num_v_heads * (head_dim_v // bv)
    items = sum(lengths.values()) * blocks
    if items > FUSED_PERSISTENT_CTAS:
        return max(max(lengths) * c + f, _fused_stream_us(tokens, sum(lengths.values()), items, bv, num_sms, l2norm))
    return chain_makespan({n * c + f: count * blocks for n, count in lengths.items()}, num_sms)


def cp_fused_us(tokens: int, num_seqs: int, num_v_heads: int, num_qk_heads: int, head_dim_k: int, head_dim_v: int,
                num_sms: int, fused_blocks: tuple, L: int, l2norm: bool, longest: Optional[int] = None) -> tuple:
    """(predicted us, the out pass's V block) of intra-card CP on the fused kernel at segments of L chunks."""
    out, bv, features = cp_fused_parts(tokens, num_seqs, num_v_heads, num_qk_heads, head_dim_k, head_dim_v, num_sms,
                                       fused_blocks, L, l2norm, longest)
    return out + sum(a * x for a, x in zip(CP_FUSED_US, features)), bv


def cp_fused_parts(tokens: int, num_seqs: int, num_v_heads: int, num_qk_heads: int, head_dim_k: int, head_dim_v: int,
                   num_sms: int, fused_blocks: tuple, L: int, l2norm: bool, longest: Optional[int] = None) -> tuple:
    """(the out pass's predicted us, its V block, CP_FUSED_US's features) of intra-card CP on the fused kernel at
    segments of L chunks."""
    groups = length_groups(tokens, num_seqs, longest)
    lengths = segment_lengths(groups, L)
    segments = sum(lengths.values())
    out, bv = min((fused_out_us(tokens, segments, num_v_heads, head_dim_v, num_sms, b, l2norm, lengths), b)
                  for b in sorted(fused_blocks, reverse=True))
    later = (segments - num_seqs) * num_v_heads  # (segment, v-head) pairs with a pre-pass
    chunks = later * (CP_FUSED_FALLBACK * L * 2 + (1 - CP_FUSED_FALLBACK) * min(L, WARMUP_CHUNKS))
    k_mb = tokens * num_qk_heads * head_dim_k * 2 / 1e6
    return out, bv, (1.0, L if later else 0, chunks / num_sms, math.ceil(groups[0][0] / L), k_mb,
                     segments * num_v_heads / num_sms, chunks / num_sms if l2norm else 0.0)


def cp_features(tokens: int, num_seqs: int, num_v_heads: int, num_qk_heads: int, head_dim_v: int, num_sms: int,
                chain_blocks: tuple, L: int, longest: Optional[int] = None, head_dim_k: Optional[int] = None,
                l2norm: bool = False) -> tuple:
    """CP_FIT_US's features of intra-card CP at segments of L chunks: (the out chain's makespan in chunks, out-chain
    rounds, pre-pass rounds, the longest sequence's segments, the makespan x q/k heads / v-heads, MB of q and k
    gdn_prepare reads (head_dim_k None is head_dim_v), the makespan on l2norm calls). With a known
    longest sequence, it and the rest's mean give the segments and their lengths (the count an upper bound)."""
    groups = length_groups(tokens, num_seqs, longest)
    by_length = segment_lengths(groups, L)
    segments = sum(by_length.values())
    bv = plan_block_v(segments, num_v_heads, head_dim_v, chain_blocks, num_sms)
    rounds = _rounds(segments * num_v_heads * (head_dim_v // bv), num_sms)
    pre_rounds = _rounds(segments * num_v_heads * 2, num_sms)
    per_segment = num_v_heads * (head_dim_v // bv)  # out-chain CTAs a segment
    span = chain_makespan({n: count * per_segment for n, count in by_length.items()}, num_sms)
    qk_mb = tokens * num_qk_heads * (head_dim_k or head_dim_v) * 4 / 1e6
    return (span, rounds, pre_rounds, math.ceil(groups[0][0] / L), span * num_qk_heads / num_v_heads, qk_mb,
            span if l2norm else 0.0)


def chain_makespan(lengths: Dict[float, int], num_sms: int) -> float:
    """A chain kernel's time, in the lengths' unit, when CTAs of unequal chains (length -> count) go longest first,
    each to the SM that frees first: a shorter chain fills in behind the longer ones. (The fused kernel's order build
    walks host lengths out of order longest first; gdn_fwd_chain takes the batch's order, so a split plan of a batch
    whose longest sequence comes late runs over this.)"""
    levels = {0: num_sms}  # SM finishing time -> SMs
    for length in sorted(lengths, reverse=True):
        left = lengths[length]
        while left:
            t = min(levels)
            take = min(left, levels[t])
            levels[t] -= take
            if not levels[t]:
                del levels[t]
            levels[t + length] = levels.get(t + length, 0) + take
            left -= take
    return max(levels)


@functools.lru_cache(maxsize=4096)
def plan_forward(tokens: int, num_seqs: int, num_v_heads: int, num_qk_heads: int, head_dim_v: int, num_sms: int,
                 fused_blocks: tuple, chain_blocks: tuple, segment_chunks: tuple, l2norm: bool = False,
                 path: Optional[str] = None, block_v: Optional[int] = None, heads_per_cta: Optional[int] = None,
                 allow_cp: bool = True, longest: Optional[int] = None, head_dim_k: Optional[int] = None,
                 cp_paths: tuple = ("cp", "cp_fused")) -> ForwardPlan:
    """The fastest predicted plan of a plain forward among the built variants, from what the host knows: token and
    sequence counts, and ``longest`` (the longest sequence's tokens) when the caller gave the lengths on the host
    (cu_seqlens_cpu); without it lengths are taken equal. A chain kernel then takes the makespan of the longest
    sequence's chains dispatched first (one sequence's v-heads and V blocks can outnumber the SMs) and the other
    sequences' chains, at their mean length, filling in behind them (chain_makespan). path / block_v /
    heads_per_cta narrow the choice (tuning pins); allow_cp False leaves intra-card CP out, cp_paths names the CP
    flavours considered (head_dim_k: None is head_dim_v)."""
    chunks = max(1, math.ceil(tokens / 64 / max(1, num_seqs)))  # the mean sequence's
    longest_chunks = max(chunks, math.ceil(longest / 64)) if longest else chunks

    def chain_us(ctas: int, c: float, f: float) -> float:
        if not longest or num_seqs < 2:
            return _rounds(ctas, num_sms) * (chunks * c + f)
        # the longest sequence's own CTAs (ctas / num_seqs of them) go first, the rest's (at their mean length) fill
        # in behind them
        lengths = {}
        for seq_chunks, seqs in length_groups(tokens, num_seqs, longest):
            lengths[seq_chunks * c + f] = lengths.get(seq_chunks * c + f, 0) + seqs * ctas // num_seqs
        return chain_makespan(lengths, num_sms)
    ratio = num_v_heads // num_qk_heads
    hpcs = [d for d in range(1, PREPARE_MAX_HEADS + 1) if ratio % d == 0 and heads_per_cta in (None, d)]
    plans = []
    if path in (None, "fused"):
        for bv in fused_blocks:
            if block_v in fused_blocks and bv != block_v:  # a pinned block binds the kernels that build it
                continue
            c, f = _fit(L2NORM_FUSED_FIT_US if l2norm else FUSED_FIT_US, bv)
            items = num_seqs * num_v_heads * (head_dim_v // bv)
            if items > FUSED_PERSISTENT_CTAS or longest_chunks == 1:
                t = max(longest_chunks * c + f, _fused_stream_us(tokens, num_seqs, items, bv, num_sms, l2norm))
            else:
                t = chain_us(items, c, f)
            one_round = longest_chunks == 1 and items <= FUSED_ONE_ROUND_ITEMS * num_sms
            plans.append(ForwardPlan("fused", bv, None, None, t, num_sms if one_round else None))
    if path in (None, "split"):
        for bv in chain_blocks:
            if block_v in chain_blocks and bv != block_v:
                continue
            c, f = _fit(CHAIN_FIT_US, bv)
            chain = chain_us(num_seqs * num_v_heads * (head_dim_v // bv), c, f)
            for hpc in hpcs:
                t = _prepare_us(chunks, num_seqs, num_v_heads, num_qk_heads, hpc, num_sms, l2norm) + chain
                if longest_chunks == 1 and l2norm:
                    t += sum(a * x for a, x in zip(L2NORM_SHORT_FILL_US,
                                                   short_fill_features(tokens, num_seqs, num_v_heads, num_sms)))
                plans.append(ForwardPlan("split", bv, hpc, None, t))
    if allow_cp and path in (None, "cp") and "cp" in cp_paths:
        prepare = cp_prepare_us(tokens, num_seqs, num_v_heads, num_qk_heads, num_sms, l2norm)
        for L in segment_chunks:
            if 2 * L > longest_chunks:  # the longest sequence needs two segments at least
                continue
            features = cp_features(tokens, num_seqs, num_v_heads, num_qk_heads, head_dim_v, num_sms, chain_blocks, L,
                                   longest, head_dim_k, l2norm)
            t = prepare + sum(a * b for a, b in zip(CP_FIT_US, features))
            plans.append(ForwardPlan("cp", None, None, L, t))
    # its pre-pass builds are at V block 64
    if allow_cp and path in (None, "cp_fused") and "cp_fused" in cp_paths and 64 in fused_blocks:
        for L in segment_chunks:
            if 2 * L > longest_chunks:
                continue
            t, bv = cp_fused_us(tokens, num_seqs, num_v_heads, num_qk_heads, head_dim_k or head_dim_v, head_dim_v,
                                num_sms, fused_blocks, L, l2norm, longest)
            plans.append(ForwardPlan("cp_fused", bv, None, L, t))
    if not plans:
        raise ValueError(f"no forward plan fits path={path!r}, block_v={block_v!r}, heads_per_cta={heads_per_cta!r} "
                         f"(built fused blocks {fused_blocks}, chain blocks {chain_blocks})")
    return min(plans, key=lambda p: p.predicted_us)
