"""sm_90a forward kernels against the float64 reference on fresh random inputs (GPU machine only)."""
import itertools

import types

import pytest
import torch

import flash_qla
from flash_qla import launch, reference
from flash_qla import forward as fwd
from flash_qla.tuning import settings
from flash_qla.validation import validate_inputs

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
LENGTHS = {
    "mixed": [1, 63, 64, 65, 130, 200],
    "tiny": [1, 2, 3, 5, 7, 11, 13, 17, 31, 33, 47, 1, 1, 2],
    "long": [1000, 333],
}


def draw(lengths, hq, hv, K, V, dtype, seed, h0=True):
    """Hard inputs: unit-norm q/k, strong decay on some heads (down to ~-20/token), g = 0 heads,
    beta near 0 and near 1, random initial state."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lengths)
    dev = "cuda"
    q = torch.nn.functional.normalize(torch.randn(1, T, hq, K, device=dev, generator=gen), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(1, T, hq, K, device=dev, generator=gen), dim=-1).to(dtype)
    v = torch.randn(1, T, hv, V, device=dev, generator=gen).to(dtype)
    strength = torch.linspace(0, 16, hv, device=dev)
    strength[hv // 2] = 0.0
    g = -strength * torch.nn.functional.softplus(0.5 * torch.randn(1, T, hv, device=dev, generator=gen) + 1)
    beta = torch.rand(1, T, hv, device=dev, generator=gen)
    beta[..., 0] *= 1e-3
    beta[..., -1] = 1 - 1e-3 * beta[..., -1]
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=dev)
    state = torch.randn(len(lengths), hv, K, V, device=dev, generator=gen) if h0 else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=state, cu_seqlens=cu)


def fp64_reference(x):
    d = {n: (t.double() if t is not None else None) for n, t in x.items() if n != "cu_seqlens"}
    return reference.chunked_gated_delta_rule(**d, output_final_state=True, cu_seqlens=x["cu_seqlens"].cpu())


def variants():
    """Every build of the output pass."""
    return sorted({(v["dtype"], v["K"], v["V"], v["BV"]) for v in flash_qla.loader.library().variants(launch.CHAIN_KERNEL)
                   if v["mode"] == "out"})


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(settings, "poison_outputs", True)
    monkeypatch.setattr(settings, "force_segment_chunks", 0)  # the plain path; tests/test_gpu_cp.py covers CP


# the plain forward's two paths: gdn_fwd_fused alone, or gdn_prepare + gdn_fwd_chain (what CP, l2norm and the
# backward's recompute build on)
PATHS = {"fused": True, "split": False}
# the fused path's builds (V block 64: one consumer warpgroup; 128: two, the bf16 state in shared memory) and
# the split path at the planner's block
PATH_BLOCKS = [("fused", 64), ("fused", 128), ("split", None)]


def pin_path(monkeypatch, path, block_v):
    monkeypatch.setattr(settings, "use_fused", PATHS[path])
    monkeypatch.setattr(settings, "force_block_v", block_v)


def launched_kernels(monkeypatch) -> list:
    """The kernels each call launches, seen from Python: plans are not replayed while it watches."""
    names = []
    real = launch.launch
    monkeypatch.setattr(settings, "replay", False)
    monkeypatch.setattr(fwd, "launch", lambda name, *a, **kw: names.append(name) or real(name, *a, **kw))
    return names


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("case", sorted(LENGTHS))
@pytest.mark.parametrize("variant", variants())
def test_forward_matches_fp64_reference(variant, case, path, monkeypatch):
    tag, K, V, BV = variant
    pin_path(monkeypatch, path, BV)
    kernels = launched_kernels(monkeypatch)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[tag]
    for (hq, hv), h0 in (((2, 6), True), ((3, 3), False)):
        x = draw(LENGTHS[case], hq, hv, K, V, dtype, seed=K + V + hv + len(case), h0=h0)
        o, ht = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
        assert o.dtype == dtype and ht.dtype == torch.float32
        assert torch.isfinite(o).all() and torch.isfinite(ht).all(), "unwritten (NaN-poisoned) or non-finite output"
        o_ref, ht_ref = fp64_reference(x)
        assert reference.relative_l2(o, o_ref) <= TOL[dtype], (hq, hv, "o")
        assert reference.relative_l2(ht, ht_ref) <= TOL[dtype], (hq, hv, "final_state")
    chain = [n for n in kernels if n in (launch.FUSED_KERNEL, launch.CHAIN_KERNEL)]
    assert chain == [launch.FUSED_KERNEL if PATHS[path] else launch.CHAIN_KERNEL] * 2, kernels
    assert PATHS[path] == (kernels == [launch.FUSED_KERNEL] * 2), kernels  # the fused path launches nothing else


@pytest.mark.parametrize("tag", ["bf16", "fp16"])
@pytest.mark.parametrize("K", [64, 128])
def test_prepare_heads_per_cta_agree(tag, K, monkeypatch):
    """gdn_prepare's head groups (1, 2 or 4 v-heads of one q / k head per CTA; 3 for a ratio of 3): every
    grouping matches the fp64 reference and gives bit-identical outputs (each head's arithmetic is the same)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[tag]
    for (hq, hv), groups in (((2, 8), (1, 2, 4)), ((1, 3), (1, 3))):
        x = draw(LENGTHS["mixed"] + LENGTHS["tiny"], hq, hv, K, K, dtype, seed=K + hv)
        o_ref, ht_ref = fp64_reference(x)
        problem = validate_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                  cu_seqlens=x["cu_seqlens"])
        results = []
        for hpc in groups:
            monkeypatch.setattr(settings, "force_heads_per_cta", hpc)
            o, ht, A, _ = fwd.forward(problem, x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], True,
                                      x["cu_seqlens"], False, want_gate_free_inverse=True)
            assert torch.isfinite(o).all() and torch.isfinite(ht).all() and torch.isfinite(A).all(), hpc
            assert reference.relative_l2(o, o_ref) <= TOL[dtype], (hq, hv, hpc, "o")
            assert reference.relative_l2(ht, ht_ref) <= TOL[dtype], (hq, hv, hpc, "final_state")
            results.append((o, ht, A))
        for hpc, (o, ht, A) in zip(groups[1:], results[1:]):
            assert torch.equal(o, results[0][0]) and torch.equal(ht, results[0][1]), hpc
            assert torch.equal(A, results[0][2]), hpc


