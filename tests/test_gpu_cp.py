"""Intra-card CP forward (flash_qla/cp.py) on the GPU: forced segment lengths against the float64
reference, with the hard cases (g = 0 heads take the exact fallback, strong decay a one-chunk warm-up),
NaN-poisoned outputs, repeat determinism and the planner's own choice on a benchmark-like shape."""
import pytest
import torch

import flash_qla
from flash_qla import cp, launch, reference
from flash_qla import forward as fwd
from flash_qla.tuning import settings
from test_gpu_forward import TOL, draw, fp64_reference

pytestmark = pytest.mark.gpu

LENGTHS = [1, 63, 64, 65, 130, 700, 0, 333]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(settings, "poison_outputs", True)


@pytest.fixture(params=[True, False], ids=["fused", "split"])
def flavour(request, monkeypatch):
    """The forward's CP on gdn_fwd_fused (flash_qla/fused_cp.py) or on gdn_prepare + gdn_fwd_chain."""
    monkeypatch.setattr(settings, "cp_fused", request.param)
    return request.param


def cp_variants():
    return sorted({(v["dtype"], v["K"], v["V"]) for v in flash_qla.loader.library().variants(launch.CHAIN_KERNEL)
                   if v["mode"] == "state"})


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("variant", cp_variants())
def test_cp_forward_matches_fp64_reference(variant, L, monkeypatch, flavour):
    tag, K, V = variant
    monkeypatch.setattr(settings, "force_segment_chunks", L)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[tag]
    for (hq, hv), h0 in (((2, 6), True), ((3, 3), False)):
        x = draw(LENGTHS, hq, hv, K, V, dtype, seed=K + V + hv + L, h0=h0)
        o, ht = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
        assert torch.isfinite(o).all() and torch.isfinite(ht).all(), "unwritten (NaN-poisoned) or non-finite output"
        o_ref, ht_ref = fp64_reference(x)
        assert reference.relative_l2(o, o_ref) <= TOL[dtype], (hq, hv, "o")
        assert reference.relative_l2(ht, ht_ref) <= TOL[dtype], (hq, hv, "final_state")
        if h0:  # the empty sequence keeps its initial state
            assert torch.equal(ht[6], x["initial_state"][6])


@pytest.mark.parametrize("K, V", [(128, 128), (64, 128)])
def test_cp_forward_with_l2norm_matches_fp64_reference(K, V, monkeypatch, flavour):
    """use_qk_l2norm_in_kernel under CP: unnormalised q / k rows (norms 0.5-3), whose norms the pre-pass builds and
    gdn_cp_scan's bound (the normalised row's |k|^2) take from the raw rows."""
    monkeypatch.setattr(settings, "force_segment_chunks", 2)
    x = draw(LENGTHS, 2, 6, K, V, torch.bfloat16, seed=K + V + 17)
    gen = torch.Generator(device="cuda").manual_seed(K + V)
    for name in ("q", "k"):
        scale = 0.5 + 2.5 * torch.rand(*x[name].shape[:3], 1, device="cuda", generator=gen)
        x[name] = (x[name].float() * scale).bfloat16()
    o, ht = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all(), "unwritten (NaN-poisoned) or non-finite output"
    d = {n: (t.double() if t is not None else None) for n, t in x.items() if n != "cu_seqlens"}
    o_ref, ht_ref = reference.chunked_gated_delta_rule(**d, output_final_state=True, cu_seqlens=x["cu_seqlens"].cpu(),
                                                       use_qk_l2norm_in_kernel=True)
    assert reference.relative_l2(o, o_ref) <= TOL[torch.bfloat16], "o"
    assert reference.relative_l2(ht, ht_ref) <= TOL[torch.bfloat16], "final_state"


@pytest.mark.parametrize("K, V", [(128, 128), (64, 64)])
def test_cp_combine_walks_more_segments_than_a_flag_window(K, V, monkeypatch, flavour):
    """One-chunk segments on sequences of 131 and 70 chunks: the combine reads the fallback flags a window of one
    per thread at a time (128 at K = 128, 64 at K = 64 with 8 V columns a CTA), so its walk crosses windows, where
    the next step's transition is not prefetched. The draw's g = 0 heads take the exact fallback at every step."""
    monkeypatch.setattr(settings, "force_segment_chunks", 1)
    x = draw([131 * 64 - 7, 70 * 64], 2, 4, K, V, torch.bfloat16, seed=K + 5)
    assert cp.combine_variant(K, V, 4, 2, launch.num_sms(x["q"].device))["BVC"] == 8
    o, ht = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all(), "unwritten (NaN-poisoned) or non-finite output"
    o_ref, ht_ref = fp64_reference(x)
    assert reference.relative_l2(o, o_ref) <= TOL[torch.bfloat16], "o"
    assert reference.relative_l2(ht, ht_ref) <= TOL[torch.bfloat16], "final_state"


