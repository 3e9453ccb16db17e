"""Every FLA 0.6 / FlashQLA 0.1.3 keyword of chunk_gated_delta_rule, on CPU, against the independent float64 token loop
(tests/test_api.py token_loop) with gradients, and the keyword errors."""
import types

import pytest
import torch
from hypothesis import given, settings, strategies as st

import flash_qla
from flash_qla import api
from gdn_inputs import hard_inputs
from test_api import rel, token_loop


def raw_inputs(lengths, hq=1, hv=2, K=8, V=4, seed=0):
    """fp64 inputs with a raw gate (g_raw, A_log, dt_bias) and beta logits instead of g and beta."""
    x = hard_inputs(lengths, hq, hv, K, V, seed=seed, strong_decay=False)
    gen = torch.Generator().manual_seed(seed + 1)
    T = sum(lengths)
    x["g"] = torch.randn(1, T, hv, generator=gen, dtype=torch.float64) * 2
    x["beta"] = torch.randn(1, T, hv, generator=gen, dtype=torch.float64) * 2
    x["A_log"] = torch.randn(hv, generator=gen, dtype=torch.float64) * 0.5
    x["dt_bias"] = torch.randn(hv, generator=gen, dtype=torch.float64)
    return x


def loop_reference(x, *, gate, sigmoid, neg, v_first, l2norm, scale):
    """The meaning of every keyword written out by hand around token_loop (float64)."""
    g, b, h0, q, k = x["g"], x["beta"], x["initial_state"], x["q"], x["k"]
    if gate:
        z = g + x["dt_bias"]
        g = -torch.exp(x["A_log"]) * torch.log1p(torch.exp(z))  # softplus (no argument here exceeds 20)
    if sigmoid:
        b = (2.0 if neg else 1.0) / (1.0 + torch.exp(-b))
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if v_first:
        h0 = h0.transpose(-1, -2)
    o, s = token_loop(q, k, x["v"], g, b, scale, h0, x["cu_seqlens"])
    return o, (s.transpose(-1, -2) if v_first else s)


LEAVES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _as_the_keywords_take_them(x, gate, sigmoid, v_first):
    """The raw inputs in the form each keyword expects: a decay when the gate is not fused, beta in (0, 1) when
    the sigmoid is not, V-first states when asked."""
    if not gate:
        x["g"] = -torch.nn.functional.softplus(x["g"])
    if not sigmoid:
        x["beta"] = torch.sigmoid(x["beta"])
    if v_first:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()


@pytest.mark.parametrize("gate,sigmoid,neg,v_first,l2norm", [
    (True, True, True, True, True),
    (True, False, False, False, False),
    (False, True, False, True, False),
    (True, True, False, False, True),
])
def test_keywords_match_the_token_loop_with_gradients(gate, sigmoid, neg, v_first, l2norm):
    x = raw_inputs([1, 70, 9], seed=3)
    _as_the_keywords_take_them(x, gate, sigmoid, v_first)
    names = [n for n in LEAVES if gate or n not in ("A_log", "dt_bias")]
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(x["initial_state"].shape, generator=gen, dtype=torch.float64)

    ref = {n: x[n].clone().requires_grad_() for n in names}
    o_ref, s_ref = loop_reference(dict(x, **ref), gate=gate, sigmoid=sigmoid, neg=neg, v_first=v_first, l2norm=l2norm,
                                  scale=0.3)
    want = torch.autograd.grad([o_ref, s_ref], [ref[n] for n in names], [do, dht])

    got = {n: x[n].clone().requires_grad_() for n in names}
    extra = dict(A_log=got["A_log"], dt_bias=got["dt_bias"]) if gate else {}
    o, s = flash_qla.chunk_gated_delta_rule(
        got["q"], got["k"], got["v"], got["g"], got["beta"], 0.3, got["initial_state"], True, l2norm,
        cu_seqlens=x["cu_seqlens"], use_gate_in_kernel=gate, use_beta_sigmoid_in_kernel=sigmoid,
        allow_neg_eigval=neg, state_v_first=v_first, **extra)
    assert s.shape == x["initial_state"].shape and s.is_contiguous()
    assert rel(o, o_ref) < 1e-10 and rel(s, s_ref) < 1e-10
    grads = torch.autograd.grad([o, s], [got[n] for n in names], [do, dht])
    for n, a, b in zip(names, grads, want):
        assert rel(a, b) < 1e-9, n  # includes d raw g, dA_log, ddt_bias and d raw beta