@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("variant", variants())
def test_fused_l2norm_matches_fp64_reference(variant, path, prenorm, monkeypatch):
    """use_qk_l2norm_in_kernel on unnormalised q / k (norms ~3 and ~0.5): gdn_prepare normalises the tiles
    it loads and hands them to the output pass (GVA group of 3, so one v-head stores each group's rows), or
    gdn_fwd_fused applies 1 / |q_i|, 1 / |k_i| (from Q Q^T's and K K^T's diagonals) as scalings; with prenorm a
    gdn_l2norm pass normalises q / k for the plain builds of either path (the fused one at BV = 128 too)."""
    tag, K, V, BV = variant
    pin_path(monkeypatch, path, BV)
    monkeypatch.setattr(settings, "prenorm", prenorm)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[tag]
    x = draw(LENGTHS["mixed"], 2, 6, K, V, dtype, seed=K + V + 5)
    x["q"], x["k"] = (x["q"].float() * 3).to(dtype), (x["k"].float() * 0.5).to(dtype)
    o, ht = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    d = {n: (t.double() if t is not None else None) for n, t in x.items() if n != "cu_seqlens"}
    o_ref, ht_ref = reference.chunked_gated_delta_rule(**d, output_final_state=True, cu_seqlens=x["cu_seqlens"].cpu(),
                                                       use_qk_l2norm_in_kernel=True)
    assert reference.relative_l2(o, o_ref) <= TOL[dtype] and reference.relative_l2(ht, ht_ref) <= TOL[dtype]


@pytest.mark.parametrize("tag", ["bf16", "fp16"])
@pytest.mark.parametrize("K", [64, 128])
def test_l2norm_pass_rounds_each_row_once(tag, K):
    """gdn_l2norm: every row x / sqrt(sum x^2 + eps) in fp32, one rounding (within one unit of the last place of the
    fp64 value's rounding), on T not a multiple of 64 (the last block partial), each row written (NaN-poisoned
    outputs), repeats bit-identical."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[tag]
    T, Hq = 64 * 5 + 37, 3
    gen = torch.Generator(device="cuda").manual_seed(K + T)
    q = (torch.randn(T, Hq, K, device="cuda", generator=gen) * 3).to(dtype)
    k = (torch.randn(T, Hq, K, device="cuda", generator=gen) * 0.01).to(dtype)
    k[5, 1] = 0  # a zero row stays zero (eps)
    problem = types.SimpleNamespace(batch=1, tokens=T, num_qk_heads=Hq, head_dim_k=K)
    qn, kn = fwd.l2norm_rows(problem, q, k, tag, torch.cuda.current_stream().cuda_stream)
    again = fwd.l2norm_rows(problem, q, k, tag, torch.cuda.current_stream().cuda_stream)
    for x, y, y2 in ((q, qn, again[0]), (k, kn, again[1])):
        assert torch.isfinite(y).all() and torch.equal(y, y2)
        want = x.double() / torch.sqrt((x.double() ** 2).sum(-1, keepdim=True) + 1e-6)
        # one unit in the last place: 2^-7 / 2^-10 of the value, and fp16's subnormal spacing near zero
        ulp = (want.abs() * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10)).clamp_min(2.0 ** -24)
        assert ((y.double() - want).abs() <= ulp).all()
    assert (kn[5, 1] == 0).all()


def test_dense_batch_and_scale_and_l2norm():
    x = draw([300, 300], 2, 4, 128, 128, torch.bfloat16, seed=7)
    dense = {n: x[n].reshape(2, 300, *x[n].shape[2:]) for n in ("q", "k", "v", "g", "beta")}
    o, ht = flash_qla.chunk_gated_delta_rule(**dense, scale=0.3, initial_state=x["initial_state"],
                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    d = {n: t.double() for n, t in dense.items()}
    o_ref, ht_ref = reference.chunked_gated_delta_rule(**d, scale=0.3, initial_state=x["initial_state"].double(),
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert reference.relative_l2(o, o_ref) <= 1e-2
    assert reference.relative_l2(ht, ht_ref) <= 1e-2


@pytest.mark.parametrize("path,block_v", PATH_BLOCKS)
def test_empty_sequences_keep_their_initial_state(path, block_v, monkeypatch):
    """Zero-length sequences inside a varlen batch: final state = initial state exactly, the others within
    tolerance of fp64."""
    pin_path(monkeypatch, path, block_v)
    x = draw([0, 5, 0, 70, 0], 2, 4, 128, 128, torch.bfloat16, seed=19)
    o, ht = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    o_ref, ht_ref = fp64_reference(x)
    assert reference.relative_l2(o, o_ref) <= 1e-2 and reference.relative_l2(ht, ht_ref) <= 1e-2
    for n in (0, 2, 4):
        assert torch.equal(ht[n], x["initial_state"][n]), n


@pytest.mark.parametrize("path,block_v", PATH_BLOCKS)
def test_hundred_repeats_are_bit_identical(path, block_v, monkeypatch):
    pin_path(monkeypatch, path, block_v)
    x = draw(LENGTHS["mixed"] + [2048], 2, 8, 128, 128, torch.bfloat16, seed=11)
    o0, ht0 = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    for _ in range(100):
        o, ht = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
        assert torch.equal(o, o0) and torch.equal(ht, ht0)


@pytest.mark.parametrize("path,block_v", PATH_BLOCKS)
def test_cuda_graph_capture_replays_exactly(path, block_v, monkeypatch):
    """The eager call records the call's plan; the capture replays it (flash_qla/plans.py) into the graph."""
    pin_path(monkeypatch, path, block_v)
    x = draw([500, 64, 3], 2, 4, 128, 128, torch.bfloat16, seed=13)
    o_eager, ht_eager = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, o_eager) and torch.equal(ht, ht_eager)


