"""dg under extreme decay (g of -30 to -70 per token, FLA's test_gdn case with gate_logit_normalizer 0.01): the
chunk stage's specification (flash_qla.chunk_grads, whose structure gdn_bwd_chunk follows) in float32 must stay
accurate relative to dg itself, which is ~1e-15 there while the products dgamma sums are O(1).

A factor that is exactly 1 (Gamma's diagonal, the last row's et) has no gamma term; summing its product into a row
sum and subtracting it from a column sum cancels it only up to float32 rounding, an absolute error of ~1e-14 here
(~1e-6 in the kernel, whose sums run in other orders): relative error ~1. The float64 truth is autograd through the
token-by-token recurrence, whose dg has no such cancellation."""
import torch
import torch.nn.functional as F

from flash_qla import reference
from flash_qla.backward import _chunk_parallel
from flash_qla.validation import validate_inputs
from kernel_emulation import emulate_chains


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_float32_chunk_stage_dg_is_accurate_under_extreme_decay():
    gen = torch.Generator().manual_seed(42)
    T, H, D = 75, 2, 64  # two chunks, the second partial
    f64 = dict(generator=gen, dtype=torch.float64)
    q = F.normalize(torch.rand(1, T, H, D, **f64), dim=-1)
    k = F.normalize(torch.rand(1, T, H, D, **f64), dim=-1)
    v = torch.rand(1, T, H, D, **f64)
    beta = torch.rand(1, T, H, **f64).sigmoid()
    g = F.logsigmoid(torch.rand(1, T, H, **f64)) / 0.01
    do, dht = torch.randn(1, T, H, D, **f64), torch.randn(1, H, D, D, **f64)
    cu = torch.tensor([0, T], dtype=torch.int32)
    problem = validate_inputs(q, k, v, g, beta, 1.0, None, cu)

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    o, ht = reference.recurrent_gated_delta_rule(*leaves, scale=1.0, output_final_state=True, cu_seqlens=cu)
    truth = torch.autograd.grad([o, ht], leaves, [do, dht])

    saved, dv, x, dhs, _ = emulate_chains(q[0], k[0], v[0], g[0], beta[0], None, cu.long(), 1.0, do[0], dht)
    f32 = {n: t.float() if torch.is_tensor(t) and t.is_floating_point() else t for n, t in saved.items()}
    dq, dk, dbeta, dg = _chunk_parallel(problem, f32, do[0].float(), x.float(), dv.float(), dhs.float())
    assert truth[3].abs().max() < 1e-12  # the regime: dg is tiny next to the O(1) products
    assert rel(dg, truth[3][0]) < 1e-3   # was ~1 with the exact-1 factors summed and cancelled
    for got, want in ((dq, truth[0]), (dk, truth[1]), (dbeta, truth[4])):
        assert rel(got, want[0]) < 1e-5
