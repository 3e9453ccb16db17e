"""Every malformed argument is rejected with a message naming it."""
import pytest
import torch

import flash_qla
from flash_qla.validation import validate_kernel_inputs, validate_inputs


def args(B=1, T=10, hq=2, hv=4, K=8, V=8, dtype=torch.float32):
    return dict(q=torch.randn(B, T, hq, K, dtype=dtype), k=torch.randn(B, T, hq, K, dtype=dtype),
                v=torch.randn(B, T, hv, V, dtype=dtype), g=-torch.rand(B, T, hv), beta=torch.rand(B, T, hv))


def call(**kw):
    return flash_qla.chunk_gated_delta_rule(**kw)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: a.update(q=a["q"][0]), ValueError, r"q must have 4 dims"),
    (lambda a: a.update(k=a["k"][..., :4]), ValueError, r"k must have the shape of q"),
    (lambda a: a.update(v=torch.randn(1, 9, 4, 8)), ValueError, r"v must share q's batch and token dims"),
    (lambda a: a.update(g=a["g"][..., :3]), ValueError, r"g must have shape \[B, T, Hv\]"),
    (lambda a: a.update(beta=a["beta"][:, :5]), ValueError, r"beta must have shape \[B, T, Hv\]"),
    (lambda a: a.update(v=torch.randn(1, 10, 3, 8)), ValueError, r"Hv = 3 .* multiple of .* Hq = 2"),
    (lambda a: a.update(v=a["v"].double()), TypeError, r"q, k and v must share one dtype"),
    (lambda a: a.update(g=a["g"].int()), TypeError, r"g must be a floating tensor"),
    (lambda a: a.update(q="nope"), TypeError, r"q must be a torch.Tensor"),
    (lambda a: a.update(scale=float("nan")), ValueError, r"scale must be a finite float"),
    (lambda a: a.update(scale="1"), ValueError, r"scale must be a finite float"),
    (lambda a: a.update(initial_state=torch.zeros(1, 4, 8, 7)), ValueError, r"initial_state must have shape \[N, Hv, K, V\]"),
    (lambda a: a.update(initial_state=torch.zeros(4, 8, 8)), ValueError, r"initial_state must have 4 dims"),
    (lambda a: a.update(backend="triton"), ValueError, r"backend must be one of"),
    (lambda a: a.update(backend="kernels"), ValueError, r"backend='kernels' needs CUDA tensors"),
])
def test_bad_arguments(mutate, exc, match):
    a = args()
    mutate(a)
    with pytest.raises(exc, match=match):
        call(**a)


@pytest.mark.parametrize("cu,exc,match", [
    (torch.tensor([0, 4, 10], dtype=torch.float32), TypeError, r"cu_seqlens must have dtype int32 or int64"),
    (torch.tensor([[0, 10]]), ValueError, r"cu_seqlens must be 1-D"),
    (torch.tensor([0]), ValueError, r"cu_seqlens must be 1-D with N\+1 >= 2"),
    (torch.tensor([1, 4, 10]), ValueError, r"cu_seqlens must start at 0"),
    (torch.tensor([0, 6, 4, 10]), ValueError, r"non-decreasing.*cu_seqlens\[2\] = 4 < cu_seqlens\[1\] = 6"),
    (torch.tensor([0, 4, 9]), ValueError, r"cu_seqlens must end at the token count T = 10"),
    ([0, 10], TypeError, r"cu_seqlens must be a 1-D int32/int64 torch.Tensor"),
])
def test_bad_cu_seqlens(cu, exc, match):
    with pytest.raises(exc, match=match):
        call(**args(), cu_seqlens=cu)


def test_cu_seqlens_needs_batch_one():
    with pytest.raises(ValueError, match=r"batch size B == 1, got B = 2"):
        call(**args(B=2), cu_seqlens=torch.tensor([0, 10]))


def test_initial_state_count_follows_cu_seqlens():
    with pytest.raises(ValueError, match=r"\(3, 4, 8, 8\).*len\(cu_seqlens\) - 1"):
        call(**args(), cu_seqlens=torch.tensor([0, 3, 6, 10]), initial_state=torch.zeros(2, 4, 8, 8))


def test_kernel_rules_list_supported_head_dims():
    a = args(dtype=torch.bfloat16, K=96, V=96)
    p = validate_inputs(**a)
    with pytest.raises(ValueError, match=r"\(K=96, V=96\) are not built.*\(K=64, V=64\), \(K=128, V=128\)"):
        validate_kernel_inputs(p, a["q"], a["g"], a["beta"], None, {(128, 128), (64, 64)})
    a32 = args()
    with pytest.raises(TypeError, match=r"bfloat16 or float16"):
        validate_kernel_inputs(validate_inputs(**a32), a32["q"], a32["g"], a32["beta"], None, {(8, 8)})
    with pytest.raises(TypeError, match=r"g must be float32"):
        validate_kernel_inputs(p, a["q"], a["g"].double(), a["beta"], None, {(96, 96)})
    with pytest.raises(TypeError, match=r"initial_state must be float32"):
        validate_kernel_inputs(p, a["q"], a["g"], a["beta"], torch.zeros(1, 4, 96, 96, dtype=torch.float64),
                               {(96, 96)})


def test_meta_device_is_rejected_with_a_hint():
    a = {n: t.to("meta") for n, t in args().items()}
    with pytest.raises(ValueError, match=r"device meta.*backend='reference'"):
        call(**a)


def test_bwd_checks_do_and_dht_shapes():
    a = args()
    with pytest.raises(ValueError, match=r"do must have v's shape"):
        flash_qla.chunk_gated_delta_rule_bwd(**a, A=None, do=torch.zeros(1, 10, 4, 7))
    with pytest.raises(ValueError, match=r"dht must have shape \[N, Hv, K, V\]"):
        flash_qla.chunk_gated_delta_rule_bwd(**a, A=None, do=torch.zeros_like(a["v"]), dht=torch.zeros(1, 4, 8, 9))


def test_bwd_checks_the_gate_free_inverse():
    a = args()
    B, T, Hv = a["v"].shape[:3]
    do = torch.zeros_like(a["v"])
    with pytest.raises(ValueError, match=r"A must have shape \[B, T, Hv, 64\]"):
        flash_qla.chunk_gated_delta_rule_bwd(**a, A=torch.zeros(B, T, Hv, 32), do=do)
    with pytest.raises(ValueError, match=r"A must have q's dtype"):
        flash_qla.chunk_gated_delta_rule_bwd(**a, A=torch.zeros(B, T, Hv, 64, dtype=torch.float64), do=do)
    with pytest.raises(TypeError, match=r"A must be a tensor"):
        flash_qla.chunk_gated_delta_rule_bwd(**a, A="A", do=do)


def test_a_validated_signature_is_remembered_but_host_cu_seqlens_values_are_checked_every_time():
    import torch
    from flash_qla.validation import validate_inputs
    q = torch.zeros(1, 10, 1, 4)
    v, g = torch.zeros(1, 10, 1, 4), torch.zeros(1, 10, 1)
    good, bad = torch.tensor([0, 4, 10]), torch.tensor([0, 6, 4])
    assert validate_inputs(q, q, v, g, g, cu_seqlens=good).num_seqs == 2
    with pytest.raises(ValueError, match="non-decreasing"):
        validate_inputs(q, q, v, g, g, cu_seqlens=bad)  # same signature, other values
    assert validate_inputs(q, q, v, g, g, scale=1).scale == 1.0
    with pytest.raises(ValueError, match="scale"):
        validate_inputs(q, q, v, g, g, scale=True)  # equal to 1 and hashed alike, but a bool