def test_unsupported_head_dims_are_named():
    x = draw([10], 1, 1, 96, 96, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match=r"\(K=96, V=96\) are not built for sm_90a; supported: .*\(K=128, V=128\)"):
        flash_qla.chunk_gated_delta_rule(**x)


def test_low_level_fwd_returns_gate_free_inverse_and_chunk_cumsum(monkeypatch):
    x = draw(LENGTHS["mixed"], 2, 4, 128, 128, torch.bfloat16, seed=17)
    g_cumsum, A, o, h, ht = flash_qla.chunk_gated_delta_rule_fwd(**x, output_final_state=True)
    cu = x["cu_seqlens"].cpu()
    assert h is None and A.dtype == torch.bfloat16 and g_cumsum.dtype == torch.float32
    assert reference.relative_l2(g_cumsum, reference.chunk_local_cumsum(x["g"].double(), cu)) < 1e-6
    A_ref = reference.gate_free_inverse(x["k"].double(), x["beta"].double(), cu, num_v_heads=4)
    assert reference.relative_l2(A, A_ref) < 1e-2
    monkeypatch.setattr(settings, "use_fused", True)
    o_fused, ht_fused = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    # the fused kernel rounds P once where gdn_prepare rounds scale * Q K^T first: close, not bit-identical
    assert reference.relative_l2(o_fused, o) < 2e-3 and reference.relative_l2(ht_fused, ht) < 2e-3
    monkeypatch.setattr(settings, "use_fused", False)
    o2, ht2 = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


def test_plan_kernel_chunk_offsets_and_order_match_torch():
    """gdn_plan's chunk offsets, and its dispatch order: up to 1024 sequences by chunk count, longest first, ties
    by index (a stable sort); beyond that the identity. Lengths repeat often (ties) and include empty sequences. The
    words it zeroes (gdn_gate_bwd's tickets) after the tables in the same allocation, over any previous contents."""
    gen = torch.Generator().manual_seed(3)
    for n, z in ((1, 0), (7, 3), (1024, 0), (1025, 1), (3000, 1500)):
        for high in (300, 3):  # many distinct counts; then nearly all tied
            lens = torch.randint(0, high * 64, (n,), generator=gen)
            cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).int().cuda()
            x = torch.zeros(1, 1, 1, 64, device="cuda").expand(1, int(cu[-1]), 1, 64)  # shapes only
            problem = flash_qla.validation.validate_inputs(x, x, x, x[..., 0], x[..., 0], cu_seqlens=cu)
            torch.full((2 * n + 1 + z,), -7, dtype=torch.int32, device="cuda")  # freed: likely the plan's block
            _, offsets, order, zeros = fwd._offsets(problem, cu, cu.device, want_order=True, zero_words=z)
            assert (zeros is None) if z == 0 else (zeros.numel() == z and not zeros.any()), (n, z)
            counts = (lens + 63) // 64
            want = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
            assert torch.equal(offsets.cpu().long(), want), n
            want_order = (torch.sort(-counts, stable=True).indices if n <= 1024 else torch.arange(n))
            assert torch.equal(order.cpu().long(), want_order), (n, high)
