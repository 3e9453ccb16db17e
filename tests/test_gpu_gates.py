"""FLA's gate / beta activations fused into the kernels (use_gate_in_kernel, use_beta_sigmoid_in_kernel,
allow_neg_eigval), on the GPU: outputs and every gradient (d raw g, d raw b, dA_log, d dt_bias, dq, dk, dv, dh0)
against the float64 CPU reference of the same keywords (flash_qla/gates.py's torch pass, then the reference), no less
accurate than the same kernels fed the torch pass's activated g / beta; and repeats bit-identical. The hard cases:
strong decay, a zero raw gate (the decay is softplus(dt_bias) alone), beta logits of +-30, 1 / 63 / 64 / 65-token and
varlen sequences, GVA, both intra-card CP plans and none.
"""
import pytest
import torch

import flash_qla
from flash_qla import gates
from flash_qla.tuning import settings

pytestmark = pytest.mark.gpu

LEAVES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def raw_inputs(lengths, hq, hv, seed=0, dtype=torch.bfloat16, K=128, V=128):
    """Raw gate / beta logits (float32) over hard cases; q / k / v in dtype, k unit rows."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(1, T, hq, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, hq, K, generator=gen), dim=-1)
    v = torch.randn(1, T, hv, V, generator=gen)
    g = torch.randn(1, T, hv, generator=gen) * 2
    g[..., 0] = 0.0                                   # a zero raw gate: the decay is softplus(dt_bias) alone
    g[..., -1] = 8.0 + 20 * torch.rand(T, generator=gen)  # strong decay, past softplus's threshold at times
    b = torch.randn(1, T, hv, generator=gen) * 3
    b[..., 1 % hv] = 30.0 * torch.sign(torch.randn(T, generator=gen))  # beta logits of +-30
    A_log = torch.linspace(-2.0, 1.5, hv)             # -exp(A_log): 0.14 to 4.5 per unit of softplus
    dt_bias = torch.randn(hv, generator=gen)
    h0 = torch.randn(len(lengths), hv, K, V, generator=gen) * 0.1
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=b, initial_state=h0, A_log=A_log,
                dt_bias=dt_bias, cu_seqlens=cu)


def run(x, device, fused, neg, with_bias=True, ref=False):
    """o, final state and every gradient. fused: the keywords (the kernels apply the activations); else the torch
    pass computed here (float32 on the GPU, or float64 for ref) and the plain call."""
    dt = torch.float64 if ref else None
    leaves = {n: (x[n].to(device=device, dtype=dt) if dt else x[n].to(device)).clone().requires_grad_()
              for n in LEAVES}
    gen = torch.Generator().manual_seed(99)
    do = torch.randn(x["v"].shape, generator=gen).to(device=device, dtype=dt or x["v"].dtype)
    dht = torch.randn(x["initial_state"].shape, generator=gen).to(device=device, dtype=dt or torch.float32)
    cu = x["cu_seqlens"].to(device)
    bias = leaves["dt_bias"] if with_bias else None
    if fused:
        o, s = flash_qla.chunk_gated_delta_rule(
            leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["initial_state"],
            output_final_state=True, cu_seqlens=cu, use_gate_in_kernel=True, A_log=leaves["A_log"], dt_bias=bias,
            use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)
    else:
        g = gates.gdn_gate(leaves["g"], leaves["A_log"], bias)
        beta = gates.beta_from_logits(leaves["beta"], neg)
        o, s = flash_qla.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], g, beta,
                                                initial_state=leaves["initial_state"], output_final_state=True,
                                                cu_seqlens=cu)
    names = [n for n in LEAVES if with_bias or n != "dt_bias"]
    grads = torch.autograd.grad([o, s], [leaves[n] for n in names], [do, dht])
    return dict(o=o.detach(), ht=s.detach(), **{"d" + n: d for n, d in zip(names, grads)})


CASES = [  # lengths, hq, hv, allow_neg_eigval, dt_bias, CP segment chunks pinned (None: planned; 0: none)
    ([1], 1, 2, False, True, None),
    ([63], 1, 2, True, True, None),
    ([64], 2, 4, False, False, None),
    ([65], 1, 4, True, True, None),
    ([1, 63, 64, 65, 200, 7], 2, 8, True, True, None),    # varlen, GVA
    ([1100, 300], 1, 4, False, True, 4),                   # intra-card CP (forward and the backward's recompute)
    ([1100, 300], 1, 4, True, True, 0),
    # gdn_gate_bwd's tiles build (82 steps) with a partial second block of heads
    ([4500, 700], 2, 40, False, True, None),
    # its ticket build: 29 steps over two head blocks (the last CTA of each sums it); 8 heads, 4 tokens a warp, 32 steps
    ([1500, 300], 2, 40, True, True, None),
    ([6000, 2000], 2, 8, False, True, None),
]


@pytest.mark.parametrize("lengths,hq,hv,neg,with_bias,cp", CASES)
def test_fused_gates_match_the_reference(monkeypatch, lengths, hq, hv, neg, with_bias, cp):
    if cp is not None:
        monkeypatch.setattr(settings, "force_segment_chunks", cp)
    x = raw_inputs(lengths, hq, hv, seed=len(lengths) + sum(lengths))
    dev = torch.device("cuda")
    want = run(x, "cpu", True, neg, with_bias, ref=True)
    fused = run(x, dev, True, neg, with_bias)
    plain = run(x, dev, False, neg, with_bias)
    report, bad = {}, []
    for n, w in want.items():
        ef, ep = rel(fused[n], w), rel(plain[n], w)
        report[n] = f"{ef:.2e}/{ep:.2e}"
        # as accurate as the same kernels on the torch pass's g / beta (bf16 noise); both near the truth. Tensors of a
        # few elements (dA_log, dt_bias's gradient, dbeta of a one-token batch) average no noise away: a looser bar
        bound = 5e-2 if w.numel() < 64 else 2e-2
        if not (ef <= 1.25 * ep + 2e-4 and ef < bound and ep < bound):
            bad.append(n)
    print(lengths, hv, "fused/plain relative L2 to fp64:", report)
    assert not bad, (bad, report)


def test_fused_gates_repeat_bit_identical():
    x = raw_inputs([1, 63, 64, 65, 700, 3000], 2, 8, seed=7)
    dev = torch.device("cuda")
    first = run(x, dev, True, True)
    for _ in range(3):
        again = run(x, dev, True, True)
        for n in first:
            assert torch.equal(first[n], again[n]), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_raw_gate_and_logits(dtype):
    """A bf16 / fp16 raw g and beta logits (FLA accepts them): gradients come back in their dtypes, values as the
    float32 inputs rounded the same way give."""
    x = raw_inputs([130, 60], 1, 4, seed=3, dtype=dtype)
    dev = torch.device("cuda")
    half = dict(x, g=x["g"].to(dtype), beta=x["beta"].to(dtype), A_log=x["A_log"].to(dtype))
    up = dict(half, g=half["g"].float(), beta=half["beta"].float(), A_log=half["A_log"].float())
    a, b = run(half, dev, True, False), run(up, dev, True, False)
    assert a["dg"].dtype == dtype and a["dbeta"].dtype == dtype and a["dA_log"].dtype == dtype
    for n in a:
        assert rel(a[n], b[n].to(a[n].dtype)) < 1e-2, n
