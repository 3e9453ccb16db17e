"""FLA's gate / beta activations fused into the kernels, on the CPU: the mode bits, the gradient formulas the kernels'
stores use (against autograd through flash_qla/gates.py in float64), what forward / backward pass each kernel for every
mode (checked against its cubin's parameter list in the manifest), and the API's routing. The results of the kernels
themselves: tests/test_gpu_gates.py. The CPU path's keywords against the float64 token loop, with every gradient:
tests/test_dropin.py."""
from pathlib import Path

import pytest
import torch

import flash_qla
from flash_qla import api, gates
from flash_qla import backward as bwd
from flash_qla import forward as fwd
from flash_qla.tuning import settings
from flash_qla.validation import validate_inputs


def _module_constant(module: str, name: str):
    """A constant of aot/kernels/<module>.py (the build tree: absent where the installed wheel is tested)."""
    return pytest.importorskip("build_matrix.variants").module_constant(module, name)


ROOT = Path(__file__).resolve().parent.parent
GATED = {"gdn_prepare", "gdn_fwd_fused", "gdn_gate_bwd"}


def test_mode_bits_match_the_kernels():
    for name in ("GATE", "GATE_BIAS", "BETA_SIGMOID", "NEG_EIGVAL", "SOFTPLUS_THRESHOLD"):
        assert _module_constant("gate_act", name) == getattr(gates, name), name


def test_kernel_gate_modes():
    a, b = torch.zeros(4, dtype=torch.bfloat16), torch.ones(4)
    assert gates.kernel_gate(False, None, None, False, False).mode == 0
    assert gates.kernel_gate(False, None, None, True, False).mode == gates.BETA_SIGMOID
    assert gates.kernel_gate(False, None, None, True, True).mode == gates.BETA_SIGMOID | gates.NEG_EIGVAL
    kg = gates.kernel_gate(True, a, b, False, False)
    assert kg.mode == gates.GATE | gates.GATE_BIAS and kg.gate
    assert kg.A_log.dtype == torch.float32 and kg.dt_bias is b  # float32 [Hv] is read as it is
    kg = gates.kernel_gate(True, b.view(1, 4), None, True, False)
    assert kg.mode == gates.GATE | gates.BETA_SIGMOID and kg.dt_bias is None and kg.A_log.shape == (4,)
    stand_in = torch.zeros(3)
    assert kg.pointers(stand_in) == {"A_log": kg.A_log.data_ptr(), "dt_bias": kg.A_log.data_ptr()}
    assert gates.NO_GATE.pointers(stand_in) == {"A_log": stand_in.data_ptr(), "dt_bias": stand_in.data_ptr()}


def _softplus(x):
    return torch.where(x > gates.SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x.clamp(max=gates.SOFTPLUS_THRESHOLD))))


@pytest.mark.parametrize("neg", [False, True])
def test_store_formulas_match_autograd(neg):
    """gdn_bwd_chunk's stores (aot/kernels/gate_act.py): d g = dg_log * (-exp(A_log) sigmoid(g + dt_bias)), 1 for the
    sigmoid above softplus's threshold; dA_log = sum dg_log * g_log; d dt_bias = sum d g; d b = dbeta beta (1 - beta /
    m). Checked in float64 against autograd through gates.py, on gates past the threshold and large logits."""
    gen = torch.Generator().manual_seed(0)
    T, Hv = 300, 3
    g = torch.randn(T, Hv, generator=gen, dtype=torch.float64) * 8
    g[:10] = 19.0 + torch.arange(30, dtype=torch.float64).view(10, 3) * 0.2  # both sides of the threshold
    b = torch.randn(T, Hv, generator=gen, dtype=torch.float64) * 6
    b[:4] = torch.tensor([30.0, -30.0, 80.0], dtype=torch.float64)
    A_log = torch.randn(Hv, generator=gen, dtype=torch.float64)
    dt_bias = torch.randn(Hv, generator=gen, dtype=torch.float64)
    dglog = torch.randn(T, Hv, generator=gen, dtype=torch.float64)
    dbeta = torch.randn(T, Hv, generator=gen, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (g, A_log, dt_bias, b)]
    g_log = gates.gdn_gate(leaves[0], leaves[1], leaves[2])
    beta = gates.beta_from_logits(leaves[3], neg)
    want = torch.autograd.grad([g_log, beta], leaves, [dglog, dbeta])

    x = g + dt_bias
    slope = -torch.exp(A_log) * torch.where(x > gates.SOFTPLUS_THRESHOLD, torch.ones_like(x), torch.sigmoid(x))
    glog = -torch.exp(A_log) * _softplus(x)
    m = 2.0 if neg else 1.0
    act = torch.sigmoid(b) * m
    got = (dglog * slope, (dglog * glog).sum(0), (dglog * slope).sum(0), dbeta * act * (1 - act / m))
    for n, a, w in zip(("d g", "dA_log", "d dt_bias", "d b"), got, want):
        assert torch.allclose(a, w, rtol=1e-12, atol=1e-300), n
    assert torch.allclose(glog, g_log.detach(), rtol=1e-14, atol=0)


