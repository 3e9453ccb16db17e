"""Intra-card CP on the CPU: the planner, the device-side segment and warm-up tables, and the whole CP
algebra (warm-up truncation, exact fallback, serial combine) in float64 against the token recurrence.
The kernels themselves (gdn_bwd_recompute's state/trans builds, gdn_cp_combine) are checked on the GPU."""
import pytest
import torch

from flash_qla import cp
from flash_qla.chunk_grads import CHUNK, slot_map, to_slots
from flash_qla.reference import recurrent_gated_delta_rule
from gdn_inputs import hard_inputs, random_cu_seqlens



@pytest.mark.parametrize("tokens,n,hv,want", [
    # H200, the save chain beside the dh chain: the
    # measured-best L of each shape
    (32768, 1, 32, None),     # hk16_hv32 32k_1seq: 3.14 ms without CP, 3.43 at L = 128 (the in-order fit's pick)
    (65536, 1, 32, None),     # 6.29 ms without CP, 6.73 at L = 256
    (8192, 1, 32, None),      # hk16_hv32 8k_1seq: every L slower
    (32768, 1, 64, None),
    (32768, 1, 16, 64),       # 1.83 ms vs 2.25 without CP
    (65536, 1, 16, 128),
    (16384, 1, 8, 32),
    (32768, 1, 8, 64),        # hk4_hv8 32k_1seq: 0.97 ms vs 1.80 without CP
    (131072, 1, 8, 128),      # 3.57 ms vs 7.04
    (8192, 1, 8, 16),         # hk4_hv8 8k_1seq: 0.32 ms vs 0.47
    (65536, 2, 8, 64),        # two sequences
    (32768, 8, 32, None),     # eight sequences fill the GPU
    # H100 (bench/results/h100/plan_sweep_bwd.jsonl): short sequences at few heads, where the two pre-passes and
    # combines run side by side
    (4096, 1, 4, 8),          # 0.131 ms at L = 8 against 0.206 without CP
    (4096, 1, 8, 8),          # 0.199 at L = 8 (0.185 at 16) against 0.231
    (8192, 2, 4, 8),          # 0.191 at L = 8 (0.186 at 16) against 0.227
])
def test_backward_planner(tokens, n, hv, want):
    """The backward's recompute plans its segments with both chains' costs (flash_qla/forward.py _recompute_segment_chunks)."""
    from flash_qla.planner import STAGED_CHAIN_COST
    L = cp.plan_segment_chunks(tokens, n, hv, 128, 128, 132, (32, 64), chain_costs=STAGED_CHAIN_COST,
                               **cp.BACKWARD_PLAN)
    assert L == want


def test_backward_segments_against_the_committed_sweep():
    """Every equal-length shape of the committed H100 backward sweep (every plan timed, scripts/plan_sweep.py --pass
    bwd): the segment length planned here, at the faster of the chains' V blocks measured with it, is within 3% of the
    measured best on at least 90% of them and never 1.1x."""
    import json
    import math

    from flash_qla.planner import STAGED_CHAIN_COST
    from conftest import repo_text
    ratios = []
    for line in repo_text("bench", "results", "h100", "plan_sweep_bwd.jsonl").splitlines():
        row = json.loads(line)
        if not row["equal_lengths"]:  # the backward plans from token and sequence counts: lengths taken equal
            continue
        L = cp.plan_segment_chunks(row["tokens"], row["seqs"], row["hv"], 128, 128, 132, (32, 64),
                                   chain_costs=STAGED_CHAIN_COST, **cp.BACKWARD_PLAN)
        at_l = [t for name, t in row["candidates"].items() if name.endswith(f"_cp_L{L}" if L else "")
                and (L or "_cp_" not in name)]
        ratios.append((min(at_l) / min(row["candidates"].values()), row["shape"]))
    assert len(ratios) >= 40
    close = sum(r <= 1.03 for r, _ in ratios) / len(ratios)
    mean = math.exp(sum(math.log(r) for r, _ in ratios) / len(ratios))
    assert close >= 0.9 and max(ratios)[0] < 1.1, (close, mean, sorted(ratios)[-4:])


