"""The public API on CPU against an independent float64 token loop, forward and backward."""
import pytest
import torch

import flash_qla
from gdn_inputs import hard_inputs


def token_loop(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """An independent float64 GDN recurrence (one head at a time, no shared code with the library)."""
    hq, hv = q.shape[2], v.shape[2]
    cu = cu_seqlens.tolist()
    outs, finals = [], []
    for n in range(len(cu) - 1):
        o_seq, s_seq = [], []
        for h in range(hv):
            S = initial_state[n, h]
            rows = []
            for t in range(cu[n], cu[n + 1]):
                kt, qt = k[0, t, h * hq // hv], q[0, t, h * hq // hv]
                S = torch.exp(g[0, t, h]) * S
                S = S + torch.outer(kt, beta[0, t, h] * (v[0, t, h] - kt @ S))
                rows.append(S.T @ (scale * qt))
            o_seq.append(torch.stack(rows) if rows else v.new_zeros(0, v.shape[3]))
            s_seq.append(S)
        outs.append(torch.stack(o_seq, dim=1))
        finals.append(torch.stack(s_seq))
    return torch.cat(outs)[None], torch.stack(finals)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


HARD = [
    # lengths, hq, hv, K, V
    ([1, 130, 63, 64, 65, 2], 1, 2, 64, 64),
    ([17, 129, 1], 2, 6, 128, 64),
    ([100, 3], 1, 3, 64, 128),
    ([1, 2, 33, 128], 1, 2, 128, 128),
]


@pytest.mark.parametrize("lengths,hq,hv,K,V", HARD)
def test_api_matches_token_loop_fwd_bwd_fp32(lengths, hq, hv, K, V):
    x64 = hard_inputs(lengths, hq, hv, K, V, seed=sum(lengths) + K + V)
    scale = K ** -0.5
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(x64["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(x64["initial_state"].shape, generator=gen, dtype=torch.float64)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    ref_in = {n: x64[n].clone().requires_grad_() for n in names}
    o_ref, s_ref = token_loop(**ref_in, scale=scale, cu_seqlens=x64["cu_seqlens"])
    ref_grads = torch.autograd.grad([o_ref, s_ref], [ref_in[n] for n in names], [do, dht])

    got_in = {n: x64[n].float().requires_grad_() for n in names}
    o, s = flash_qla.chunk_gated_delta_rule(**got_in, scale=scale, output_final_state=True,
                                            cu_seqlens=x64["cu_seqlens"])
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    got_grads = torch.autograd.grad([o, s], [got_in[n] for n in names], [do.float(), dht.float()])
    assert rel(o, o_ref) < 1e-3
    assert rel(s, s_ref) < 1e-3
    for n, a, b in zip(names, got_grads, ref_grads):
        assert rel(a, b) < 1e-3, n


def test_gradcheck_fp64_varlen_gva():
    x = hard_inputs([66, 5], 1, 2, 4, 3, seed=11, strong_decay=False)
    x = {n: (t.requires_grad_() if n != "cu_seqlens" else t) for n, t in x.items()}
    cu = x.pop("cu_seqlens")

    def f(q, k, v, g, beta, initial_state):
        return flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                output_final_state=True, cu_seqlens=cu)
    assert torch.autograd.gradcheck(f, tuple(x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")))


def test_gradcheck_fp64_l2norm_dense():
    torch.manual_seed(0)
    q, k = (torch.randn(2, 9, 1, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 9, 1, 3, dtype=torch.float64, requires_grad=True)
    g = (-torch.rand(2, 9, 1, dtype=torch.float64)).requires_grad_()
    beta = torch.rand(2, 9, 1, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, g, beta):
        return flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    assert torch.autograd.gradcheck(f, (q, k, v, g, beta))


def test_low_level_fwd_bwd_match_autograd():
    x = hard_inputs([70, 9], 1, 2, 8, 8, seed=13)
    cu = x.pop("cu_seqlens")
    g_cumsum, A, o, h, final = flash_qla.chunk_gated_delta_rule_fwd(**x, cu_seqlens=cu)
    assert h is None and A.shape == (1, 79, 2, 64) and g_cumsum.shape == x["g"].shape
    do = torch.randn_like(o)
    dht = torch.randn_like(final)
    grads = flash_qla.chunk_gated_delta_rule_bwd(x["q"], x["k"], x["v"], g_cumsum, x["beta"], A, do, dht,
                                                 initial_state=x["initial_state"], cu_seqlens=cu)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o2, s2 = flash_qla.chunk_gated_delta_rule(**leaves, output_final_state=True, cu_seqlens=cu)
    assert torch.allclose(o, o2)
    want = torch.autograd.grad([o2, s2], [leaves[n] for n in ("q", "k", "v", "beta", "g", "initial_state")],
                               [do, dht])
    for a, b in zip(grads, want):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-9)


def test_bf16_inputs_compute_in_fp32_and_return_input_dtype():
    x = hard_inputs([20], 1, 1, 8, 8, seed=2)
    o, s = flash_qla.chunk_gated_delta_rule(x["q"].bfloat16(), x["k"].bfloat16(), x["v"].bfloat16(),
                                            x["g"].float(), x["beta"].float(), output_final_state=True,
                                            cu_seqlens=x["cu_seqlens"])
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