def test_gate_without_dt_bias_and_softplus_threshold():
    """dt_bias is optional; softplus is the identity above 20, as in FLA's kernel."""
    x = raw_inputs([12], hv=2, seed=4)
    x["g"][0, :6] = 30.0 + torch.arange(12, dtype=torch.float64).view(6, 2)
    z = x["g"]
    g_log = -torch.exp(x["A_log"]) * torch.where(z > 20, z, torch.log1p(torch.exp(z.clamp(max=20))))
    a = flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"].sigmoid(), use_gate_in_kernel=True,
                                         A_log=x["A_log"])[0]
    b = flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g_log, x["beta"].sigmoid())[0]
    assert rel(a, b) < 1e-13


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_g_beta_and_state_are_converted(dtype):
    x = hard_inputs([40, 7], 1, 2, 8, 8, dtype=torch.float32, seed=6, strong_decay=False)
    cu = x.pop("cu_seqlens")
    half = {n: x[n].to(dtype).requires_grad_() for n in ("g", "beta", "initial_state")}
    o, s = flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], **half, output_final_state=True, cu_seqlens=cu)
    up = {n: half[n].detach().float() for n in half}
    o2, s2 = flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], **up, output_final_state=True, cu_seqlens=cu)
    assert s.dtype == torch.float32 and torch.equal(o, o2) and torch.equal(s, s2)
    (o.sum() + s.sum()).backward()
    for n, t in half.items():
        assert t.grad is not None and t.grad.dtype == dtype, n


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_size_does_not_change_the_result(chunk_size):
    x = hard_inputs([100, 3], 1, 2, 8, 8, seed=8)
    cu = x.pop("cu_seqlens")
    o64, s64 = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu)
    o, s = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu, chunk_size=chunk_size)
    assert rel(o, o64) < 1e-10 and rel(s, s64) < 1e-10


def test_flashqla_and_fla_only_keywords_keep_the_result():
    x = hard_inputs([20, 30], 1, 2, 8, 8, seed=9)
    cu = x.pop("cu_seqlens")
    o0, s0 = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu)
    chunk_indices = torch.tensor([[0, 0], [1, 0]])
    o, s = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(),
                                            chunk_indices=chunk_indices, head_first=False, auto_cp=False,
                                            enable_fwd_cp_cache=False, force_intra_cp=True)
    assert torch.equal(o, o0) and torch.equal(s, s0)


def test_positional_order_is_fla_and_flashqla_s():
    """Both peers put use_qk_l2norm_in_kernel ninth; everything after it is keyword-only here."""
    x = hard_inputs([10], 1, 1, 8, 8, seed=10)
    x.pop("cu_seqlens")
    a = flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, x["initial_state"], True, True)
    b = flash_qla.chunk_gated_delta_rule(**x, scale=0.5, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(TypeError, match="positional"):
        flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, None, True, True, None)


def test_output_buffer_is_written_returned_and_differentiable():
    x = hard_inputs([12, 5], 1, 2, 8, 4, dtype=torch.float32, seed=11)
    cu = x.pop("cu_seqlens")
    v = x["v"].clone().requires_grad_()
    o_ref, _ = flash_qla.chunk_gated_delta_rule(x["q"], x["k"], v, x["g"], x["beta"], cu_seqlens=cu)
    for shape in ((1, 17, 2, 4), (17, 2, 4)):
        buf = torch.full(shape, float("nan"))
        o, _ = flash_qla.chunk_gated_delta_rule(x["q"], x["k"], v, x["g"], x["beta"], cu_seqlens=cu, output=buf)
        assert o is buf and torch.equal(buf.reshape(o_ref.shape), o_ref.detach())
        gv, = torch.autograd.grad(o.sum(), v)
        want, = torch.autograd.grad(o_ref.sum(), v, retain_graph=True)
        assert torch.allclose(gv, want)