def _tables(lengths, L):
    cu = random_cu_seqlens(lengths)
    chunks = [-(-n // CHUNK) for n in lengths]
    offsets = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    return cu, offsets, cp.segment_tables(cu, offsets, int(cu[-1]), L)


@pytest.mark.parametrize("lengths,L", [([1, 200, 64 * 7 + 5, 0, 65, 300], 2), ([4096], 16), ([0], 4), ([63, 64, 65], 1)])
def test_segment_tables(lengths, L):
    cu, offsets, seg = _tables(lengths, L)
    T = int(cu[-1])
    S = seg.count
    assert S >= sum(-(-(-(-n // CHUNK)) // L) for n in lengths)
    starts, slots = seg.cu.tolist(), seg.slot.tolist()
    assert starts[-1] == T and all(a <= b for a, b in zip(starts, starts[1:]))
    for n, length in enumerate(lengths):
        b0, b1 = int(seg.base[n]), int(seg.base[n + 1])
        assert b1 - b0 == -(-(-(-length // CHUNK)) // L)
        assert int(seg.last[n]) == (b1 - 1 if b1 > b0 else -1)
        for j, s in enumerate(range(b0, b1)):
            assert starts[s] == int(cu[n]) + j * L * CHUNK and slots[s] == int(offsets[n]) + j * L
            assert bool(seg.first[s]) == (j == 0)
            end = starts[s + 1]
            assert end == min(int(cu[n]) + (j + 1) * L * CHUNK, int(cu[n + 1]))
    assert all(starts[s] == T and bool(seg.first[s]) for s in range(int(seg.base[-1]), S))


def _tiles(g, k, beta, cu, offsets, T, ratio):
    """gdn_prepare's chunk-aligned outputs: the chunk-local cumulative g [Hv, slots * 64] (gamma stays at the
    last value past the end) and each chunk's largest beta |k|^2 [Hv, slots] (-1 where no token sits)."""
    N = cu.numel() - 1
    m = slot_map(cu, offsets, T, -(-T // CHUNK) + N)
    Hv = g.shape[1]
    gam = to_slots(g, m).cumsum(-1).permute(1, 0, 2).reshape(Hv, -1)
    bkk = beta * k.square().sum(-1).repeat_interleave(ratio, 1)
    valid = to_slots(torch.ones(T, Hv, dtype=g.dtype), m) > 0
    bkk = torch.where(valid, to_slots(bkk, m), -1.0).permute(1, 0, 2).amax(-1)
    return gam, bkk


def _run(q, k, v, g, beta, h0, lo, hi, h):
    """Token recurrence of v-head h over packed tokens [lo, hi) from h0 [K, V]: (o, final state)."""
    sl = slice(lo, hi)
    hk = h // (v.shape[2] // q.shape[2])
    o, st = recurrent_gated_delta_rule(q[:, sl, hk:hk + 1], k[:, sl, hk:hk + 1], v[:, sl, h:h + 1],
                                       g[:, sl, h:h + 1], beta[:, sl, h:h + 1], scale=1.0,
                                       initial_state=h0[None, None], output_final_state=True)
    return o[0, :, 0], st[0, 0]


@pytest.mark.parametrize("unit_keys", [True, False])
def test_cp_algebra_matches_the_recurrence(unit_keys):
    """CP as the kernels do it, with the token recurrence standing in for each chain, equals the plain
    recurrence to within the warm-up bound (e^-10 of the state), fallback heads exactly."""
    lengths, L, hq, hv, K, V = [1, 200, 64 * 9 + 5, 65, 330], 2, 2, 4, 8, 8
    x = hard_inputs(lengths, hq, hv, K, V, unit_keys=unit_keys)
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    g = g / 40  # weak enough that some heads need several warm-up chunks, head 0 never decays
    cu, offsets, seg = _tables(lengths, L)
    T = int(cu[-1])
    start, fallback = cp.warmup_tables(seg, *_tiles(g[0], k[0], beta[0], cu, offsets, T, hv // hq))
    assert bool(fallback[:, 0][~seg.first].all())             # g = 0: never bounded
    if unit_keys:
        assert not bool(fallback[:, -1].any())                # strongest decay: always a warm-up
    else:
        assert bool(fallback[~seg.first].all())               # |k| != 1 voids the bound everywhere
    o_ref, ht_ref = recurrent_gated_delta_rule(q, k, v, g, beta, scale=1.0, initial_state=h0,
                                               output_final_state=True, cu_seqlens=cu)
    o = torch.zeros_like(o_ref[0])
    eye = torch.eye(K, dtype=torch.float64)
    for n in range(len(lengths)):
        for h in range(hv):
            entering = h0[n, h]  # h_in of the previous segment, as gdn_cp_combine carries it
            for s in range(int(seg.base[n]), int(seg.base[n + 1])):
                lo, hi = int(seg.cu[s]), int(seg.cu[s + 1])
                if not bool(seg.first[s]):
                    a, b = int(start[s, h]), lo
                    _, z = _run(q, k, v, g, beta, torch.zeros(K, V, dtype=torch.float64), a, b, h)
                    if fallback[s, h]:
                        _, m = _run(q, k, torch.zeros_like(v), g, beta, eye, a, b, h)
                        entering = z + m @ entering
                    else:
                        assert float(g[0, a:b, h].sum()) <= cp.WARMUP_LOG_DECAY + 1e-9
                        entering = z
                o[lo:hi, h], state = _run(q, k, v, g, beta, entering, lo, hi, h)
            err = (state - ht_ref[n, h]).norm() / ht_ref[n, h].norm()
            assert err < 1e-4, (n, h, float(err))
    assert float((o - o_ref[0]).norm() / o_ref[0].norm()) < 1e-4


@pytest.mark.parametrize("lengths,L", [([200, 64 * 9], 2), ([64 * 8], 2), ([64], 4), ([65, 64 * 3], 8)])
def test_trailing_row_gives_the_leaving_state(lengths, L):
    """cp.trailing_row (multi-GPU CP's linked forward): the row past the last sequence's last segment gets a warm-up
    as a segment start there would (checked against warmup_tables on the sequence made longer), and its pre-pass and
    combine step give the last sequence's final state, to within the warm-up bound (fallback heads exactly)."""
    hq, hv, K, V = 2, 4, 8, 8
    x = hard_inputs(lengths, hq, hv, K, V)
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    g = g / 40
    cu, offsets, seg = _tables(lengths, L)
    T, N = int(cu[-1]), len(lengths)
    start, fallback = cp.warmup_tables(seg, *_tiles(g[0], k[0], beta[0], cu, offsets, T, hv // hq))
    start, fallback = start.clone(), fallback.clone()
    last = int(seg.last[-1])
    row = cp.trailing_row(seg, N, start, fallback, *_tiles(g[0], k[0], beta[0], cu, offsets, T, hv // hq))
    assert row.tolist() == [last + 1] and int(seg.base[-1]) == last + 2 and int(seg.cu[last + 1]) == T
    if (lengths[-1] // CHUNK) % L == 0:   # a whole last segment: the same row as a segment starting at T would get
        more = hard_inputs(lengths[:-1] + [lengths[-1] + 128], hq, hv, K, V)
        g2 = torch.cat([g, more["g"][:, T:] / 40], 1)
        k2, b2 = (torch.cat([a, more[n][:, T:]], 1) for a, n in ((k, "k"), (beta, "beta")))
        cu2, off2, seg2 = _tables(lengths[:-1] + [lengths[-1] + 128], L)
        s2, f2 = cp.warmup_tables(seg2, *_tiles(g2[0], k2[0], b2[0], cu2, off2, T + 128, hv // hq))
        assert torch.equal(start[last + 1], s2[last + 1]) and torch.equal(fallback[last + 1], f2[last + 1])
    _, ht_ref = recurrent_gated_delta_rule(q, k, v, g, beta, scale=1.0, initial_state=h0, output_final_state=True,
                                           cu_seqlens=cu)
    eye, zero = torch.eye(K, dtype=torch.float64), torch.zeros(K, V, dtype=torch.float64)
    for h in range(hv):
        entering = h0[-1, h]
        for s in range(int(seg.base[N - 1]), last + 2):
            lo = int(seg.cu[s])
            if s > int(seg.base[N - 1]):
                a = int(start[s, h])
                _, z = _run(q, k, v, g, beta, zero, a, lo, h)
                if fallback[s, h]:
                    assert a == int(seg.cu[s - 1])
                    _, m = _run(q, k, torch.zeros_like(v), g, beta, eye, a, lo, h)
                    entering = z + m @ entering
                else:
                    assert float(g[0, a:lo, h].sum()) <= cp.WARMUP_LOG_DECAY + 1e-9
                    entering = z
        err = (entering - ht_ref[-1, h]).norm() / ht_ref[-1, h].norm()
        assert err < 1e-4, (h, float(err))


@pytest.mark.parametrize("unit_keys", [True, False])
def test_reverse_cp_algebra_matches_the_adjoint(unit_keys):
    """The backward's CP as gdn_bwd_dh's state / trans builds and the reverse gdn_cp_combine do it, with autograd
    through the token recurrence standing in for each dh chain: the gradient of the state leaving every segment
    equals the exact adjoint (everything after the boundary, dht included) to within the warm-up bound, fallback
    heads exactly."""
    lengths, L, hq, hv, K, V = [1, 200, 64 * 9 + 5, 65, 330], 2, 2, 4, 8, 8
    x = hard_inputs(lengths, hq, hv, K, V, unit_keys=unit_keys)
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    g = g / 40
    cu, offsets, seg = _tables(lengths, L)
    T = int(cu[-1])
    end, fallback = cp.reverse_warmup_tables(seg, cu, *_tiles(g[0], k[0], beta[0], cu, offsets, T, hv // hq))
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(T, hv, V, generator=gen, dtype=torch.float64)
    dht = torch.randn(len(lengths), hv, K, V, generator=gen, dtype=torch.float64)
    checked = {True: 0, False: 0}
    for n in range(len(lengths)):
        b0, b1 = int(seg.base[n]), int(seg.base[n + 1])
        if b1 > b0:  # the last segment's range is empty
            assert torch.equal(end[b1 - 1].long(), seg.cu[b1].long().expand(hv)) and not bool(fallback[b1 - 1].any())
        for h in range(hv):
            carried = dht[n, h]  # the gradient leaving the sequence's last segment
            for s in reversed(range(b0, b1 - 1)):
                b, e = int(seg.cu[s + 1]), int(end[s, h])
                _, s_b = _run(q, k, v, g, beta, h0[n, h], int(cu[n]), b, h)
                s_b = s_b.detach().requires_grad_(True)
                o, st = _run(q, k, v, g, beta, s_b, b, e, h)
                loss = (o * do[b:e, h]).sum()
                if fallback[s, h]:  # all of the next segment, and its exact transposed transition
                    assert e == int(seg.cu[s + 2])
                    loss = loss + (st * carried).sum()
                else:
                    assert float(g[0, b:e, h].sum()) <= cp.WARMUP_LOG_DECAY + 1e-9
                carried, = torch.autograd.grad(loss, s_b)
                o, st = _run(q, k, v, g, beta, s_b, b, int(cu[n + 1]), h)
                exact, = torch.autograd.grad((o * do[b:int(cu[n + 1]), h]).sum() + (st * dht[n, h]).sum(), s_b)
                err = (carried - exact).norm() / exact.norm()
                assert err < 1e-4, (n, h, s, float(err))
                checked[bool(fallback[s, h])] += 1
    assert checked[True] > 0 and (checked[False] > 0 or not unit_keys)


@pytest.mark.parametrize("lengths", [[64 * 30], [64 * 13, 64 * 17]], ids=["one_sequence", "two_sequences"])
def test_linked_forward_algebra_matches_the_recurrence(lengths):
    """Multi-GPU CP's linked forward (flash_qla/distributed.py) as its kernels do it, with the token recurrence
    standing in for each chain: three ranks of 640 tokens, each with its own tables, the trailing segment where a
    sequence goes on, the combine A (a continued sequence entering with zero state) and B (from the identity with zero
    warm-up states); the trailing rows' (A, B) folded along the ranks (distributed._entering_state, through the B of
    a rank inside one sequence) give each rank's entering state h_e, h_in = A + B h_e, and every segment run from its
    h_in gives the recurrence over the whole batch: o and final states within the warm-up bound."""
    from types import SimpleNamespace
    from flash_qla.distributed import _entering_state
    W, L, hq, hv, K, V = 3, 3, 2, 4, 8, 8
    x = hard_inputs(lengths, hq, hv, K, V)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    g = g / 40
    T = sum(lengths)
    P = T // W
    cu_g = [0] + torch.tensor(lengths).cumsum(0).tolist()
    o_ref, ht_ref = recurrent_gated_delta_rule(q, k, v, g, beta, scale=1.0, output_final_state=True,
                                               cu_seqlens=random_cu_seqlens(lengths))
    eye, zero = torch.eye(K, dtype=torch.float64), torch.zeros(K, V, dtype=torch.float64)
    ranks = []
    for r in range(W):
        lo, hi = r * P, (r + 1) * P
        local = [min(max(b, lo), hi) - lo for b in cu_g if lo < b < hi] + [P]
        local = [b - a for a, b in zip([0] + local, local)]
        pre, post = cu_g.count(lo) == 0, cu_g.count(hi) == 0 and r < W - 1
        cu = random_cu_seqlens(local)
        offsets = torch.tensor([0] + torch.tensor([-(-n // CHUNK) for n in local]).cumsum(0).tolist(),
                               dtype=torch.int32)
        seg = cp.segment_tables(cu, offsets, P, L)
        tiles = _tiles(g[0, lo:hi], k[0, lo:hi], beta[0, lo:hi], cu, offsets, P, hv // hq)
        start, fallback = cp.warmup_tables(seg, *tiles)
        row = int(cp.trailing_row(seg, len(local), start, fallback, *tiles)) if post else None
        A = torch.zeros(seg.count, hv, K, V, dtype=torch.float64)
        B = torch.zeros(seg.count, hv, K, K, dtype=torch.float64)
        for n in range(len(local)):
            for h in range(hv):
                a_prev, b_prev = zero, (eye if n == 0 and pre else torch.zeros(K, K, dtype=torch.float64))
                for s in range(int(seg.base[n]), int(seg.base[n + 1])):
                    if s > int(seg.base[n]):
                        a, b = lo + int(start[s, h]), lo + int(seg.cu[s])
                        _, z = _run(q, k, v, g, beta, zero, a, b, h)
                        if fallback[s, h]:
                            _, m = _run(q, k, torch.zeros_like(v), g, beta, eye, a, b, h)
                            a_prev, b_prev = z + m @ a_prev, m @ b_prev
                        else:
                            a_prev, b_prev = z, torch.zeros(K, K, dtype=torch.float64)
                    A[s, h], B[s, h] = a_prev, b_prev
        ranks.append(SimpleNamespace(lo=lo, local=local, pre=pre, seg=seg, row=row, A=A, B=B,
                                     transit=pre and post and len(local) == 1))
    # the all-gather's rows, then each rank's fold
    Cs = torch.stack([rk.A[rk.row] if rk.row is not None else torch.zeros(hv, K, V, dtype=torch.float64)
                      for rk in ranks])
    Ms = torch.stack([rk.B[rk.row] if rk.transit else torch.zeros(hv, K, K, dtype=torch.float64) for rk in ranks])
    carry = any(rk.transit for rk in ranks)
    assert carry == (len(lengths) == 1)
    o = torch.zeros_like(o_ref[0])
    finals = []
    for r, rk in enumerate(ranks):
        h_in = rk.A.clone()
        if rk.pre:
            pre_num = r - max(c for c in cu_g if c <= rk.lo) // P      # ranks back to where the sequence starts
            h_e = _entering_state(SimpleNamespace(rank=r, pre_num_ranks=pre_num), Cs, Ms if carry else None)
            first = int(rk.seg.base[1])
            h_in[:first] += torch.matmul(rk.B[:first], h_e)
        for n in range(len(rk.local)):
            for h in range(hv):
                for s in range(int(rk.seg.base[n]), int(rk.seg.last[n]) + 1):
                    a, b = rk.lo + int(rk.seg.cu[s]), rk.lo + int(rk.seg.cu[s + 1])
                    o[a:b, h], state = _run(q, k, v, g, beta, h_in[s, h], a, b, h)
                if rk.lo + sum(rk.local[:n + 1]) in cu_g:   # the sequence ends on this rank
                    finals.append((cu_g.index(rk.lo + sum(rk.local[:n + 1])) - 1, h, state))
    assert float((o - o_ref[0]).norm() / o_ref[0].norm()) < 1e-4
    assert len(finals) == len(lengths) * hv
    for n, h, state in finals:
        assert float((state - ht_ref[n, h]).norm() / ht_ref[n, h].norm()) < 1e-4, (n, h)


@pytest.mark.parametrize("hv, n, v, want", [
    (8, 1, 128, 8),     # 16 CTAs a head: 128 fit 132 SMs
    (16, 1, 128, 16),   # 256 at 8 columns would queue; 128 at 16 fit
    (32, 1, 128, 32),
    (64, 1, 128, 32),   # nothing fits: the widest build, the fewest CTAs
    (8, 2, 64, 8),      # V = 64: 8 CTAs a head
    (4, 1, 64, 8),
])
def test_combine_picks_the_fewest_columns_whose_grid_fits_the_sms(hv, n, v, want):
    variant = cp.combine_variant(128, v, hv, n, 132)
    assert variant == {"K": 128, "V": v, "BVC": want}
    assert v // want * hv * n <= 132 or want == max(cp.COMBINE_COLUMNS)


def test_combine_columns_are_built():
    """Every width the host may pick is a built variant of gdn_cp_combine (its axes read without TileLang)."""
    variants = pytest.importorskip("build_matrix.variants")  # the repository's build tooling, not in the wheel
    assert tuple(variants.declared_axes("gdn_cp_combine")["BVC"]) == cp.COMBINE_COLUMNS
