"""The two reference formulations agree in float64 on hard inputs."""
import pytest
import torch

from flash_qla import reference
from gdn_inputs import hard_inputs

CASES = [
    # lengths, hq, hv, K, V
    ([1, 63, 64, 65], 2, 4, 16, 8),
    ([130], 1, 3, 8, 16),
    ([1] * 9 + [2, 3, 5, 7, 11], 1, 2, 8, 8),      # many tiny sequences in one batch
    ([64, 0, 128, 1], 2, 2, 32, 16),               # an empty sequence in the middle
    ([200, 17], 3, 6, 16, 32),
]


@pytest.mark.parametrize("lengths,hq,hv,K,V", CASES)
@pytest.mark.parametrize("l2norm", [False, True])
def test_chunked_matches_recurrent_fp64(lengths, hq, hv, K, V, l2norm):
    x = hard_inputs(lengths, hq, hv, K, V, seed=len(lengths) + K)
    o1, s1 = reference.recurrent_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    o2, s2 = reference.chunked_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    assert reference.relative_l2(o2, o1) < 1e-10
    assert reference.relative_l2(s2, s1) < 1e-10


def test_dense_batch_equals_packed_varlen():
    x = hard_inputs([50, 50], 1, 2, 8, 8, seed=3)
    packed = reference.chunked_gated_delta_rule(**x, output_final_state=True)
    dense = {n: x[n].reshape(2, 50, *x[n].shape[2:]) for n in ("q", "k", "v", "g", "beta")}
    o, s = reference.chunked_gated_delta_rule(**dense, initial_state=x["initial_state"], output_final_state=True)
    assert reference.relative_l2(o.reshape(packed[0].shape), packed[0]) < 1e-12
    assert reference.relative_l2(s, packed[1]) < 1e-12


def test_chunk_size_is_a_free_parameter():
    x = hard_inputs([100], 1, 2, 8, 8, seed=5)
    o64, _ = reference.chunked_gated_delta_rule(**x)
    o16, _ = reference.chunked_gated_delta_rule(**x, chunk_size=16)
    assert reference.relative_l2(o16, o64) < 1e-10


def test_cumsum_roundtrip_and_inverse_is_unit_lower():
    x = hard_inputs([70, 5], 1, 2, 8, 8, seed=7)
    gc = reference.chunk_local_cumsum(x["g"], x["cu_seqlens"])
    assert torch.allclose(reference.chunk_local_diff(gc, x["cu_seqlens"]), x["g"], atol=1e-12)
    assert torch.allclose(gc[0, 64], x["g"][0, 64])               # chunk restart at token 64
    assert torch.allclose(gc[0, 70], x["g"][0, 70])               # sequence restart
    A = reference.gate_free_inverse(x["k"], x["beta"], x["cu_seqlens"])
    assert A.shape == (1, 75, 2, 64)
    assert torch.allclose(A[0, 0:64, :, :64].diagonal(dim1=0, dim2=2), torch.ones(2, 64, dtype=A.dtype))


def test_zero_decay_zero_beta_keeps_state():
    x = hard_inputs([40], 1, 1, 4, 4, seed=9)
    x["g"].zero_()
    x["beta"].zero_()
    _, s = reference.chunked_gated_delta_rule(**x, output_final_state=True)
    assert torch.allclose(s, x["initial_state"])
