"""Context parallelism across ranks (torch.distributed): one packed batch sharded over a process group.

Conventions (FLA 0.6's ``fla.ops.cp``): the packed global batch (B == 1, ``cu_seqlens_global``) is split into
``world_size`` equal contiguous token ranges, rank r holding tokens [r * P, (r + 1) * P) with P = T / world_size; a
sequence may span any number of ranks. ``build_cp_context`` turns the global offsets into this rank's local ones;
``chunk_gated_delta_rule_cp`` takes this rank's shard of q, k, v, g, beta and returns its shard of o. Every rank of
the group must make the same calls (forward and backward): they exchange boundary states through collectives.

States, per local sequence (``ctx.cu_seqlens`` order, ``ctx.seq_ids`` names their global indices):
* ``initial_state`` [N_local, Hv, K, V]: row i is the initial state of local sequence i when that sequence starts on
  this rank. A sequence continued from an earlier rank (row 0 when ``ctx.pre_num_ranks > 0``) enters with the
  earlier rank's state; its row must be zero (anything else is an error) and gets a zero gradient.
* final state [N_local, Hv, K, V] float32: row i is the state after this rank's last token of local sequence i.
  For a sequence that ends on this rank it is the sequence's final state; for one that goes on to a later rank it is
  the state handed over at the boundary, and the sequence's final state is returned by the rank where it ends.
  Both are differentiable.

Algorithm. The state leaving a rank is affine in the state entering it: h_out = M h_in + Z, with Z the rank's own
contribution (zero entering state) and M the product of the per-token transitions
exp(g_t) (I - beta_t k_t k_t^T) (K x K). Forward, on a rank whose last sequence goes on to the next rank:
  1. warm-up (gate-driven, as the intra-card CP of :mod:`flash_qla.cp`): per v-head, the fewest trailing tokens whose
     summed g is <= WARMUP_LOG_DECAY (-10). Over them the transition has norm <= exp(sum g) as long as every factor is
     non-expansive (0 <= beta |k|^2 <= 2), so the state obtained by running just those tokens from zero differs from
     the true outgoing state by at most e^-10 ~ 4.5e-5 of the state entering the warm-up: Z_tail, M = 0.
  2. heads whose gate does not decay that far within ``warmup_tokens`` (g = 0 heads) run the window of
     ``warmup_tokens`` tokens with the transition computed too (one call: v widened by K zero columns, the initial
     state by the identity, so the extra columns of the final state are the window's transition); where its
     Frobenius norm (a bound of the spectral norm) is <= e^-10 the same truncation bound holds, measured rather than
     derived from the gate.
  3. the rest are exact: Z over the rank's part of the sequence (from the user's initial state where the sequence
     starts on this rank, M = 0) or, for a rank lying inside one sequence that continues both ways, Z from zero and
     the exact transition M over the whole shard.
Then one all-gather of (Z, M) and each rank folds its chain: h_in[r] = Z[j] then h = Z[s] + M[s] h for the ranks s
between the sequence's start rank j and r. The main pass (the public ``flash_qla.chunk_gated_delta_rule``: the
sm_90a kernels on CUDA, the reference on CPU) does not wait for h_in: it starts at once with zero entering state for
the continued sequence, and everything above runs beside it (on CUDA a high-priority side stream; its host reads wait
for that stream alone). The recurrence is linear in (entering state, v), so h_in's part is added afterwards: the
first ``warmup_tokens`` tokens of that sequence (all of them when it is shorter, or with warmup_tokens = 0) run from
h_in with v = 0, their o is added to the main pass's in place, and their leaving state to the final state where they
cover the whole sequence. Where they do not and that state is still above e^-10 of h_in (a head whose gate and keys
have not forgotten it yet), the main pass runs again from h_in: exact, and the only case that waits for the exchange.
Backward, the reverse direction: the gradient of the state leaving rank r is the gradient of the state entering
rank r + 1, dh_in = M^T dh_out + D, with D the gradient that rank's tokens alone give (zero dht). Each rank whose
first sequence is continued computes D over its first tokens (the reverse warm-up: the fewest leading tokens whose
summed g is <= -10, or the measured transition of the window, or exactly) by autograd through the public function on
that slice, one all-gather of (D, M) and each rank folds from the end of its last sequence back, adding the result
to the final-state gradient of its last sequence before its local backward runs (by autograd through the public
function, which never recomputes the forward). The shortcuts make the result exact up to the e^-10 truncation,
the bound the intra-card CP already meets; ``warmup_tokens=0`` makes every boundary exact.

On CPU tensors the same code runs the reference with the gloo backend, which is how CI tests it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

WARMUP_LOG_DECAY = -10.0          # the truncation bound of flash_qla.cp: e^-10 ~ 4.5e-5, below bf16 resolution
TRANSITION_NORM_BOUND = math.exp(WARMUP_LOG_DECAY)
WARMUP_TOKENS = 8192              # longest warm-up window before a boundary falls back to the exact transition
PIECE_TOKENS = 1024               # ranges run with their transition are cut into independent pieces this long


@dataclass(frozen=True)
class CPContext:
    """Which tokens and sequences this rank holds and how its sequences link to the neighbouring ranks.

    ``cu_seqlens`` (int32, on the global offsets' device) and ``cu_seqlens_cpu`` (int64) are the local offsets;
    ``seq_ids`` the global indices of the local sequences; ``pre_num_ranks`` how many earlier ranks hold part of
    local sequence 0 (0: it starts here); ``post_num_ranks`` how many later ranks hold part of the last local sequence
    (0: it ends here). ``pre_all`` / ``post_all`` / ``nseq_all`` hold the same for every rank of the group, so each
    rank knows the whole chain without communicating."""
    group: Optional[object]
    rank: int
    world_size: int
    part_len: int
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    seq_ids: Tuple[int, ...]
    pre_num_ranks: int
    post_num_ranks: int
    pre_all: Tuple[int, ...]
    post_all: Tuple[int, ...]
    nseq_all: Tuple[int, ...]
    warmup_tokens: int = WARMUP_TOKENS

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    def run_chunk_gated_delta_rule(self, q, k, v, g, beta, scale, initial_state, output_final_state,
                                   use_qk_l2norm_in_kernel, backend):
        """The public API's route for ``cp_context=self`` (flash_qla.api calls it, so the API needs no import of
        this module): :func:`chunk_gated_delta_rule_cp` on this context."""
        return chunk_gated_delta_rule_cp(q, k, v, g, beta, scale, initial_state, output_final_state,
                                         use_qk_l2norm_in_kernel, self, backend)

    @property
    def is_first_rank(self) -> bool:
        """Local sequence 0 starts on this rank (FLA's name)."""
        return self.pre_num_ranks == 0

    @property
    def is_last_rank(self) -> bool:
        """The last local sequence ends on this rank (FLA's name)."""
        return self.post_num_ranks == 0

    @property
    def has_links(self) -> bool:
        """Whether any sequence of the group crosses a rank boundary (otherwise no rank communicates)."""
        return any(p > 0 for p in self.post_all)

    def transit(self, r: int) -> bool:
        """Rank r lies inside one sequence that goes on in both directions."""
        return self.pre_all[r] > 0 and self.post_all[r] > 0 and self.nseq_all[r] == 1


def _rank_meta(cu: List[int], start: int, end: int, rank: int, part_len: int):
    first = next(i for i in range(len(cu) - 1) if cu[i + 1] > start)
    last = next(i for i in range(len(cu) - 2, -1, -1) if cu[i] < end)
    local = [0] + [min(max(cu[i + 1], start), end) - start for i in range(first, last + 1)]
    pre = rank - cu[first] // part_len
    post = (cu[last + 1] - 1) // part_len - rank
    return local, tuple(range(first, last + 1)), pre, post


def build_cp_context(cu_seqlens_global: torch.Tensor, group=None, warmup_tokens: int = WARMUP_TOKENS,
                     cu_seqlens_cpu: Optional[torch.Tensor] = None) -> CPContext:
    """This rank's share of a packed batch split into equal contiguous token ranges over ``group``.

    cu_seqlens_global: [N + 1] int32/int64 offsets of the whole packed batch (any device); every sequence must hold
    at least one token and the total must be a multiple of the group's size. group: a torch.distributed process
    group (None: the default group). warmup_tokens: the longest warm-up window tried before a boundary uses the exact
    transition (0: always exact). cu_seqlens_cpu: the same offsets on the host, to skip a device-to-host copy."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_cp_context needs torch.distributed initialised (dist.init_process_group)")
    if not isinstance(cu_seqlens_global, torch.Tensor) or cu_seqlens_global.dtype not in (torch.int32, torch.int64):
        raise TypeError("cu_seqlens_global must be an int32/int64 torch.Tensor of the global offsets")
    if cu_seqlens_global.dim() != 1 or cu_seqlens_global.numel() < 2:
        raise ValueError(f"cu_seqlens_global must be 1-D with N+1 >= 2 entries, got shape "
                         f"{tuple(cu_seqlens_global.shape)}")
    if isinstance(warmup_tokens, bool) or not isinstance(warmup_tokens, int) or warmup_tokens < 0:
        raise ValueError(f"warmup_tokens must be a non-negative int, got {warmup_tokens!r}")
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens_global).cpu().long().tolist()
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens_global must start at 0, got {cu[0]}")
    empty = next((i for i in range(len(cu) - 1) if cu[i + 1] <= cu[i]), None)
    if empty is not None:
        raise ValueError(f"cu_seqlens_global must be strictly increasing (every sequence at least one token): "
                         f"sequence {empty} spans [{cu[empty]}, {cu[empty + 1]})")
    total = cu[-1]
    if total % world_size != 0:
        raise ValueError(f"the total token count {total} must be divisible by the group's size {world_size}")
    part = total // world_size
    metas = [_rank_meta(cu, r * part, (r + 1) * part, r, part) for r in range(world_size)]
    local, seq_ids, pre, post = metas[rank]
    local_cpu = torch.tensor(local, dtype=torch.int64)
    return CPContext(group=group, rank=rank, world_size=world_size, part_len=part,
                     cu_seqlens=local_cpu.to(device=cu_seqlens_global.device, dtype=torch.int32),
                     cu_seqlens_cpu=local_cpu, seq_ids=seq_ids, pre_num_ranks=pre, post_num_ranks=post,
                     pre_all=tuple(m[2] for m in metas), post_all=tuple(m[3] for m in metas),
                     nseq_all=tuple(len(m[1]) for m in metas), warmup_tokens=warmup_tokens)


# ----------------------------------------------------------------------------------------------------------------
# local passes through the public single-device function

@dataclass
class _Call:
    """The arguments every local pass shares."""
    scale: float
    l2norm: bool
    backend: str
    group_size: int       # v-heads per q/k head
    state_dtype: torch.dtype

    def run(self, q, k, v, g, beta, h0=None, final=True, cu=None):
        from .api import chunk_gated_delta_rule  # lazy: flash_qla's package init may import this module
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=self.scale, initial_state=h0, output_final_state=final,
                                      cu_seqlens=cu, use_qk_l2norm_in_kernel=self.l2norm, backend=self.backend)


def _heads(call: _Call, idx: Optional[torch.Tensor], q, k, v, g, beta):
    """The v-heads ``idx`` as a problem of their own (q / k heads repeated per v-head); None: all heads."""
    if idx is None:
        return q, k, v, g, beta
    qk_idx = torch.div(idx, call.group_size, rounding_mode="floor")
    return (q.index_select(2, qk_idx), k.index_select(2, qk_idx), v.index_select(2, idx), g.index_select(2, idx),
            beta.index_select(2, idx))


def _widened(call: _Call, v, h0, want_transition: bool):
    """v and h0 widened by K zero columns / the identity: the extra columns of the final state are the window's
    transition M (S_w = M S_0 for v = 0), computed in the same pass as the contribution."""
    if not want_transition:
        return v, h0
    H, K = v.shape[2], h0.shape[2]
    eye = torch.eye(K, dtype=h0.dtype, device=h0.device).expand(h0.shape[0], H, K, K)
    return torch.cat([v, v.new_zeros(*v.shape[:3], K)], dim=3), torch.cat([h0, eye], dim=3)


def _can_widen(call: _Call, v, K: int) -> bool:
    """The kernels are built for V in {64, 128, 256}; the reference takes any width."""
    return call.backend == "reference" or v.device.type != "cuda" or v.shape[3] + K in (64, 128, 256)


def _pieces(n: int, device):
    """Offsets cutting n tokens into PIECE_TOKENS-long pieces: a range whose entering state is zero (or the identity)
    runs as that many independent sequences, each with its own transition, folded afterwards: the serial chain
    is one piece long instead of the whole range."""
    cuts = list(range(0, n, PIECE_TOKENS)) + [n]
    return torch.tensor(cuts, dtype=torch.int32, device=device), len(cuts) - 1


def _transition(call: _Call, x, cu, rows: int):
    """The exact transitions [rows, H, K, K] of each piece: its final state for v = 0 from the identity."""
    q, k, v, g, beta = x
    K = q.shape[3]
    h0 = torch.eye(K, dtype=call.state_dtype, device=v.device).expand(rows, v.shape[2], K, K).contiguous()
    _, ht = call.run(q, k, v.new_zeros(*v.shape[:3], K), g, beta, h0, cu=cu)
    return ht.to(call.state_dtype)


def _contribution(call: _Call, x, h0, want_transition: bool):
    """Forward over one token range of one sequence: (Z [H, K, V], M [H, K, K] or None). With the transition the
    entering state must be zero: the range then runs in pieces, Z and M folded from the pieces'."""
    q, k, v, g, beta = x
    V = v.shape[3]
    if not want_transition:
        _, ht = call.run(q, k, v, g, beta, h0)
        return ht[0].to(call.state_dtype), None
    cu, rows = _pieces(v.shape[1], v.device)
    h0 = h0.expand(rows, *h0.shape[1:])
    if _can_widen(call, v, q.shape[3]):
        v2, h2 = _widened(call, v, h0, True)
        _, ht = call.run(q, k, v2, g, beta, h2.contiguous(), cu=cu)
        ht = ht.to(call.state_dtype)
        zs, ms = ht[..., :V], ht[..., V:]
    else:
        _, zs = call.run(q, k, v, g, beta, h0.contiguous(), cu=cu)
        zs, ms = zs.to(call.state_dtype), _transition(call, x, cu, rows)
    Z, M = zs[0], ms[0]
    for i in range(1, rows):
        Z, M = zs[i] + ms[i] @ Z, ms[i] @ M
    return Z, M


def _state_gradient(call: _Call, x, do, dht, want_transition: bool):
    """Backward over one token range of one sequence: (D = d loss / d entering state [H, K, V], M or None), where the
    loss is <o, do> (+ <final state, dht> when dht is given), by autograd through the public function. With the
    transition (and no dht) the range runs in pieces: D = D_1 + M_1^T (D_2 + M_2^T (...))."""
    q, k, v, g, beta = (t.detach() for t in x)
    H, K, V = v.shape[2], q.shape[3], v.shape[3]
    cu, rows = _pieces(v.shape[1], v.device) if want_transition else (None, 1)
    widen = want_transition and _can_widen(call, v, K)
    h0 = v.new_zeros(rows, H, K, V, dtype=call.state_dtype)
    v2, h2 = _widened(call, v, h0, widen)
    h2 = h2.contiguous().requires_grad_(True)
    with torch.enable_grad():
        o, ht = call.run(q, k, v2, g, beta, h2, cu=cu)
        outs, grads = [o[..., :V]], [do]
        if dht is not None:
            outs.append(ht[-1, ..., :V])
            grads.append(dht.to(ht.dtype))
        (dh0,) = torch.autograd.grad(outs, [h2], grads)
    ds = dh0[..., :V].to(call.state_dtype)
    if not want_transition:
        return ds[0], None
    if widen:
        ms = ht.detach()[..., V:].to(call.state_dtype)
    else:
        with torch.no_grad():
            ms = _transition(call, (q, k, v, g, beta), cu, rows)
    D, M = ds[-1], ms[-1]
    for i in range(rows - 2, -1, -1):
        D, M = ds[i] + ms[i].transpose(-1, -2) @ D, M @ ms[i]
    return D, M


def _gate_windows(g, beta, k, call: _Call, reverse: bool, limit: int):
    """Per v-head, the fewest tokens (from the range's end, or its start with reverse) whose summed g is
    <= WARMUP_LOG_DECAY with every factor non-expansive over the ``limit`` tokens considered, else 0.

    The running sums are taken along the innermost dimension ([Hv, w]): a scan along the token dimension of the
    [w, Hv] layout runs Hv threads serially over w tokens (milliseconds in float64 at w = 8192). The
    non-expansiveness test is a min / max, so k and beta are read in place, never flipped."""
    if limit == 0:
        return [0] * g.shape[2]
    gw = (g[0, :limit] if reverse else g[0, -limit:]).double().t().contiguous()     # [Hv, w]
    if not reverse:
        gw = gw.flip(-1)                                                            # nearest the boundary first
    hit = gw.cumsum(-1) <= WARMUP_LOG_DECAY
    first = torch.where(hit.any(-1), hit.int().argmax(-1) + 1, torch.zeros_like(hit[:, 0], dtype=torch.long))
    kw = k[0, :limit] if reverse else k[0, -limit:]
    bw = beta[0, :limit] if reverse else beta[0, -limit:]
    kk = torch.ones_like(bw, dtype=torch.float32) if call.l2norm else \
        (kw.float() ** 2).sum(-1).repeat_interleave(call.group_size, dim=1)
    bkk = bw.float() * kk
    ok = (bkk.amin(0) >= 0) & (bkk.amax(0) <= 2.0)
    return torch.where(ok, first, torch.zeros_like(first)).tolist()


def _boundary(call: _Call, x, n: int, exact_own: Optional[dict], warmup: int, reverse: bool,
              extra=None):
    """The contribution of one boundary (forward: the state leaving the range; reverse: the gradient of the state
    entering it) as (C [Hv, K, V], M [Hv, K, K] or None).

    x: the rank's (q, k, v, g, beta) sliced to the sequence's range of n tokens on this rank, boundary side last
    (forward) or first (reverse). exact_own: where the sequence starts (forward) / ends (reverse) on this rank,
    {"h0": [1, Hv, K, V]} or {"dht": [Hv, K, V]} (the range alone is then exact); None: the range is a whole shard
    inside one sequence, and exactness needs the transition M. extra: reverse only, (do sliced to the range, dht row
    of the range's far end or None)."""
    q, k, v, g, beta = x
    Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
    dev = v.device
    window = min(n, warmup)

    def span(lo, hi):
        return tuple(t[:, lo:hi] for t in x)

    def head_span(idx, lo, hi):
        return _heads(call, idx, *span(lo, hi))

    def forward_part(idx, lo, hi, own, transition):
        xs = head_span(idx, lo, hi)
        H = xs[2].shape[2]
        if own and exact_own is not None:
            h0 = exact_own["h0"] if idx is None else exact_own["h0"].index_select(1, idx)
        else:
            h0 = v.new_zeros(1, H, K, V, dtype=call.state_dtype)
        return _contribution(call, xs, h0, transition)

    def reverse_part(idx, lo, hi, own, transition):
        xs = head_span(idx, lo, hi)
        do = extra[0][:, lo:hi]
        do = do if idx is None else do.index_select(2, idx)
        dht = None
        if own and exact_own is not None:
            dht = exact_own["dht"] if idx is None else exact_own["dht"].index_select(0, idx)
        return _state_gradient(call, xs, do, dht, transition)

    part = reverse_part if reverse else forward_part

    def rng(w):  # the w tokens nearest the boundary
        return (0, w) if reverse else (n - w, n)

    C = torch.zeros(Hv, K, V, dtype=call.state_dtype, device=dev)
    M = None
    if window == n and exact_own is not None:          # the range is short: run it exactly, no transition
        C, _ = part(None, 0, n, True, False)
        return C, None
    gate = _gate_windows(g, beta, k, call, reverse, window)
    gated = [h for h in range(Hv) if gate[h] > 0]
    rest = [h for h in range(Hv) if gate[h] == 0]
    if gated:
        w = max(gate[h] for h in gated)
        # heads that need the probe window anyway run it below, so gated heads alone use their (short) window
        idx = None if not rest else torch.tensor(gated, device=dev)
        c, _ = part(idx, *rng(w), False, False)
        C[gated] = c
    if not rest:
        return C, None
    exact = rest
    if window > 0:
        idx = None if not gated else torch.tensor(rest, device=dev)
        c, m = part(idx, *rng(window), window == n, True)
        if window == n:                                  # the probe covered the whole shard: exact with M
            C[rest] = c if extra is None or extra[1] is None else c + m.transpose(-1, -2) @ extra[1][rest].to(c)
            M = torch.zeros(Hv, K, K, dtype=call.state_dtype, device=dev)
            M[rest] = m
            return C, M
        norms = torch.linalg.matrix_norm(m.double()).tolist()
        ok = [i for i, s in enumerate(norms) if s <= TRANSITION_NORM_BOUND]
        if ok:
            C[[rest[i] for i in ok]] = c[ok]
        exact = [rest[i] for i in range(len(rest)) if norms[i] > TRANSITION_NORM_BOUND]
    if not exact:
        return C, None
    idx = None if len(exact) == Hv else torch.tensor(exact, device=dev)
    if exact_own is not None:                            # the sequence starts / ends here: own range is exact
        c, _ = part(idx, 0, n, True, False)
        C[exact] = c
        return C, None
    c, m = part(idx, 0, n, False, True)                  # a shard inside one sequence: Z (or D) and M
    if reverse and extra[1] is not None:                 # the user's gradient of the boundary state at the far end
        dht = extra[1] if idx is None else extra[1].index_select(0, idx)
        c = c + m.transpose(-1, -2) @ dht.to(c)
    C[exact] = c
    M = torch.zeros(Hv, K, K, dtype=call.state_dtype, device=dev)
    M[exact] = m
    return C, M


# ----------------------------------------------------------------------------------------------------------------
# exchange

def _all_gather(ctx: CPContext, C: torch.Tensor, M: Optional[torch.Tensor]):
    """All ranks' (C, M): one all-gather; M travels only where some rank of the group is a transit rank."""
    carry_m = any(ctx.transit(r) for r in range(ctx.world_size))
    Hv, K, V = C.shape
    if carry_m:
        M = M if M is not None else C.new_zeros(Hv, K, K)
        payload = torch.cat([C.reshape(-1), M.reshape(-1)])
    else:
        payload = C.reshape(-1).contiguous()
    bufs = [torch.empty_like(payload) for _ in range(ctx.world_size)]
    dist.all_gather(bufs, payload, group=ctx.group)
    Cs = [b[:Hv * K * V].view(Hv, K, V) for b in bufs]
    Ms = [b[Hv * K * V:].view(Hv, K, K) for b in bufs] if carry_m else None
    return Cs, Ms


def _entering_state(ctx: CPContext, Cs, Ms) -> torch.Tensor:
    """The state entering this rank's local sequence 0 from the chain of earlier ranks."""
    j = ctx.rank - ctx.pre_num_ranks
    h = Cs[j]
    for s in range(j + 1, ctx.rank):
        h = Cs[s] + Ms[s] @ h
    return h


def _leaving_gradient(ctx: CPContext, Cs, Ms) -> torch.Tensor:
    """The gradient of the state leaving this rank's last local sequence, from the chain of later ranks."""
    j = ctx.rank + ctx.post_num_ranks
    d = Cs[j]
    for s in range(j - 1, ctx.rank, -1):
        d = Cs[s] + Ms[s].transpose(-1, -2) @ d
    return d


# ----------------------------------------------------------------------------------------------------------------
# autograd: the reverse exchange runs before the local backward

class _Spec:
    def __init__(self, ctx: CPContext, call: _Call):
        self.ctx, self.call = ctx, call


@torch.profiler.record_function("cp.backward.boundary")
def _reverse_part(ctx: CPContext, call: _Call, x, do, dht):
    """(D, M) of this rank's first sequence, continued from the previous rank (see _boundary)."""
    n = int(ctx.cu_seqlens_cpu[1])
    ends_here = ctx.num_seqs > 1 or ctx.post_num_ranks == 0
    xs = tuple(t.detach()[:, :n] for t in x)
    own = {"dht": dht[0]} if ends_here else None
    far = None if ends_here else dht[0]
    return _boundary(call, xs, n, own, ctx.warmup_tokens, reverse=True, extra=(do[:, :n], far))


class _ReverseExchange(torch.autograd.Function):
    """Identity on (o, final state) in the forward; in the backward it computes this rank's reverse boundary
    contribution, exchanges, and adds the gradient arriving from later ranks to the last sequence's final-state
    gradient, so the local backward (autograd through the public function) sees the whole dht."""

    @staticmethod
    def forward(fctx, o, ht, q, k, v, g, beta, spec):
        fctx.spec = spec
        fctx.save_for_backward(q, k, v, g, beta)
        return o.view_as(o), ht.view_as(ht)

    @staticmethod
    def backward(fctx, do, dht):
        spec = fctx.spec
        ctx, call = spec.ctx, spec.call
        x = fctx.saved_tensors
        v = x[2]
        Hv, K, V = v.shape[2], x[0].shape[3], v.shape[3]
        if do is None:
            do = torch.zeros_like(v)
        if dht is None:
            dht = torch.zeros(ctx.num_seqs, Hv, K, V, dtype=call.state_dtype, device=v.device)
        C = torch.zeros(Hv, K, V, dtype=call.state_dtype, device=v.device)
        M = None
        if ctx.pre_num_ranks > 0:                          # this rank's first sequence is continued: reverse part
            C, M = _reverse_part(ctx, call, x, do, dht)
        with torch.profiler.record_function("cp.backward.exchange"):
            Cs, Ms = _all_gather(ctx, C, M)
        if ctx.post_num_ranks > 0:
            dht = dht.clone()
            dht[-1] = dht[-1] + _leaving_gradient(ctx, Cs, Ms).to(dht.dtype)
        return do, dht, None, None, None, None, None, None



# ----------------------------------------------------------------------------------------------------------------
# the side stream and the correction by the entering state

_ROW0_ERROR = ("initial_state row 0 belongs to global sequence {seq}, continued from rank {prev}: its entering state "
               "comes from there, so the row must be zero")


class _Side:
    """On CUDA, a high-priority stream that runs the boundary, the exchange and the correction beside the main pass
    (it waits only for what the main stream had queued when it was made); elsewhere a no-op. Host reads made inside
    it (the warm-up decisions) wait for this stream alone, not for the main pass."""
    _streams: dict = {}

    def __init__(self, device: torch.device):
        self.stream = None
        if device.type != "cuda":
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.main = torch.cuda.current_stream(index)
        self.stream = _Side._streams.get(index)
        if self.stream is None:
            self.stream = _Side._streams[index] = torch.cuda.Stream(device=index, priority=-1)
        self.stream.wait_stream(self.main)

    def __enter__(self):
        self._ctx = torch.cuda.stream(self.stream) if self.stream is not None else None
        if self._ctx is not None:
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
        return False

    def keep(self, t: Optional[torch.Tensor]) -> None:
        """t (made on the main stream) is read on the side stream: its memory is not reused before that is done."""
        if self.stream is not None and t is not None:
            t.record_stream(self.stream)

    def join(self) -> None:
        if self.stream is not None:
            self.main.wait_stream(self.stream)


@dataclass
class _Fix:
    o: torch.Tensor           # [1, w, Hv, V]: the entering state's part of o over the first w tokens
    state: torch.Tensor       # [Hv, K, V]: the entering state's part of the state after them
    exact: bool               # w covers the whole first local sequence
    small: bool               # else: that state is below e^-10 of the entering state (the warm-up bound)


def _correction(call: _Call, ctx: CPContext, x, h_in: torch.Tensor, o_dtype: torch.dtype) -> _Fix:
    """The entering state's part of o (the recurrence is linear in (entering state, v)): the first local sequence
    run from h_in with v = 0 over its first ``warmup_tokens`` tokens (all of it when shorter, or with
    warmup_tokens = 0), differentiable in q, k, g, beta (h_in is a constant here: its gradient goes to the earlier
    ranks through the reverse exchange)."""
    q, k, g, beta = x
    n0 = int(ctx.cu_seqlens_cpu[1])
    w = n0 if ctx.warmup_tokens == 0 else min(n0, ctx.warmup_tokens)
    Hv, K, V = h_in.shape
    v0 = torch.zeros(1, w, Hv, V, dtype=o_dtype, device=q.device)
    o_c, s_c = call.run(q[:, :w], k[:, :w], v0, g[:, :w], beta[:, :w], h_in[None].detach())
    if w == n0:
        return _Fix(o_c, s_c[0], True, True)
    left = torch.linalg.vector_norm(s_c[0].detach().double(), dim=(-2, -1))
    bound = TRANSITION_NORM_BOUND * torch.linalg.vector_norm(h_in.double(), dim=(-2, -1))
    return _Fix(o_c, s_c[0], False, bool((left <= bound).all()))


class _AddPrefix(torch.autograd.Function):
    """o[:, :w] += p in place (o is the main pass's output, too large to copy): the gradient passes to both."""

    @staticmethod
    def forward(fctx, o, p):
        fctx.w = p.shape[1]
        o[:, :p.shape[1]].add_(p)
        fctx.mark_dirty(o)
        return o

    @staticmethod
    def backward(fctx, do):
        return do, do[:, :fctx.w]


# ----------------------------------------------------------------------------------------------------------------
# public entry point

def _check_context(ctx, q, v, initial_state) -> None:
    if not isinstance(ctx, CPContext):
        raise TypeError(f"cp_context must be a flash_qla CPContext (flash_qla.distributed.build_cp_context), got "
                        f"{type(ctx).__name__}")
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"context parallelism takes packed inputs with B == 1, got q shape {tuple(q.shape)}")
    if q.shape[1] != ctx.part_len:
        raise ValueError(f"q holds {q.shape[1]} tokens but this rank's shard has {ctx.part_len} "
                         f"(T / world_size of the cu_seqlens_global given to build_cp_context)")
    if ctx.world_size > 1 and ctx.has_links:
        backend = dist.get_backend(ctx.group)
        if backend == "nccl" and q.device.type != "cuda":
            raise ValueError("the process group uses NCCL but the inputs are on the CPU: use a gloo group for CPU "
                             "tensors")
        if backend == "gloo" and q.device.type != "cpu":
            raise ValueError(f"the process group uses gloo but the inputs are on {q.device}: use an NCCL group for "
                             f"CUDA tensors")


