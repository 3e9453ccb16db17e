"""sm_90a backward against autograd through the float64 reference on fresh random inputs (GPU machine only)."""
import pytest
import torch

import flash_qla
from flash_qla import launch, reference
from flash_qla import forward as fwd
from flash_qla.tuning import settings
from test_gpu_forward import LENGTHS, draw

pytestmark = pytest.mark.gpu

TOL = 2e-2  # issue 5: every gradient within 2e-2 relative L2 (bf16); the worst measured value is printed
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def dh_variants():
    return sorted({(v["dtype"], v["K"], v["V"], v["BV"]) for v in flash_qla.loader.library().variants("gdn_bwd_dh")})


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(settings, "poison_outputs", True)


def cotangents(x, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    do = torch.randn(x["v"].shape, device="cuda", generator=gen).to(x["v"].dtype)
    dht = torch.randn(x["initial_state"].shape if x["initial_state"] is not None else
                      (x["cu_seqlens"].numel() - 1, x["v"].shape[2], x["q"].shape[3], x["v"].shape[3]),
                      device="cuda", generator=gen)
    return do, dht


def grads(x, do, dht, use_dht=True, fp64=False, **kw):
    leaves = {n: (x[n].double() if fp64 else x[n]).detach().requires_grad_(True)
              for n in NAMES if x[n] is not None}
    if fp64:
        o, ht = reference.chunked_gated_delta_rule(**leaves, output_final_state=True,
                                                   cu_seqlens=x["cu_seqlens"].cpu(), **kw)
    else:
        o, ht = flash_qla.chunk_gated_delta_rule(**leaves, output_final_state=True, cu_seqlens=x["cu_seqlens"],
                                                 **kw)
    outs, cots = [o], [do.to(o.dtype)]
    if use_dht:
        outs.append(ht)
        cots.append(dht.to(ht.dtype))
    got = torch.autograd.grad(outs, list(leaves.values()), cots)
    return dict(zip(leaves, got))


def check(got, want, tol, label):
    worst = {}
    for n, w in want.items():
        assert got[n].dtype == (torch.float32 if n == "initial_state" else got[n].dtype)
        assert torch.isfinite(got[n]).all(), f"{label}: d{n} has NaN (unwritten) or inf"
        worst[n] = reference.relative_l2(got[n], w)
    print(label, {n: f"{e:.2e}" for n, e in worst.items()})
    bad = {n: e for n, e in worst.items() if not e <= tol}
    assert not bad, f"{label}: {bad}"


@pytest.mark.parametrize("case", ["mixed", "tiny"])
@pytest.mark.parametrize("variant", dh_variants())
def test_backward_matches_fp64_autograd(variant, case, monkeypatch):
    tag, K, V, BV = variant
    monkeypatch.setattr(settings, "force_block_v", BV)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[tag]
    for (hq, hv), h0, use_dht in (((2, 6), True, True), ((3, 3), False, False)):
        x = draw(LENGTHS[case], hq, hv, K, V, dtype, seed=K + V + hv + len(case) + 5, h0=h0)
        do, dht = cotangents(x, seed=hv)
        got = grads(x, do, dht, use_dht)
        want = grads(x, do, dht, use_dht, fp64=True)
        check(got, want, TOL, f"{variant} {case} hq={hq} hv={hv} h0={h0} dht={use_dht}")


def test_backward_long_sequences_and_strong_decay():
    x = draw(LENGTHS["long"] + [4096], 2, 8, 128, 128, torch.bfloat16, seed=21)
    do, dht = cotangents(x, seed=2)
    check(grads(x, do, dht), grads(x, do, dht, fp64=True), TOL, "long bf16 K128 V128")


@pytest.mark.parametrize("tag", ["bf16", "fp16"])
def test_backward_with_intra_card_cp_in_the_recompute(tag, monkeypatch):
    """CP forced (4-chunk segments) in both directions: the recompute (warm-up states, exact fallback for the g = 0
    head, combine, the save build over the segments) and the dh chain (reverse warm-ups, exact transposed
    transitions, reverse combine, gdn_bwd_dh over the segments; an empty sequence's dh0 is its dht): every
    gradient within tolerance, and close to the plain path's (they differ by rounding only)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[tag]
    x = draw(LENGTHS["long"] + [700, 0, 1, 65], 2, 8, 128, 128, dtype, seed=29)
    do, dht = cotangents(x, seed=4)
    want = grads(x, do, dht, fp64=True)
    monkeypatch.setattr(settings, "force_segment_chunks", 4)
    passes = []
    real = fwd.cp_pre_pass_and_combine
    monkeypatch.setattr(fwd, "cp_pre_pass_and_combine",
                        lambda kernel, *a, **kw: passes.append(kernel) or real(kernel, *a, **kw))
    got_cp = grads(x, do, dht)
    # the forward's (CP on the fused kernel); then the backward's reverse pre-pass, launched as soon as the recompute's
    # tables are, before the recompute's own (on the split kernels: the recompute keeps their intermediates)
    assert passes == ["gdn_fwd_fused", "gdn_bwd_dh", "gdn_fwd_chain"]
    check(got_cp, want, TOL, f"CP recompute {tag}")
    monkeypatch.setattr(settings, "force_segment_chunks", 0)
    got_plain = grads(x, do, dht)
    check(got_cp, got_plain, TOL / 2, f"CP vs plain recompute {tag}")


def test_backward_cp_combines_walk_more_segments_than_a_flag_window(monkeypatch):
    """One-chunk segments on a 131-chunk sequence: both combines (the recompute's forward walk and the dh chain's
    reverse one) cross a window of 128 fallback flags; the gradients match the plain path's to rounding."""
    x = draw([131 * 64 - 7, 200], 2, 4, 128, 128, torch.bfloat16, seed=31)
    do, dht = cotangents(x, seed=6)
    monkeypatch.setattr(settings, "force_segment_chunks", 1)
    got_cp = grads(x, do, dht)
    monkeypatch.setattr(settings, "force_segment_chunks", 0)
    check(got_cp, grads(x, do, dht), TOL / 2, "CP with 131 segments vs plain")


def test_backward_l2norm_dense_batch_and_scale():
    x = draw([300, 300], 2, 4, 128, 128, torch.bfloat16, seed=23)
    dense = {n: x[n].reshape(2, 300, *x[n].shape[2:]).detach().requires_grad_(True)
             for n in ("q", "k", "v", "g", "beta")}
    h0 = x["initial_state"].detach().requires_grad_(True)
    do = torch.randn_like(dense["v"])
    o, _ = flash_qla.chunk_gated_delta_rule(**dense, scale=0.3, initial_state=h0, use_qk_l2norm_in_kernel=True)
    got = torch.autograd.grad(o, [*dense.values(), h0], do)
    d64 = {n: t.detach().double().requires_grad_(True) for n, t in dense.items()}
    h64 = h0.detach().double().requires_grad_(True)
    o64, _ = reference.chunked_gated_delta_rule(**d64, scale=0.3, initial_state=h64, use_qk_l2norm_in_kernel=True)
    want = torch.autograd.grad(o64, [*d64.values(), h64], do.double())
    check(dict(zip(NAMES, got)), dict(zip(NAMES, want)), TOL, "l2norm dense")


def chunk_variants():
    return sorted({(v["dtype"], v["K"], v["V"]) for v in flash_qla.loader.library().variants("gdn_bwd_chunk")})


@pytest.mark.parametrize("variant", chunk_variants())
def test_fused_l2norm_backward_on_unnormalised_rows(variant):
    """use_qk_l2norm_in_kernel's backward, fused into gdn_bwd_chunk's epilogue: q / k rows with norms spread over
    ~0.02-20 (the normalisation's gradient scales as 1 / |x|), a GVA group of 3 summed before the l2norm backward,
    1-token and partial chunks, dht: every gradient against autograd through the fp64 reference."""
    tag, K, V = variant
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[tag]
    x = draw(LENGTHS["mixed"], 2, 6, K, V, dtype, seed=K + V + 41)
    gen = torch.Generator(device="cuda").manual_seed(K + V)
    for n in ("q", "k"):
        norms = torch.exp(torch.empty(x[n].shape[:-1] + (1,), device="cuda").uniform_(-4, 3, generator=gen))
        x[n] = (x[n].float() * norms).to(dtype)
    do, dht = cotangents(x, seed=K)
    got = grads(x, do, dht, use_qk_l2norm_in_kernel=True)
    want = grads(x, do, dht, fp64=True, use_qk_l2norm_in_kernel=True)
    check(got, want, TOL, f"l2norm backward {variant}")


@pytest.mark.parametrize("segment_chunks", [None, 3])  # planned (no CP here), CP forced in both directions
def test_backward_hundred_repeats_bit_identical(segment_chunks, monkeypatch):
    monkeypatch.setattr(settings, "force_segment_chunks", segment_chunks)
    x = draw(LENGTHS["mixed"] + [2048], 2, 8, 128, 128, torch.bfloat16, seed=25)
    do, dht = cotangents(x, seed=3)
    first = grads(x, do, dht)
    for _ in range(100):
        again = grads(x, do, dht)
        assert all(torch.equal(again[n], first[n]) for n in first)


def test_low_level_bwd_matches_autograd_and_replays_in_a_graph():
    x = draw(LENGTHS["mixed"], 2, 4, 128, 128, torch.bfloat16, seed=27)
    do, dht = cotangents(x, seed=4)
    g_cumsum, A, _, _, _ = flash_qla.chunk_gated_delta_rule_fwd(**x)
    args = dict(q=x["q"], k=x["k"], v=x["v"], g=g_cumsum, beta=x["beta"], A=A, do=do, dht=dht,
                initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    dq, dk, dv, db, dg, dh0 = flash_qla.chunk_gated_delta_rule_bwd(**args)
    want = grads(x, do, dht, fp64=True)
    check(dict(q=dq, k=dk, v=dv, beta=db, g=dg, initial_state=dh0), want, TOL, "low-level bwd")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = flash_qla.chunk_gated_delta_rule_bwd(**args)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(replayed, (dq, dk, dv, db, dg, dh0)))


def test_host_lengths_plan_the_backward_chains():
    """Equal lengths given on the host (cu_seqlens_cpu) plan both chains at BV = 64 where unknown lengths plan 32: the
    gradients agree with the planned-32 call and fp64 through both entry points (the low-level backward and autograd),
    and a later batch of other lengths under the same signature replans (the blocks join the plan's key)."""
    from flash_qla import backward
    x = draw([128] * 8, 2, 8, 128, 128, torch.bfloat16, seed=41)
    do, dht = cotangents(x, seed=8)
    cpu_cu = x["cu_seqlens"].cpu()
    problem = flash_qla.validation.validate_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], None,
                                                   x["initial_state"], x["cu_seqlens"])
    assert backward.chain_blocks(problem, "bf16", x["q"].device, None) != backward.chain_blocks(
        problem, "bf16", x["q"].device, 128)
    g_cumsum, A, _, _, _ = flash_qla.chunk_gated_delta_rule_fwd(**x)
    args = dict(q=x["q"], k=x["k"], v=x["v"], g=g_cumsum, beta=x["beta"], A=A, do=do, dht=dht,
                initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    names = ("q", "k", "v", "beta", "g", "initial_state")
    unknown = dict(zip(names, flash_qla.chunk_gated_delta_rule_bwd(**args)))
    known = dict(zip(names, flash_qla.chunk_gated_delta_rule_bwd(**args, cu_seqlens_cpu=cpu_cu)))
    want = grads(x, do, dht, fp64=True)
    check(known, want, TOL, "bwd with host lengths")
    for n in names:
        assert reference.relative_l2(known[n], unknown[n]) < 1e-3, n
    check(grads(x, do, dht, cu_seqlens_cpu=cpu_cu), want, TOL, "autograd with host lengths")
    skewed = draw([64] * 6 + [256, 384], 2, 8, 128, 128, torch.bfloat16, seed=42)
    do2, dht2 = cotangents(skewed, seed=9)
    check(grads(skewed, do2, dht2, cu_seqlens_cpu=skewed["cu_seqlens"].cpu()), grads(skewed, do2, dht2, fp64=True),
          TOL, "autograd, other lengths")


@pytest.mark.parametrize("segment_chunks", [None, 3])
def test_low_level_bwd_reads_the_forwards_inverse(segment_chunks, monkeypatch):
    """Given A, the recompute reads it instead of solving: gradients within tolerance of fp64 and close to the
    solving path (Agb from A's rounded values instead of the solve's fp32), with and without CP; a different A
    changes them (it is really read)."""
    monkeypatch.setattr(settings, "force_segment_chunks", segment_chunks)
    x = draw(LENGTHS["mixed"] + LENGTHS["tiny"], 2, 4, 128, 128, torch.bfloat16, seed=31)
    do, dht = cotangents(x, seed=6)
    g_cumsum, A, _, _, _ = flash_qla.chunk_gated_delta_rule_fwd(**x)
    args = dict(q=x["q"], k=x["k"], v=x["v"], g=g_cumsum, beta=x["beta"], do=do, dht=dht,
                initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    names = ("q", "k", "v", "beta", "g", "initial_state")
    read = dict(zip(names, flash_qla.chunk_gated_delta_rule_bwd(**args, A=A)))
    solved = dict(zip(names, flash_qla.chunk_gated_delta_rule_bwd(**args, A=None)))
    check(read, grads(x, do, dht, fp64=True), TOL, "bwd reading A")
    for n in names:
        assert reference.relative_l2(read[n], solved[n]) < 5e-3, n
    other = flash_qla.chunk_gated_delta_rule_bwd(**args, A=A * 0.5)
    assert reference.relative_l2(other[0], read["q"]) > 1e-2


def chunk_stage_inputs(x, do, dht):
    """(problem, saved, (dO packed, X, dV, dS')): what gdn_bwd_chunk reads, from the recompute and the dh chain."""
    from flash_qla import backward
    return backward.chunk_stage_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"],
                                       x["cu_seqlens"], do, dht)


@pytest.mark.parametrize("K,V", [(128, 128), (64, 256), (128, 64)])
def test_fused_chunk_stage_matches_the_torch_specification(K, V):
    """gdn_bwd_chunk against flash_qla.chunk_grads (batched torch, float32) on the same recomputed inputs."""
    from flash_qla import backward
    x = draw(LENGTHS["mixed"] + LENGTHS["tiny"], 2, 4, K, V, torch.bfloat16, seed=29)
    do, dht = cotangents(x, seed=5)
    problem, saved, stage = chunk_stage_inputs(x, do, dht)
    fused = backward._chunk_kernel(problem, saved, *stage)
    spec = backward._chunk_parallel(problem, saved, *stage)
    errs = {n: reference.relative_l2(a, b) for n, a, b in zip(("dq", "dk", "dbeta", "dg"), fused, spec)}
    print("fused vs torch chunk stage", K, V, {n: f"{e:.1e}" for n, e in errs.items()})
    assert all(e < 1e-2 for e in errs.values()), errs


@pytest.mark.parametrize("K,V,dtype", [(128, 128, torch.bfloat16), (64, 256, torch.float16)])
def test_chunk_stage_is_the_same_with_several_items_per_cta(K, V, dtype, monkeypatch):
    """gdn_bwd_chunk is persistent: each CTA walks (chunk slot, q/k head) items, loading the next item's tiles under
    the current one. With 1, 2, 3 or 7 CTAs every CTA takes many items (empty slots among them): the gradients must
    be the ones of one item per CTA, bit for bit."""
    from flash_qla import backward
    x = draw(LENGTHS["mixed"] + LENGTHS["tiny"], 2, 4, K, V, dtype, seed=37)
    do, dht = cotangents(x, seed=7)
    problem, saved, stage = chunk_stage_inputs(x, do, dht)
    items = saved["TC"] // launch.CHUNK * problem.num_qk_heads
    assert items > 7 * 4
    # the gate's partial sums come back as None on a plain call
    one_each = [None if t is None else t.clone() for t in backward._chunk_kernel(problem, saved, *stage)]
    assert sum(t is not None for t in one_each) >= 4
    for ctas in (1, 2, 3, 7):
        monkeypatch.setattr(settings, "chunk_ctas_max", ctas)
        got = backward._chunk_kernel(problem, saved, *stage)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, one_each)), ctas