def test_cu_seqlens_cpu_reaches_the_kernel_path_only_where_accepted(monkeypatch):
    """The kernel entry point gets cu_seqlens_cpu (and auto_cp=False) only if its signature names them."""
    seen = {}

    def with_it(problem, q, k, v, g, beta, h0, final, cu, l2norm, cu_seqlens_cpu=None):
        seen["with"] = cu_seqlens_cpu
        return torch.zeros_like(v), None

    def without_it(problem, q, k, v, g, beta, h0, final, cu, l2norm):
        seen["without"] = True
        return torch.zeros_like(v), None

    def any_kw(problem, q, k, v, g, beta, h0, final, cu, l2norm, **kw):
        seen["any"] = kw
        return torch.zeros_like(v), None

    x = hard_inputs([4, 6], 1, 1, 8, 8, seed=12)
    cu = x.pop("cu_seqlens")
    monkeypatch.setattr(api, "select_backend", lambda device, backend: "kernels")
    for fn in (with_it, without_it, any_kw):
        monkeypatch.setattr(api, "_kernel_ops", lambda fn=fn: types.SimpleNamespace(chunk_gated_delta_rule=fn))
        flash_qla.chunk_gated_delta_rule(**x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(),
                                         auto_cp=False)
    assert torch.equal(seen["with"], cu) and seen["without"] is True
    assert set(seen["any"]) == {"cu_seqlens_cpu", "auto_cp"} and seen["any"]["auto_cp"] is False


def test_cp_context_routes_to_flash_qla_distributed(monkeypatch):
    distributed = pytest.importorskip("flash_qla.distributed")
    calls = []

    def fake_cp(q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cp_context, backend):
        calls.append(dict(g=g, beta=beta, scale=scale, h0=initial_state, final=output_final_state, l2norm=l2norm,
                          ctx=cp_context, backend=backend))
        return torch.zeros_like(v), torch.ones(1, v.shape[2], q.shape[3], v.shape[3])

    monkeypatch.setattr(distributed, "chunk_gated_delta_rule_cp", fake_cp)
    ctx = object.__new__(distributed.CPContext)
    x = raw_inputs([10], hv=2, K=4, V=4, seed=13)
    h0 = x["initial_state"].transpose(-1, -2).contiguous()
    o, s = flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.7, h0, True, True,
                                            use_gate_in_kernel=True, A_log=x["A_log"], use_beta_sigmoid_in_kernel=True,
                                            state_v_first=True, cp_context=ctx, backend="reference")
    c, = calls
    assert c["ctx"] is ctx and c["scale"] == 0.7 and c["final"] and c["l2norm"] and c["backend"] == "reference"
    assert torch.equal(c["g"], -torch.exp(x["A_log"]) * torch.nn.functional.softplus(x["g"]))
    assert torch.equal(c["beta"], torch.sigmoid(x["beta"]))
    assert torch.equal(c["h0"], x["initial_state"])            # handed over K-first
    assert s.shape == (1, 2, 4, 4)                              # returned in the caller's V-first layout
    assert flash_qla.build_cp_context is distributed.build_cp_context


def test_foreign_or_unavailable_cp_context_is_named(monkeypatch):
    x = hard_inputs([8], 1, 1, 4, 4, seed=14)
    x.pop("cu_seqlens")

    class FLACPContext:  # stands in for fla.ops.cp.FLACPContext
        pass
    with pytest.raises(TypeError, match=r"CPContext .*got a .*FLACPContext"):
        flash_qla.chunk_gated_delta_rule(**x, cp_context=FLACPContext())


def args(T=10, hv=2):
    x = hard_inputs([T], 1, hv, 8, 8, seed=15)
    x.pop("cu_seqlens")
    x.pop("initial_state")
    return x


