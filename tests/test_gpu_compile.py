"""torch.compile through the kernel path: the custom ops (flash_qla.torch_ops) trace as one node (GPU only)."""
import pytest
import torch

import flash_qla
from flash_qla import reference, torch_ops
from test_gpu_forward import LENGTHS, draw

pytestmark = pytest.mark.gpu


def loss_and_grads(fn, x):
    leaves = {n: x[n].detach().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "initial_state")}
    o, ht = fn(**leaves, cu_seqlens=x["cu_seqlens"])
    loss = (o.float() ** 2).sum() + ht.sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return o, ht, grads


def api(**kw):
    return flash_qla.chunk_gated_delta_rule(**kw, output_final_state=True)


def test_compiled_fullgraph_matches_eager_forward_and_backward():
    x = draw(LENGTHS["mixed"], 2, 4, 128, 128, torch.bfloat16, seed=31)
    o_e, ht_e, g_e = loss_and_grads(api, x)
    compiled = torch.compile(api, fullgraph=True, backend="aot_eager")
    o_c, ht_c, g_c = loss_and_grads(compiled, x)
    assert torch.equal(o_c, o_e) and torch.equal(ht_c, ht_e)
    for a, b in zip(g_c, g_e):
        assert reference.relative_l2(a, b) < 1e-6


def test_custom_op_passes_opcheck():
    x = draw([70, 1, 64], 1, 2, 64, 64, torch.bfloat16, seed=33)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], x["cu_seqlens"], 0.125, True, False)
    torch.library.opcheck(torch_ops.chunk_gdr_fwd, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