@pytest.mark.parametrize("tokens,hv,want", [
    (2048, 8, (8, 8, "ticket")),        # TP8 1x2048: 256 tokens a step (four per warp)
    (8192, 8, (8, 32, "ticket")),       # TP8 1024x8
    (16384, 8, (8, 64, "ticket")),
    (16385, 8, (8, 65, "tiles")),
    (32768, 16, (16, 256, "tiles")),    # 2B-TP1 28672+4096
    (4096, 40, (32, 64, "ticket")),     # two head blocks, the second partial
    (1, 64, (32, 1, "ticket")),
])
def test_gate_backward_shape(tokens, hv, want):
    assert bwd.gate_backward_shape(tokens, hv) == want


def test_gate_backward_constants_match_the_kernel():
    for name, value in (("WARPS", bwd.GATE_WARPS), ("E", bwd.GATE_E)):
        assert _module_constant("gdn_gate_bwd", name) == value, name


def _inputs(N=3, tokens=40, hq=2, hv=4):
    T = N * tokens
    bf16 = torch.bfloat16
    x = dict(q=torch.randn(1, T, hq, 128).to(bf16), k=torch.randn(1, T, hq, 128).to(bf16),
             v=torch.randn(1, T, hv, 128).to(bf16), g=torch.randn(1, T, hv), beta=torch.randn(1, T, hv),
             cu=torch.arange(0, T + 1, tokens, dtype=torch.int32), A_log=torch.randn(hv), dt_bias=torch.randn(hv))
    return validate_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, x["cu"]), x


MODES = [gates.NO_GATE.mode, gates.GATE, gates.GATE | gates.GATE_BIAS | gates.BETA_SIGMOID,
         gates.BETA_SIGMOID | gates.NEG_EIGVAL]


def _gate(mode, x):
    return gates.KernelGate(mode, x["A_log"] if mode & gates.GATE else None,
                            x["dt_bias"] if mode & gates.GATE_BIAS else None)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_forward_passes_the_mode(launches, monkeypatch, fused, mode):
    monkeypatch.setattr(settings, "use_fused", fused)
    problem, x = _inputs()
    gate = _gate(mode, x)
    fwd.forward(problem, x["q"], x["k"], x["v"], x["g"], x["beta"], None, True, x["cu"], False, gate=gate)
    gated = [(n, s, p) for n, _, s, p in launches if n in GATED]
    assert [n for n, _, _ in gated] == (["gdn_fwd_fused"] if fused else ["gdn_prepare"])
    for n, s, p in gated:
        assert s["gate_mode"] == mode
        assert p["g"] == x["g"].data_ptr()
        if mode & gates.GATE:
            assert p["A_log"] == x["A_log"].data_ptr()
            assert p["dt_bias"] == (x["dt_bias"] if mode & gates.GATE_BIAS else x["A_log"]).data_ptr()


