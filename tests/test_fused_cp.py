"""Intra-card CP on the fused kernel (flash_qla/fused_cp.py), on the CPU: the launches a forward on a "cp_fused" plan
makes, each checked against its cubin's parameter list in the manifest (the conftest `launches` fixture).
tests/test_gpu_cp.py checks what the kernels compute; tests/test_plan_fit.py the planner's fit of it."""
import types

import pytest
import torch

from flash_qla import forward as fwd
from flash_qla import fused_cp
from flash_qla.planner import ForwardPlan
from flash_qla.validation import validate_inputs


def run(launches, monkeypatch, lengths, hq, hv, K, V, L, h0, l2norm=False, final=True):
    monkeypatch.setattr(fused_cp, "launch", fwd.launch)  # the fixture's recorder
    monkeypatch.setattr(fwd, "side_stream", lambda device, name="side": types.SimpleNamespace(cuda_stream=1))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    T = sum(lengths)
    bf16 = torch.bfloat16
    q, k = torch.randn(1, T, hq, K).to(bf16), torch.randn(1, T, hq, K).to(bf16)
    v, g, beta = torch.randn(1, T, hv, V).to(bf16), -torch.rand(1, T, hv), torch.rand(1, T, hv)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    init = torch.randn(len(lengths), hv, K, V) if h0 else None
    problem = validate_inputs(q, k, v, g, beta, None, init, cu)
    plan = ForwardPlan("cp_fused", 128 if V >= 128 else 64, None, L, 0.0)
    o, ht, A, _ = fwd.forward(problem, q, k, v, g, beta, init, final, cu, l2norm, plan=plan)
    return problem, o, ht, A


@pytest.mark.parametrize("K,V", [(128, 128), (64, 256)])
@pytest.mark.parametrize("h0", [True, False])
def test_launches_of_a_fused_cp_forward(launches, monkeypatch, K, V, h0):
    lengths = [700, 65, 1]
    problem, o, ht, A = run(launches, monkeypatch, lengths, 2, 4, K, V, 2, h0)
    names = [n for n, _, _, _ in launches]
    assert names == ["gdn_plan", "gdn_cp_scan", "gdn_cp_plan", "gdn_fwd_fused", "gdn_fwd_fused", "gdn_cp_combine",
                     "gdn_fwd_fused"], names
    (_, state, s_sizes, s_ptrs), (_, trans, t_sizes, _), (_, out, o_sizes, o_ptrs) = (
        launches[3], launches[4], launches[6])
    # the pre-pass builds: one V block of 64, trans at V = K from the identity; both over the S segment rows
    assert (state["mode"], state["BV"], state["V"], state["order"]) == ("state", 64, V, 0)
    assert (trans["mode"], trans["BV"], trans["V"]) == ("trans", 64, K)
    S = s_sizes["N"]
    assert S == t_sizes["N"] == o_sizes["N"] > len(lengths) and s_sizes["use_h0"] == 0
    # the out pass: the planned block, from the combine's h_in (the state build's output), no pool
    assert (out["mode"], out["BV"]) == ("out", 128 if V >= 128 else 64)
    assert o_sizes["use_h0"] == 1 and o_sizes["state_mode"] == 0 and o_ptrs["h0"] == s_ptrs["ht"]
    assert o.shape == (1, sum(lengths), 4, V) and A is None
    assert isinstance(ht, fwd.SegmentStates) and ht.count == S  # picked per sequence by the API (gdn_state_pick)


def test_a_fused_cp_forward_without_final_state_stores_none(launches, monkeypatch):
    _, _, ht, _ = run(launches, monkeypatch, [640, 64], 2, 4, 128, 128, 3, True, final=False)
    assert ht.numel() == 0
    (_, _, o_sizes, _), = [x for x in launches if x[0] == "gdn_fwd_fused" and x[1]["mode"] == "out"]
    assert o_sizes["store_ht"] == 0


def test_plans_that_need_the_split_kernels_fall_back_to_them(launches, monkeypatch):
    """A forward that returns the gate-free inverse (A) reads gdn_prepare's outputs: a cp_fused plan runs the split CP
    on its segment length there."""
    monkeypatch.setattr(fwd, "side_stream", lambda device, name="side": types.SimpleNamespace(cuda_stream=1))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    T, hq, hv, K = 700, 2, 4, 128
    q, k = torch.randn(1, T, hq, K).bfloat16(), torch.randn(1, T, hq, K).bfloat16()
    v, g, beta = torch.randn(1, T, hv, K).bfloat16(), -torch.rand(1, T, hv), torch.rand(1, T, hv)
    cu = torch.tensor([0, T], dtype=torch.int32)
    problem = validate_inputs(q, k, v, g, beta, None, None, cu)
    fwd.forward(problem, q, k, v, g, beta, None, True, cu, False, want_gate_free_inverse=True,
                plan=ForwardPlan("cp_fused", 128, None, 2, 0.0))
    names = [n for n, _, _, _ in launches]
    assert "gdn_prepare" in names and "gdn_cp_scan" not in names and "gdn_fwd_fused" not in names
