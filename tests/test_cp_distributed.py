"""Context parallelism across ranks on CPU tensors over gloo: every rank's o, final states and every local gradient
against the fp64 token loop run over the whole batch (sequences crossing rank boundaries, strong decay, g = 0
heads, GVA, initial states, the warm-up shortcuts and the exact transitions)."""

import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flash_qla
from flash_qla import distributed as cpd
from flash_qla import reference
from flash_qla.distributed import CPContext, build_cp_context, chunk_gated_delta_rule_cp


def make_inputs(T, hq, hv, K, V, n_seqs, seed, decay):
    """fp64 inputs; per v-head decay strengths from ``decay`` (0: a g = 0 head), beta in (0, 1), unit keys."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, hq, K, generator=gen, dtype=torch.float64)
    k = torch.randn(1, T, hq, K, generator=gen, dtype=torch.float64)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(1, T, hv, V, generator=gen, dtype=torch.float64)
    a = torch.nn.functional.softplus(0.5 * torch.randn(1, T, hv, generator=gen, dtype=torch.float64) + 1)
    g = -torch.tensor(decay, dtype=torch.float64) * a
    beta = torch.rand(1, T, hv, generator=gen, dtype=torch.float64)
    h0 = torch.randn(n_seqs, hv, K, V, generator=gen, dtype=torch.float64)
    do = torch.randn(1, T, hv, V, generator=gen, dtype=torch.float64)
    return dict(q=q, k=k, v=v, g=g, beta=beta), h0, do


def reference_pieces(x, h0, cu, part, scale, l2norm):
    """The fp64 token loop over each sequence, cut at the rank boundaries with the state carried across, so the
    state at every boundary is an output too. Returns (o [1, T, Hv, V], {(rank, local index): state})."""
    o_parts, states = [], {}
    for s in range(len(cu) - 1):
        S = h0[s][None]
        lo = cu[s]
        while lo < cu[s + 1]:
            r = lo // part
            hi = min(cu[s + 1], (r + 1) * part)
            piece = {name: t[:, lo:hi] for name, t in x.items()}
            o, S = reference.recurrent_gated_delta_rule(**piece, scale=scale, initial_state=S,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
            o_parts.append(o)
            local = sum(1 for t in range(s) if cu[t + 1] > r * part) if s > 0 else 0
            states[(r, local)] = S[0]
            lo = hi
    return torch.cat(o_parts, dim=1), states


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


CASES = [
    # (name, world, part, cu_seqlens, hq, hv, K, V, decay strengths per v-head, warmup_tokens, l2norm, tol)
    ("crossing_default", 2, 160, [0, 50, 230, 320], 2, 4, 16, 8, [0.0, 4.0, 0.08, 16.0], 8192, False, 2e-4),
    ("crossing_exact", 2, 160, [0, 50, 230, 320], 2, 4, 16, 8, [0.0, 4.0, 0.08, 16.0], 0, False, 1e-9),
    ("spanning_four_default", 4, 96, [0, 40, 300, 384], 1, 3, 8, 16, [0.0, 0.5, 16.0], 8192, True, 2e-4),
    ("spanning_four_exact", 4, 96, [0, 40, 300, 384], 1, 3, 8, 16, [0.0, 0.5, 16.0], 0, True, 1e-9),
    # a 120-token window: the 0.3-decay head's gate reaches -10 after ~25 tokens; the g = 0 and 0.02-decay heads'
    # transitions over 120 unit keys in K = 4 are measured, most below the bound (the measured shortcut), some not
    ("one_sequence_probe", 4, 128, [0, 512], 2, 4, 4, 8, [0.0, 0.3, 0.02, 8.0], 120, False, 2e-4),
    # a 16-token window in K = 16: the g = 0 head's entering state outlives it, so the rank runs its main pass again
    # from the exact entering state (the 8.0-decay head's correction alone would have been enough)
    ("window_too_short", 2, 64, [0, 128], 1, 2, 16, 8, [0.0, 8.0], 16, False, 2e-4),
    ("boundaries_between_sequences", 4, 64, [0, 64, 128, 200, 256], 2, 2, 8, 8, [0.0, 2.0], 8192, False, 1e-9),
    # windows shorter than the shards: the chain is cut at every rank (ranks 1 and 2 lie inside sequence 1 and send
    # no transition), rank 3's head window holds sequence 1's last 12 tokens. 16 tokens (SHORT_TOKENS in these tests):
    # every head decays past e^-10 within them, measured, and the cut errs by far less than that (1e-9)
    ("transit_windows_16", 4, 96, [0, 40, 300, 384], 2, 4, 8, 8, [3.0, 16.0, 2.0, 8.0], 16, False, 1e-9),
    # 32 tokens: the heads whose gate sums to <= -10 within the first / last 16 use those (the 0.5-decay head's gate
    # may not, and it runs all 32 with its transition): errors up to the e^-10 bound
    ("transit_windows_32", 4, 96, [0, 40, 300, 384], 2, 4, 8, 8, [3.0, 16.0, 0.5, 8.0], 32, False, 2e-4),
    ("transit_windows_64", 4, 96, [0, 40, 300, 384], 2, 4, 8, 8, [3.0, 16.0, 0.5, 8.0], 64, True, 2e-4),
    # whole 256-token windows (no gate split) run with stops: the decaying heads stop after their first 64-token chunk,
    # the g = 0 head runs all four chunks and its transition over 256 unit keys in K = 4 is measured
    ("stopped_windows", 4, 512, [0, 2048], 2, 4, 4, 8, [0.0, 0.3, 2.0, 8.0], 256, False, 2e-4),
]
# whether a case's windows miss the bound somewhere, so that every rank runs its boundaries exactly (None: windows
# that hold whole ranges, nothing to miss)
FALLS_BACK = {"window_too_short": True, "one_sequence_probe": False, "transit_windows_16": False,
              "transit_windows_32": False, "transit_windows_64": False, "stopped_windows": False}


# the cases whose leaving states go to the next rank point to point (no transition travels): their only
# all-gathers are the forward's one-element miss flags
HANDED_ON = {"crossing_default", "transit_windows_32", "transit_windows_64", "boundaries_between_sequences"}


def _check_case(rank, world, case):
    before = dict(cpd.STATS)
    gathered, handed = [], []
    gather, pass_on = cpd._gather_single, cpd._pass_on

    def counting_gather(out, payload, group=None):
        gathered.append(payload.numel())
        return gather(out, payload, group=group)

    def counting_pass_on(*args, **kwargs):
        handed.append(kwargs.get("reverse", False))
        return pass_on(*args, **kwargs)
    cpd._gather_single, cpd._pass_on = counting_gather, counting_pass_on
    short = cpd.SHORT_TOKENS
    if case[0] == "stopped_windows":    # windows up to SHORT_TOKENS are not split by the gate: whole, with stops
        cpd.SHORT_TOKENS = 1024
    try:
        _run_case(rank, world, case)
    finally:
        cpd._gather_single, cpd._pass_on = gather, pass_on
        cpd.SHORT_TOKENS = short
    if case[0] in HANDED_ON:        # three forwards (the call, the routed and the direct call) and one backward
        assert gathered == [1, 1, 1] and sorted(handed) == [False] * 3 + [True], (case[0], rank, gathered, handed)
    calls = cpd.STATS["calls"] - before.get("calls", 0)
    fallbacks = cpd.STATS["exact_fallback"] - before.get("exact_fallback", 0)
    assert calls == 3, (case[0], rank, calls)                  # the call, the routed call and the direct call
    if FALLS_BACK.get(case[0]) is not None:
        assert fallbacks == (calls if FALLS_BACK[case[0]] else 0), (case[0], rank, fallbacks)
    split = cpd.STATS["split_windows"] - before.get("split_windows", 0)
    longs = cpd.STATS["long_heads"] - before.get("long_heads", 0)
    if case[0] == "stopped_windows" and rank > 0:
        assert cpd.STATS["stopped_windows"] - before.get("stopped_windows", 0) == calls, (case[0], rank)
        x, _, _ = make_inputs(case[2] * world, case[4], case[5], case[6], case[7], 1, seed=len(case[0]), decay=case[8])
        lo = rank * case[2]
        stop, whole = cpd._window_stops(types.SimpleNamespace(l2norm=case[10]), x["k"][:, lo:lo + 256],
                                        x["g"][:, lo:lo + 256], x["beta"][:, lo:lo + 256], 256)
        assert stop.tolist()[1:] == [64, 64, 64] and whole.tolist() == [True, False, False, False], (stop, whole)
    if case[0] == "transit_windows_16":                        # windows no longer than the short one: never split
        assert split == 0, (case[0], rank, split)
    if case[0] == "transit_windows_32" and rank == 2:          # the head window split, the 0.5-decay head kept 32
        assert split == calls and 0 < longs < split * case[5], (case[0], rank, split, longs)


def _run_case(rank, world, case):
    name, _, part, cu, hq, hv, K, V, decay, warmup, l2norm, tol = case
    T = part * world
    x, h0_global, do_global = make_inputs(T, hq, hv, K, V, len(cu) - 1, seed=len(name), decay=decay)
    scale = K ** -0.5
    ctx = build_cp_context(torch.tensor(cu, dtype=torch.int32), warmup_tokens=warmup)
    assert isinstance(ctx, CPContext) and ctx.world_size == world and ctx.rank == rank
    lo, hi = rank * part, (rank + 1) * part
    gen = torch.Generator().manual_seed(99)
    dht_global = {key: torch.randn(hv, K, V, generator=gen, dtype=torch.float64)
                  for key in [(r, i) for r in range(world) for i in range(8)]}

    # this rank's call
    leaves = {n: t[:, lo:hi].clone().requires_grad_(True) for n, t in x.items()}
    h0_local = h0_global[list(ctx.seq_ids)].clone()
    if ctx.pre_num_ranks > 0:
        h0_local[0] = 0
    h0_local.requires_grad_(True)
    o, ht = chunk_gated_delta_rule_cp(**leaves, scale=scale, initial_state=h0_local, output_final_state=True,
                                      use_qk_l2norm_in_kernel=l2norm, cp_context=ctx)
    dht_local = torch.stack([dht_global[(rank, i)] for i in range(ctx.num_seqs)])
    ((o * do_global[:, lo:hi]).sum() + (ht * dht_local).sum()).backward()
    # the public function routes a cp_context to the same code
    o_routed, ht_routed = flash_qla.chunk_gated_delta_rule(
        **{n: t.detach() for n, t in leaves.items()}, scale=scale, initial_state=h0_local.detach(),
        output_final_state=True, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=ctx.cu_seqlens,
        cp_context=ctx)
    assert torch.equal(o_routed, o.detach()) and torch.equal(ht_routed, ht.detach()), (name, rank, "routed call")
    # without offsets of its own and with inputs in the computation's dtypes, it hands the call to the context as is
    o_direct, ht_direct = flash_qla.chunk_gated_delta_rule(
        **{n: t.detach() for n, t in leaves.items()}, scale=scale, initial_state=h0_local.detach(),
        output_final_state=True, use_qk_l2norm_in_kernel=l2norm, cp_context=ctx)
    assert torch.equal(o_direct, o.detach()) and torch.equal(ht_direct, ht.detach()), (name, rank, "direct call")

    # the fp64 loop over the whole batch, every rank's loss summed
    ref_leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    h0_ref = h0_global.clone().requires_grad_(True)
    o_ref, states = reference_pieces(ref_leaves, h0_ref, cu, part, scale, l2norm)
    loss = (o_ref * do_global).sum() + sum((S * dht_global[key]).sum() for key, S in states.items())
    loss.backward()

    assert rel(o.detach(), o_ref.detach()[:, lo:hi]) < tol, (name, rank, "o")
    for i in range(ctx.num_seqs):
        assert rel(ht.detach()[i], states[(rank, i)].detach()) < tol, (name, rank, "final state", i)
    for n in x:
        assert rel(leaves[n].grad, ref_leaves[n].grad[:, lo:hi]) < tol, (name, rank, "d" + n)
    for i, s in enumerate(ctx.seq_ids):
        if i == 0 and ctx.pre_num_ranks > 0:
            # not read: no gradient (None where no row of this rank is read) or a zero one
            assert h0_local.grad is None or h0_local.grad[0].abs().max().item() == 0.0, (name, rank, "dh0 row 0")
        else:
            assert rel(h0_local.grad[i], h0_ref.grad[s]) < tol, (name, rank, "dh0", i)


def _worker(rank, world, init_file, names):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cpd.SHORT_TOKENS = 16  # the test's windows are short: split their heads by the gate too

    try:
        for case in CASES:
            if case[0] in names:
                _check_case(rank, world, case)
        _check_errors(rank, world)
    finally:
        dist.destroy_process_group()


def _check_errors(rank, world):
    cu = torch.tensor([0, 6, 4 * world], dtype=torch.int32)
    ctx = build_cp_context(cu)
    x, _, _ = make_inputs(4 * world, 1, 1, 4, 4, 2, seed=1, decay=[1.0])
    local = {n: t[:, :4] for n, t in x.items()}
    mine = {n: t[:, 4 * rank:4 * rank + 4] for n, t in x.items()}
    zeros = torch.zeros(ctx.num_seqs, 1, 4, 4, dtype=torch.float64)
    chunk_gated_delta_rule_cp(**mine, initial_state=zeros, cp_context=ctx)   # checked once, then remembered:
    chunk_gated_delta_rule_cp(**mine, initial_state=zeros, cp_context=ctx)   # a repeat skips the checks, yet
    assert sum(entry[0] is ctx for entry in cpd._CHECKED.values()) == 1
    with pytest.raises(ValueError, match="shard has 4"):                    # other shapes are still refused
        chunk_gated_delta_rule_cp(**{n: t[:, :3] for n, t in x.items()}, cp_context=ctx)
    with pytest.raises(TypeError, match="CPContext"):
        chunk_gated_delta_rule_cp(**local, cp_context=object())
    with pytest.raises(ValueError, match="divisible"):
        build_cp_context(torch.tensor([0, 4 * world + 1]))
    with pytest.raises(ValueError, match="strictly increasing"):
        build_cp_context(torch.tensor([0, 0, 4 * world]))
    if rank == 1:  # rank 1's row 0 continues sequence 0 (tokens 0-5): a non-zero row there is refused
        bad = torch.ones(ctx.num_seqs, 1, 4, 4, dtype=torch.float64)   # the remembered signature: checked each call
        with pytest.raises(ValueError, match="must be zero"):
            chunk_gated_delta_rule_cp(**{n: t[:, 4:8] for n, t in x.items()}, initial_state=bad, cp_context=ctx)


def _spawn(world, names, tmp_path):
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), names), nprocs=world, join=True)


def test_context_metadata_without_a_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        build_cp_context(torch.tensor([0, 8]))


def test_two_ranks_against_fp64_loop(tmp_path):
    _spawn(2, {"crossing_default", "crossing_exact", "window_too_short"}, tmp_path)


def test_four_ranks_against_fp64_loop(tmp_path):
    _spawn(4, {"spanning_four_default", "spanning_four_exact", "one_sequence_probe",
               "boundaries_between_sequences", "transit_windows_16", "transit_windows_32", "transit_windows_64",
               "stopped_windows"}, tmp_path)


def test_stopped_piece_from_the_kernel_branch(monkeypatch):
    """_head_piece's kernel branch (the window build, stood in for by the reference branch's result) makes the same
    piece as the reference branch: the same o, transition and whole heads, and no correction yet."""
    x, _, _ = make_inputs(256, 2, 4, 16, 16, 1, 7, [0.0, 4.0, 0.01, 16.0])
    x = tuple(x[n].float() for n in ("q", "k", "v", "g", "beta"))
    call = cpd._Call(16 ** -0.5, False, "reference", torch.float32, 2)
    ref = cpd._head_piece(call, x, None, 256, 0, stops=True)

    def window_build(call, q, k, zeros, g, beta, w):
        return (ref.out[0].clone(), ref.out[1].clone()), ref.whole.clone()

    monkeypatch.setattr(cpd, "_stopped_window", window_build)
    monkeypatch.setattr(cpd, "_window_build", lambda call, q: True)
    piece = cpd._head_piece(call, x, None, 256, 0, stops=True)
    assert piece.corr is None and torch.equal(piece.whole, ref.whole)
    assert torch.equal(piece.out[0], ref.out[0]) and torch.equal(piece.out[1], ref.out[1])
    assert ref.whole.tolist() == [True, False, True, False]


def test_window_stops_reference():
    """distributed._window_stops (the window build's stops, reference form): the fewest leading chunks whose gate
    reaches the bound where every chunk is non-expansive, else the whole window; whole = ran all w tokens, as the
    kernel flags it (a head reaching the bound only in its last chunk included)."""
    w, H, K = 256, 5, 8
    g = torch.zeros(1, w, H)
    g[0, :, 1] = -6.0 / 64                       # -6 a chunk: the bound (-10) in chunk 2
    g[0, :, 2] = -10.0 / w * 1.001               # the bound reached in the last chunk only
    g[0, :, 3] = -1.0                            # the bound in chunk 1, but a key voids it (below)
    g[0, :, 4] = -0.01                           # never reaches it: -2.56 over the window
    beta = torch.full((1, w, H), 0.5)
    k = torch.nn.functional.normalize(torch.randn(1, w, 1, K), dim=-1)
    k[0, 200, 0] *= 2.5                          # beta |k|^2 = 3.1 > 2 at token 200 (every head shares the key)
    call = cpd._Call(K ** -0.5, False, "reference", torch.float32, H)
    stop, whole = cpd._window_stops(call, k, g, beta, w)
    assert stop.tolist() == [w] * 5 and whole.all()             # token 200's key voids every head's bound
    k[0, 200, 0] /= 2.5
    stop, whole = cpd._window_stops(call, k, g, beta, w)
    assert stop.tolist() == [w, 128, w, 64, w], stop
    assert whole.tolist() == [True, False, True, False, True]
    l2 = cpd._Call(K ** -0.5, True, "reference", torch.float32, H)  # with l2norm |k| = 1 whatever k holds
    k[0, 200, 0] *= 2.5
    assert torch.equal(cpd._window_stops(l2, k, g, beta, w)[0], stop)