@pytest.mark.parametrize("mode", MODES)
def test_backward_passes_the_mode(launches, mode):
    """The recompute's gdn_prepare takes the mode and, with beta logits, stores the activated beta; gdn_bwd_chunk runs
    its plain build on that beta; gdn_gate_bwd then turns its dg / dbeta into the raw inputs' gradients in place, with
    dA_log's and dt_bias's sums (the ticket build on a call this small: the tickets gdn_plan zeroed)."""
    problem, x = _inputs()
    gate = _gate(mode, x)
    do = torch.randn_like(x["v"])
    out = bwd.backward(problem, x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["cu"], False, do, None, gate=gate)
    assert len(out) == (7 if mode & gates.GATE else 6)
    names = [n for n, _, _, _ in launches]
    (ps, pp), = [(s, p) for n, _, s, p in launches if n == "gdn_prepare"]
    (cs, cp), = [(s, p) for n, _, s, p in launches if n == "gdn_bwd_chunk"]
    assert ps["gate_mode"] == mode and pp["g"] == x["g"].data_ptr() and pp["beta"] == x["beta"].data_ptr()
    assert "gate_mode" not in cs  # the plain build, whatever the mode
    if mode & gates.BETA_SIGMOID:  # the chunk kernel reads the beta gdn_prepare activated and stored
        assert ps["store_beta"] == 1 and cp["beta"] == pp["beta_out"] != x["beta"].data_ptr()
    else:
        assert ps["store_beta"] == 0 and cp["beta"] == x["beta"].data_ptr()
    gated = [(s, p) for n, _, s, p in launches if n == "gdn_gate_bwd"]
    assert len(gated) == (1 if mode else 0)
    if mode:  # after the chunk kernel, in place on its dg / dbeta
        (s, p), = gated
        assert names.index("gdn_gate_bwd") > names.index("gdn_bwd_chunk")
        assert s["gate_mode"] == mode and p["g"] == x["g"].data_ptr() and p["beta"] == cp["beta"]
        assert p["dg"] == cp["dg"] == out[3].data_ptr() and p["dbeta"] == cp["dbeta"] == out[4].data_ptr()
        hb, steps, build = bwd.gate_backward_shape(problem.tokens, problem.num_v_heads)
        assert (s["NT"], s["Hv"], s["NP"]) == (problem.tokens, problem.num_v_heads, 1 + steps)
        variant, = [v for n, v, _, _ in launches if n == "gdn_gate_bwd"]
        assert variant == {"mode": build, "hb": hb}
        # the ticket build's words: zeroed by the recompute's gdn_plan, after its tables in the same allocation
        (plan_s, plan_p), = [(s_, p_) for n, _, s_, p_ in launches if n == "gdn_plan"]
        if mode & gates.GATE and build == "ticket":
            blocks = -(-problem.num_v_heads // hb)
            assert s["NB"] == plan_s["Z"] == blocks and p["ticket"] == plan_p["zero"]
            assert plan_p["zero"] == plan_p["seq_order"] + 4 * problem.num_seqs
            assert names.index("gdn_plan") < names.index("gdn_gate_bwd")
        else:
            assert plan_s["Z"] == 0 and s["NB"] == 0
        if mode & gates.GATE:
            assert tuple(out[6].shape) == (2, problem.num_v_heads)


def test_api_routes_the_mode_to_the_kernels(monkeypatch):
    """The kernel path gets the raw g / beta and the KernelGate; the reference gets gates.py's torch pass."""
    seen = {}

    class FakeOps:
        @staticmethod
        def chunk_gated_delta_rule(problem, q, k, v, g, beta, h0, need_final, cu, l2norm, cu_seqlens_cpu=None,
                                   state_io=None, auto_cp=None, gate=gates.NO_GATE):
            seen.update(g=g, beta=beta, gate=gate)
            return torch.zeros_like(v), None

    monkeypatch.setattr(api, "_kernel_ops", lambda: FakeOps)
    monkeypatch.setattr(api, "select_backend", lambda device, backend: "kernels")
    problem, x = _inputs(N=1)
    flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], use_gate_in_kernel=True,
                                     A_log=x["A_log"], dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True,
                                     allow_neg_eigval=True)
    assert seen["g"] is x["g"] and seen["beta"] is x["beta"]
    assert seen["gate"].mode == gates.GATE | gates.GATE_BIAS | gates.BETA_SIGMOID | gates.NEG_EIGVAL
    assert seen["gate"].A_log is x["A_log"] and seen["gate"].dt_bias is x["dt_bias"]
    seen.clear()
    monkeypatch.setattr(api, "select_backend", lambda device, backend: "reference")
    o = flash_qla.chunk_gated_delta_rule(x["q"].float(), x["k"].float(), x["v"].float(), x["g"], x["beta"],
                                         use_gate_in_kernel=True, A_log=x["A_log"], use_beta_sigmoid_in_kernel=True)[0]
    ref = flash_qla.chunk_gated_delta_rule(x["q"].float(), x["k"].float(), x["v"].float(),
                                           gates.gdn_gate(x["g"], x["A_log"]), torch.sigmoid(x["beta"]))[0]
    assert not seen and torch.equal(o, ref)
