"""The kernel backward's math on CPU in float64: emulated chain kernels + the real chunk-parallel stage
(flash_qla.backward._chunk_parallel) against autograd through the reference."""
import pytest
import torch

from flash_qla import api, reference
from flash_qla.backward import _chunk_parallel
from flash_qla.chunk_grads import reverse_chunk_cumsum
from flash_qla.validation import validate_inputs
from gdn_inputs import hard_inputs
from kernel_emulation import emulate_chains

CASES = [
    # lengths, hq, hv, K, V, initial state, dht
    ([1, 130, 63, 64, 65, 2], 1, 2, 64, 64, True, True),
    ([17, 129, 1], 2, 6, 128, 64, True, False),
    ([200], 1, 1, 64, 128, False, True),
    ([3, 64, 128, 1], 2, 2, 64, 64, False, False),
]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


@pytest.mark.parametrize("lengths,hq,hv,K,V,with_h0,with_dht", CASES)
def test_emulated_backward_matches_autograd(lengths, hq, hv, K, V, with_h0, with_dht):
    x = hard_inputs(lengths, hq, hv, K, V, seed=len(lengths) * 7 + K)
    h0 = x["initial_state"] if with_h0 else None
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(x["initial_state"].shape, generator=gen, dtype=torch.float64) if with_dht else None
    cu = x["cu_seqlens"].long()
    problem = validate_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], None, h0, x["cu_seqlens"])

    saved, dv, xx, dhs, dh0 = emulate_chains(x["q"][0], x["k"][0], x["v"][0], x["g"][0], x["beta"][0], h0, cu,
                                             problem.scale, do[0], dht)
    dq, dk, dbeta, dg = _chunk_parallel(problem, saved, do[0], xx, dv, dhs)

    g_cumsum = reference.chunk_local_cumsum(x["g"], x["cu_seqlens"])
    want = api._reference_bwd(problem, x["q"], x["k"], x["v"], g_cumsum, x["beta"], do, dht, h0,
                              x["cu_seqlens"], False)
    wq, wk, wv, wb, wg, wh0 = want
    assert rel(dq, wq[0]) < 1e-9
    assert rel(dk, wk[0]) < 1e-9
    assert rel(dv, wv[0]) < 1e-9
    assert rel(dbeta, wb[0]) < 1e-9
    assert rel(dg, wg[0]) < 1e-9
    if with_h0:
        assert rel(dh0, wh0) < 1e-9


def test_reverse_chunk_cumsum_is_the_adjoint_of_cumsum():
    d = torch.randn(3, 2, 64, dtype=torch.float64)
    g = torch.randn(3, 2, 64, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad((g.cumsum(-1) * d).sum(), g)
    assert torch.allclose(reverse_chunk_cumsum(d), grad)
