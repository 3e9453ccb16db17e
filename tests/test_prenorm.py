"""use_qk_l2norm_in_kernel by a gdn_l2norm pass ahead of the plain kernels (a plan's ``prenorm``), on the CPU: the
planner's choice between it and the l2norm builds, and the launches such a plan makes, each checked against its
cubin's parameter list (the conftest `launches` fixture). tests/test_gpu_forward.py checks what they compute."""
import types

import pytest
import torch

from flash_qla import forward as fwd
from flash_qla import fused_cp, planner
from flash_qla.planner import ForwardPlan
from flash_qla.tuning import override
from flash_qla.validation import validate_inputs


def inputs(lengths, hq, hv, K=128, V=128):
    T = sum(lengths)
    bf16 = torch.bfloat16
    q, k = torch.randn(1, T, hq, K).to(bf16), torch.randn(1, T, hq, K).to(bf16)
    v, g, beta = torch.randn(1, T, hv, V).to(bf16), -torch.rand(1, T, hv), torch.rand(1, T, hv)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return validate_inputs(q, k, v, g, beta, None, None, cu), (q, k, v, g, beta, cu)


def plan_for(lengths, hq, hv, **pins):
    problem, _ = inputs(lengths, hq, hv)
    with override(**pins):
        return fwd.forward_plan(problem, "bf16", torch.device("cpu"), True, False)


@pytest.fixture
def sms(monkeypatch):
    monkeypatch.setattr(fwd, "num_sms", lambda device: 132)


def test_four_v_heads_a_qk_head_take_the_pass_one_does_not(sms):
    """At a GVA ratio of 4 the pass and the plain BV = 128 kernel cost less than the l2norm build (BV = 64, the
    normalising on the aux warpgroup); at a ratio of 1 the pass moves as many bytes as v and does not pay."""
    wide = plan_for([4096] * 8, 16, 64)
    assert wide.prenorm and wide.path == "fused" and wide.block_v == 128, wide
    narrow = plan_for([4096] * 8, 16, 16)
    assert not narrow.prenorm, narrow


def test_the_pin_decides(sms):
    assert plan_for([4096] * 8, 16, 16, prenorm=True).prenorm
    assert not plan_for([4096] * 8, 16, 64, prenorm=False).prenorm
    problem, _ = inputs([4096] * 8, 16, 64)
    plain = fwd.forward_plan(problem, "bf16", torch.device("cpu"), False, False)
    assert not plain.prenorm  # no l2norm: nothing to normalise
    kept = fwd.forward_plan(problem, "bf16", torch.device("cpu"), True, False, allow_prenorm=False)
    assert not kept.prenorm


def test_its_price_is_the_pass_plus_the_plain_plan(sms):
    problem, _ = inputs([4096] * 8, 16, 64)
    with override(prenorm=True):
        pn = fwd.forward_plan(problem, "bf16", torch.device("cpu"), True, False)
    plain = fwd.forward_plan(problem, "bf16", torch.device("cpu"), False, False)
    assert pn.predicted_us == pytest.approx(plain.predicted_us + planner.prenorm_us(8 * 4096, 16, 128))
    assert pn._replace(prenorm=False, predicted_us=0) == plain._replace(predicted_us=0)


def test_launches_of_a_prenorm_forward(launches):
    lengths = [700, 65, 1]
    problem, (q, k, v, g, beta, cu) = inputs(lengths, 2, 8)
    plan = ForwardPlan("fused", 128, None, None, 0.0, prenorm=True)
    o, _, _, _ = fwd.forward(problem, q, k, v, g, beta, None, True, cu, True, plan=plan)
    names = [n for n, _, _, _ in launches]
    assert names == ["gdn_l2norm", "gdn_fwd_fused"], names
    (_, norm, n_sizes, n_ptrs), (_, fused, _, f_ptrs) = launches
    assert norm == {"dtype": "bf16", "K": 128} and n_sizes == {"T": sum(lengths), "Hq": 2}
    assert n_ptrs["q"] == q.data_ptr() and n_ptrs["k"] == k.data_ptr()
    # the plain build reads the normalised rows
    assert fused["l2norm"] == 0 and fused["BV"] == 128
    assert f_ptrs["q"] == n_ptrs["qn"] and f_ptrs["k"] == n_ptrs["kn"]
    assert o.shape == (1, sum(lengths), 8, 128)


@pytest.mark.parametrize("path", ["split", "cp", "cp_fused"])
def test_every_path_runs_plain_after_the_pass(launches, monkeypatch, path):
    monkeypatch.setattr(fused_cp, "launch", fwd.launch)  # the fixture's recorder
    monkeypatch.setattr(fwd, "side_stream", lambda device, name="side": types.SimpleNamespace(cuda_stream=1))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    problem, (q, k, v, g, beta, cu) = inputs([700, 65], 2, 8)
    plan = ForwardPlan(path, 64, 2 if path == "split" else None, 2 if path.startswith("cp") else None, 0.0,
                       prenorm=True)
    fwd.forward(problem, q, k, v, g, beta, None, True, cu, True, plan=plan)
    assert launches[0][0] == "gdn_l2norm"
    qn = launches[0][3]["qn"]
    rest = launches[1:]
    assert all(var.get("l2norm", 0) == 0 for _, var, _, _ in rest)
    assert all(sizes.get("l2norm", 0) == 0 for _, _, sizes, _ in rest)
    readers = [ptrs["q"] for _, _, _, ptrs in rest if "q" in ptrs]
    assert readers and all(p == qn for p in readers)


def test_the_backward_recompute_keeps_the_in_kernel_l2norm(launches):
    """The recompute (``saved``) stores gdn_prepare's row factors for gdn_bwd_chunk: a prenorm plan does not apply
    there."""
    problem, (q, k, v, g, beta, cu) = inputs([700], 2, 8)
    saved = {}
    fwd.forward(problem, q, k, v, g, beta, None, False, cu, True, saved=saved,
                plan=ForwardPlan("split", 64, 2, None, 0.0, prenorm=True))
    names = [n for n, _, _, _ in launches]
    assert "gdn_l2norm" not in names
    prepare = [sizes for n, _, sizes, _ in launches if n == "gdn_prepare"]
    assert prepare and all(s["l2norm"] == 1 for s in prepare)