@pytest.mark.parametrize("segment_chunks", [0, 2])
def test_non_contiguous_v_and_h0_match_contiguous(segment_chunks, monkeypatch):
    """v and h0 with transposed strides: the forward packs them into copies that only the recompute's save chain
    reads, on its side stream (ops keeps them from reuse until that stream is done). Same gradients, bit for bit,
    as the contiguous inputs, with and without intra-card CP."""
    monkeypatch.setattr(settings, "force_segment_chunks", segment_chunks)
    x = draw(LENGTHS["mixed"], 2, 4, 128, 128, torch.bfloat16, seed=31)
    do, dht = cotangents(x, seed=6)
    want = grads(x, do, dht)
    strided = dict(x, v=x["v"].transpose(-1, -2).contiguous().transpose(-1, -2),
                   initial_state=x["initial_state"].transpose(-1, -2).contiguous().transpose(-1, -2))
    assert not strided["v"].is_contiguous() and not strided["initial_state"].is_contiguous()
    got = grads(strided, do, dht)
    assert all(torch.equal(got[n], want[n]) for n in want), {n: (got[n] - want[n]).abs().max().item() for n in want}


def test_side_streams_differ_from_the_callers_and_each_other():
    """torch's stream pool wraps after 32: a cached side stream can become a later caller's own stream (a graph's
    capture stream), which silently ran the backward's parallel chains in order."""
    dev = torch.device("cuda")
    names = ("save_chain", "dh_pre_pass", "dh_pre_pass_trans", "side")
    for _ in range(40):  # every stream of the pool as the caller's, the default stream included
        caller = torch.cuda.Stream(dev)
        for current in (caller, torch.cuda.default_stream(dev)):
            with torch.cuda.stream(current):
                picked = [launch.side_stream(dev, n) for n in names]
            handles = {s.cuda_stream for s in picked}
            assert current.cuda_stream not in handles
            assert len(handles) == len(names)