@pytest.mark.parametrize("kw,exc,match", [
    (dict(head_first=True), ValueError, r"head_first=True .* not supported"),
    (dict(head_first=1), TypeError, r"head_first must be a bool"),
    (dict(chunk_size=128), ValueError, r"chunk_size must be one of \(16, 32, 64\).*kernels always use chunks of 64"),
    (dict(chunk_size=True), ValueError, r"chunk_size must be one of"),
    (dict(allow_neg_eigval=True), ValueError, r"allow_neg_eigval=True .* requires use_beta_sigmoid_in_kernel=True"),
    (dict(use_gate_in_kernel=True), ValueError, r"requires A_log"),
    (dict(A_log=torch.zeros(2)), ValueError, r"A_log given with use_gate_in_kernel=False"),
    (dict(dt_bias=torch.zeros(2)), ValueError, r"dt_bias given with use_gate_in_kernel=False"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), ValueError, r"A_log must have Hv = 2 elements"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(2, dtype=torch.int32)), TypeError,
     r"dt_bias must be a floating tensor"),
    (dict(chunk_indices=torch.zeros(2, 2, dtype=torch.int64)), ValueError, r"chunk_indices .* needs cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 10]), chunk_indices=torch.zeros(3)), ValueError,
     r"chunk_indices must be an int32/int64 tensor \[num_chunks, 2\]"),
    (dict(cu_seqlens_cpu=torch.tensor([0, 10])), ValueError, r"cu_seqlens_cpu .* needs cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 10]), cu_seqlens_cpu=torch.tensor([0, 4, 10])), ValueError,
     r"cu_seqlens_cpu must have cu_seqlens' shape"),
    (dict(cu_seqlens=torch.tensor([0, 10]), cu_seqlens_cpu=torch.tensor([0, 9])), ValueError,
     r"cu_seqlens must end at the token count T = 10"),
    (dict(cu_seqlens=torch.tensor([0, 3, 10]), cu_seqlens_cpu=torch.tensor([0, 4, 10])), ValueError,
     r"cu_seqlens_cpu must hold the values of cu_seqlens"),
    (dict(auto_cp="yes"), TypeError, r"auto_cp must be a bool"),
    (dict(output=torch.zeros(1, 10, 2, 7)), ValueError, r"output must have shape \[B, T, Hv, V\] = \(1, 10, 2, 8\)"),
    (dict(output=torch.zeros(1, 10, 2, 8, dtype=torch.float32)), TypeError, r"output must have v's dtype"),
    (dict(state_v_first=True, initial_state=torch.zeros(1, 2, 8, 7)), ValueError,
     r"initial_state must have shape \[N, Hv, V, K\] = \(1, 2, 8, 8\) \(N = B\) \(state_v_first=True\)"),
    (dict(not_a_keyword=1), TypeError, r"unexpected keyword argument 'not_a_keyword'"),
])
def test_keyword_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        flash_qla.chunk_gated_delta_rule(**args(), **kw)


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=3), gate=st.booleans(), sigmoid=st.booleans(),
       neg=st.booleans(), v_first=st.booleans(), seed=st.integers(0, 1000))
def test_forward_keywords_property(lengths, gate, sigmoid, neg, v_first, seed):
    """Random lengths (empty sequences too) and keyword mixes: the API equals the hand-written meaning."""
    if sum(lengths) == 0:
        lengths = lengths + [1]
    neg = neg and sigmoid
    x = raw_inputs(lengths, hv=2, K=4, V=4, seed=seed)
    _as_the_keywords_take_them(x, gate, sigmoid, v_first)
    o_ref, s_ref = loop_reference(x, gate=gate, sigmoid=sigmoid, neg=neg, v_first=v_first, l2norm=False, scale=0.5)
    extra = dict(A_log=x["A_log"], dt_bias=x["dt_bias"]) if gate else {}
    o, s = flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, x["initial_state"], True,
                                            cu_seqlens=x["cu_seqlens"], use_gate_in_kernel=gate,
                                            use_beta_sigmoid_in_kernel=sigmoid, allow_neg_eigval=neg,
                                            state_v_first=v_first, **extra)
    assert rel(o, o_ref) < 1e-10 and rel(s, s_ref) < 1e-10