def chunk_gated_delta_rule_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, scale: Optional[float] = None,
                              initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                              use_qk_l2norm_in_kernel: bool = False, cp_context: Optional[CPContext] = None,
                              backend: str = "auto") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated DeltaNet chunked prefill on this rank's shard of a context-parallel batch (see the module docstring).

    q, k [1, P, Hq, K]; v [1, P, Hv, V]; g, beta [1, P, Hv] (P = ctx.part_len); initial_state [N_local, Hv, K, V]
    or None. Returns (o [1, P, Hv, V], final_state [N_local, Hv, K, V] float32 or None), differentiable in every
    input; every rank of the context's group must make the call (and its backward) together."""
    from .validation import validate_inputs
    ctx = cp_context
    _check_context(ctx, q, v, initial_state)
    problem = validate_inputs(q, k, v, g, beta, scale, initial_state, ctx.cu_seqlens_cpu)
    Hv, K, V = problem.num_v_heads, problem.head_dim_k, problem.head_dim_v
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    call = _Call(problem.scale, use_qk_l2norm_in_kernel, backend, Hv // problem.num_qk_heads, state_dtype)
    linked = ctx.world_size > 1 and ctx.has_links
    if not linked:
        if initial_state is not None and ctx.pre_num_ranks > 0 and bool((initial_state[0] != 0).any()):
            raise ValueError(_ROW0_ERROR.format(seq=ctx.seq_ids[0], prev=ctx.rank - 1))
        return _run_local(call, ctx, q, k, v, g, beta, initial_state, output_final_state)

    # The main pass starts at once, with zero entering state for a sequence continued from an earlier rank; the
    # boundary, the exchange and the correction by the entering state run beside it on a side stream.
    h_own = initial_state
    if initial_state is not None and ctx.pre_num_ranks > 0:   # row 0 enters from the chain: it gets no gradient
        h_own = torch.cat([torch.zeros_like(initial_state[:1]), initial_state[1:]])
    side = _Side(q.device)
    with torch.profiler.record_function("cp.forward.local"):
        o, ht = _run_local(call, ctx, q, k, v, g, beta, h_own, True)
    with side:
        for t in (q, k, v, g, beta, initial_state):
            side.keep(t)
        if initial_state is not None and ctx.pre_num_ranks > 0 and bool((initial_state[0] != 0).any()):
            raise ValueError(_ROW0_ERROR.format(seq=ctx.seq_ids[0], prev=ctx.rank - 1))
        with torch.no_grad(), torch.profiler.record_function("cp.forward.boundary"):
            C = torch.zeros(Hv, K, V, dtype=state_dtype, device=q.device)
            M = None
            if ctx.post_num_ranks > 0:                              # this rank's last sequence goes on: forward part
                a = int(ctx.cu_seqlens_cpu[-2])
                n = ctx.part_len - a
                starts_here = ctx.num_seqs > 1 or ctx.pre_num_ranks == 0
                xs = tuple(t.detach()[:, a:] for t in (q, k, v, g, beta))
                own = None
                if starts_here:
                    h0 = initial_state[-1:].detach() if initial_state is not None else \
                        q.new_zeros(1, Hv, K, V, dtype=state_dtype)
                    own = {"h0": h0.to(state_dtype)}
                C, M = _boundary(call, xs, n, own, ctx.warmup_tokens, reverse=False)
        with torch.no_grad(), torch.profiler.record_function("cp.forward.exchange"):
            Cs, Ms = _all_gather(ctx, C, M)
            h_in = _entering_state(ctx, Cs, Ms) if ctx.pre_num_ranks > 0 else None
        fix = None
        if h_in is not None:
            with torch.profiler.record_function("cp.forward.correction"):
                fix = _correction(call, ctx, (q, k, g, beta), h_in, v.dtype)
    side.join()
    if fix is None:
        pass
    elif fix.exact or fix.small:
        if torch.is_grad_enabled() and (o.requires_grad or fix.o.requires_grad):
            o = _AddPrefix.apply(o, fix.o)
        else:
            o[:, :fix.o.shape[1]].add_(fix.o)
        if fix.exact:                                           # the correction covered the whole first sequence
            ht = torch.cat([ht[:1] + fix.state[None], ht[1:]])
    else:                                                       # the entering state outlives the window: exact pass
        h_init = torch.cat([h_in[None].to(ht.dtype if h_own is None else h_own.dtype),
                            h_own[1:] if h_own is not None else ht.new_zeros(ctx.num_seqs - 1, Hv, K, V)])
        o, ht = _run_local(call, ctx, q, k, v, g, beta, h_init, True)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta, o, ht)):
        o, ht = _ReverseExchange.apply(o, ht, q, k, v, g, beta, _Spec(ctx, call))
    return o, (ht if output_final_state else None)


def _run_local(call: _Call, ctx: CPContext, q, k, v, g, beta, h0, final):
    from .api import chunk_gated_delta_rule
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=call.scale, initial_state=h0, output_final_state=final,
                                  cu_seqlens=ctx.cu_seqlens, use_qk_l2norm_in_kernel=call.l2norm,
                                  backend=call.backend)