def test_cp_hundred_repeats_are_bit_identical(monkeypatch, flavour):
    monkeypatch.setattr(settings, "force_segment_chunks", 2)
    x = draw(LENGTHS, 2, 6, 128, 128, torch.bfloat16, seed=3)
    o0, ht0 = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    for _ in range(100):
        o, ht = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
        assert torch.equal(o, o0) and torch.equal(ht, ht0)


def test_planned_cp_on_a_benchmark_shape_eager_and_under_graph_capture(monkeypatch):
    """TP8 1x8192 with the benchmark's distribution: CP is planned by device time alone, so an eager call (whose
    plan is replayed with one launcher crossing) and a captured one (side-stream fork / join inside the graph) take
    the same segments, give bit-identical results, meet the tolerance and agree with the plain path."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    T, hq, hv, D = 8192, 2, 8, 128
    q = torch.nn.functional.normalize(torch.randn(1, T, hq, D, device="cuda", generator=gen), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, hq, D, device="cuda", generator=gen), dim=-1).bfloat16()
    v = torch.randn(1, T, hv, D, device="cuda", generator=gen).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, hv, device="cuda", generator=gen)) / 16
    g[..., :2] = 0.0  # a quarter of the heads do not decay
    beta = torch.rand(1, T, hv, device="cuda", generator=gen)
    h0 = torch.randn(1, hv, D, D, device="cuda", generator=gen)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    x = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu)
    problem = flash_qla.validation.validate_inputs(q, k, v, g, beta, None, h0, cu)
    planned = fwd.forward_plan(problem, "bf16", q.device, False, False).segment_chunks
    assert planned is not None
    monkeypatch.setattr(settings, "force_segment_chunks", 0)  # the plain path, for comparison
    o_plain, ht_plain = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    monkeypatch.setattr(settings, "force_segment_chunks", None)
    eager = [flash_qla.chunk_gated_delta_rule(**x, output_final_state=True) for _ in range(3)]  # recorded, replayed
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert fwd.forward_plan(problem, "bf16", q.device, False, False).segment_chunks == planned
        o, ht = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    graph.replay()
    torch.cuda.synchronize()
    for o_e, ht_e in eager:
        assert torch.equal(o_e, o) and torch.equal(ht_e, ht)
    o_ref, ht_ref = fp64_reference(x)
    assert reference.relative_l2(o, o_ref) <= 1e-2 and reference.relative_l2(ht, ht_ref) <= 1e-2
    # CP and the plain path agree far inside the tolerance (bf16 rounding of different chains)
    assert reference.relative_l2(o, o_plain.double()) <= 5e-3 and reference.relative_l2(ht, ht_plain.double()) <= 5e-3


@pytest.mark.parametrize("L, lengths", [(1, LENGTHS), (2, LENGTHS), (5, LENGTHS), (1, LENGTHS + [5000]),
                                        (3, LENGTHS + [640])], ids=["L1", "L2", "L5", "L1-many-ctas", "L3-trail"])
@pytest.mark.parametrize("unit_keys", [True, False])
def test_plan_kernel_matches_torch_tables(L, lengths, unit_keys, monkeypatch, flavour):
    """gdn_cp_plan (one launch) against cp.segment_tables + cp.warmup_tables (+ cp.reverse_warmup_tables for the
    backward's launch) on gdn_prepare's real outputs:
    varlen with empty and 1-token sequences, g = 0 heads (fallback), strong decay, keys that void the bound; the
    longest case has more (segment, head) pairs than one CTA of the kernel walks; with a last sequence of whole chunks,
    also the tables with a trailing segment (trail) against cp.trailing_row."""
    x = draw(lengths, 2, 6, 64, 64, torch.bfloat16, seed=L + 100 * (len(lengths) - len(LENGTHS)))
    if not unit_keys:
        x["k"] = x["k"] * 1.6  # beta |k|^2 up to 2.56: some chunks void the warm-up bound
    x["g"] = x["g"] / 8
    captured = {}
    real = fwd._cp_tables

    def spy(problem, L_, TC, t, stream, bidi=False, trail=False):
        captured.update(t=t, TC=TC, out=real(problem, L_, TC, t, stream, bidi, trail), problem=problem)
        return captured["out"]

    monkeypatch.setattr(fwd, "_cp_tables", spy)
    monkeypatch.setattr(settings, "force_segment_chunks", L)
    flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    seg, start, fallback, _ = captured["out"]
    t = captured["t"]
    if flavour:  # gdn_cp_scan's bounds against gdn_prepare's (the split flavour's) on every chunk of the batch
        split = {}
        monkeypatch.setattr(fwd, "_cp_tables", lambda p, L_, TC, t_, st, *a, **kw: (split.update(t=t_),
                                                                                      real(p, L_, TC, t_, st, *a,
                                                                                           **kw))[1])
        monkeypatch.setattr(settings, "cp_fused", False)
        flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
        chunks = int(t["offsets"][-1])
        want = split["t"]
        torch.testing.assert_close(t["gam_t"][:, 63:chunks * 64:64], want["gam_t"][:, 63:chunks * 64:64],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(t["bkk_max"][:, :chunks], want["bkk_max"][:, :chunks], rtol=1e-4, atol=1e-6)
    # the backward's launch (bidi): the same tables plus the reverse warm-ups
    seg2, start2, fallback2, (rend, rfallback) = real(captured["problem"], L, captured["TC"], t, None, bidi=True)
    T = int(x["cu_seqlens"][-1])
    ref = cp.segment_tables(t["cu"], t["offsets"], T, L)
    ref_start, ref_fallback = cp.warmup_tables(ref, t["gam_t"], t["bkk_max"])
    assert seg.count == ref.count
    for name in ("cu", "slot", "base", "last"):
        assert torch.equal(getattr(seg, name).long(), getattr(ref, name).long()), name
    assert torch.equal(start, ref_start) and torch.equal(fallback, ref_fallback)
    assert bool(fallback.any()) and bool((fallback == 0).any())  # both paths exercised
    assert torch.equal(start2, start) and torch.equal(fallback2, fallback) and torch.equal(seg2.cu, seg.cu)
    ref_rend, ref_rfallback = cp.reverse_warmup_tables(ref, t["cu"], t["gam_t"], t["bkk_max"])
    assert torch.equal(rend, ref_rend) and torch.equal(rfallback, ref_rfallback)
    assert bool(rfallback.any())
    if unit_keys:  # a gate-bounded reverse warm-up somewhere (keys with |k| != 1 void the bound everywhere)
        assert bool((rend > seg.cu[1:].int()[:, None]).logical_and(rfallback == 0).any())
    # with trail (multi-GPU CP's linked forward): the last sequence's trailing segment as cp.trailing_row makes it
    # from the tables without; a last sequence of whole chunks (the kernel's precondition) only
    if lengths[-1] % 64 == 0:
        seg3, start3, fallback3, _ = real(captured["problem"], L, captured["TC"], t, None, trail=True)
        N = len(lengths)
        ref_start, ref_fallback = ref_start.clone(), ref_fallback.clone()
        row = cp.trailing_row(ref, N, ref_start, ref_fallback, t["gam_t"], t["bkk_max"])
        assert seg3.count == ref.count + 1
        for name in ("cu", "slot", "base", "last"):  # cu / slot: one more padding entry
            got, want = getattr(seg3, name).long(), getattr(ref, name).long()
            assert torch.equal(got[:want.numel()], want), name
        assert torch.equal(start3[:ref.count], ref_start) and torch.equal(fallback3[:ref.count], ref_fallback)
        assert int(row) < ref.count and bool(fallback3[int(row)].any())       # the g = 0 heads
        if unit_keys:                                                         # and a gate-bounded warm-up
            assert bool((fallback3[int(row)] == 0).any())


def window_build_variants():
    return sorted({(v["dtype"], v["K"]) for v in flash_qla.loader.library().variants(launch.CHAIN_KERNEL)
                   if v["mode"] == "window"})


@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("w", [1024, 8192])
@pytest.mark.parametrize("variant", window_build_variants())
def test_window_build_stops_like_the_reference(variant, w, l2norm):
    """gdn_fwd_chain's window build (multi-GPU CP's head window, flash_qla.distributed._stopped_window) against the
    reference form of its stops (distributed._window_stops) and the fp64 pass from the identity with v = 0: the same
    heads run the whole window; o (NaN-poisoned) is q carried back before each head's stop and zero after it; a head
    that ran the whole window returns its transition. Heads: g = 0, weak, medium and strong decay, and keys with
    beta |k|^2 > 2 that void the gate's bound (without l2norm)."""
    from flash_qla import distributed as cpd
    dtype, K = {"bf16": torch.bfloat16, "fp16": torch.float16}[variant[0]], variant[1]
    hq, hv = 2, 8
    gen = torch.Generator(device="cuda").manual_seed(w + K)
    q = torch.nn.functional.normalize(torch.randn(1, w, hq, K, device="cuda", generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, w, hq, K, device="cuda", generator=gen), dim=-1)
    k[:, :, 1] *= 1.6                                     # q/k head 1 (v-heads 4-7): beta |k|^2 up to 2.56
    q, k = q.to(dtype), k.to(dtype)
    strength = torch.tensor([0.0, 0.002, 0.05, 2.0] * 2, device="cuda")
    g = -strength * torch.nn.functional.softplus(0.5 * torch.randn(1, w, hv, device="cuda", generator=gen) + 1)
    beta = torch.rand(1, w, hv, device="cuda", generator=gen)
    zeros = torch.zeros(1, w, hv, K, device="cuda", dtype=dtype)
    call = cpd._Call(K ** -0.5, l2norm, "auto", torch.float32, hv // hq)
    (o, final), whole = cpd._stopped_window(call, q, k, zeros, g, beta, w)
    stop, whole_ref = cpd._window_stops(call, k, g, beta, w)
    assert torch.equal(whole, whole_ref), (whole, whole_ref)
    assert bool(whole[0]) and not bool(whole[3])          # the g = 0 head runs it all, the strong one stops
    eye = torch.eye(K, dtype=torch.float64, device="cuda").expand(1, hv, K, K).contiguous()
    o_ref, m_ref = reference.chunked_gated_delta_rule(q.double(), k.double(), zeros.double(), g.double(),
                                                      beta.double(), K ** -0.5, eye, True, None, l2norm)
    rows = torch.arange(w, device="cuda")[:, None] < stop[None, :]                     # [w, hv]
    assert not torch.isnan(o).any()
    assert torch.equal(o[0][~rows], torch.zeros_like(o[0][~rows]))
    for h in range(hv):
        n = int(stop[h])
        assert reference.relative_l2(o[0, :n, h], o_ref[0, :n, h]) <= TOL[dtype], h
        if bool(whole[h]):    # a long window's transition contracts toward 0: its error is measured at the scale
            scale = max(float(m_ref[0, h].norm()), K ** 0.5)          # of the identity it starts from, |I| = sqrt(K)
            assert float((final[0, h].double() - m_ref[0, h]).norm()) <= TOL[dtype] * scale, h
    (o2, final2), whole2 = cpd._stopped_window(call, q, k, zeros, g, beta, w)      # repeats bit-identical
    assert torch.equal(o2, o) and torch.equal(final2, final) and torch.equal(whole2, whole)


@pytest.mark.parametrize("variant", [("bf16", 128, 128), ("fp16", 64, 256)], ids=["bf16-K128-V128", "fp16-K64-V256"])
@pytest.mark.parametrize("lengths", [[64 * 40], [333, 64 * 21]], ids=["one", "two"])
@pytest.mark.parametrize("L", [3, 8])
def test_linked_forward_parts_match_fp64(lengths, L, variant, monkeypatch):
    """Multi-GPU CP's linked forward on one GPU (forward.Link, kernel_api.run_linked_entry; the distributed path adds
    the exchange): part one with sequence 0 entering at zero, the trailing segment and B (gdn_cp_combine's zero_z);
    then h_in += B h_e and the output chain give the forward whose sequence 0 enters with h_e: o and the final states
    against the fp64 reference, the trailing row's A + B h_e against the last sequence's final state. NaN-poisoned
    buffers; the recorded plan's replay repeats the recording bit for bit."""
    from flash_qla import kernel_api, validation
    tag, K, V = variant
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[tag]
    monkeypatch.setattr(settings, "force_segment_chunks", L)
    x = draw(lengths, 2, 6, K, V, dtype, seed=L + 10 * len(lengths) + K)
    N, hv = len(lengths), 6
    h_e = x["initial_state"][0].clone()
    h_own = x["initial_state"].clone()
    h_own[0] = 0
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    problem = validation.validate_inputs(*args, None, h_own, x["cu_seqlens"].cpu())
    plan = fwd.forward_plan(problem, tag, x["q"].device, False, False)
    eye = torch.cat([torch.eye(K, device="cuda").expand(1, hv, K, K), torch.zeros(N - 1, hv, K, K, device="cuda")])
    segments = [-(-(-(-n // 64)) // L) for n in lengths]
    o_ref, ht_ref = fp64_reference(x)
    runs = []
    for _ in range(2):  # recorded, then replayed
        o, entry = kernel_api.run_linked_entry(problem, *args, h_own, x["cu_seqlens"], False, plan,
                                               fwd.Link(True, eye), True)
        h_in, b = entry.h_in, entry.b
        leaving = h_in[sum(segments)] + (b[sum(segments)] @ h_e if N == 1 else 0)
        assert reference.relative_l2(leaving, ht_ref[-1]) <= TOL[dtype], "trailing row"
        R = segments[0]
        h_in[:R] += torch.matmul(b[:R], h_e)
        ht = kernel_api.per_sequence(problem, fwd.linked_output(entry, x["q"].device), x["q"].device, "ht")
        assert torch.isfinite(o).all() and torch.isfinite(ht).all(), "unwritten (NaN-poisoned) or non-finite output"
        assert reference.relative_l2(o, o_ref) <= TOL[dtype], "o"
        assert reference.relative_l2(ht, ht_ref) <= TOL[dtype], "final states"
        runs.append((o, ht))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
