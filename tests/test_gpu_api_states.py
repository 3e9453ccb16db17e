"""The public API routes the caller's state layout, pool and in-place writes to the kernels' own state I/O
(flash_qla.api._native_state_call): the results match, bit for bit, the same call with torch's gather / transpose /
scatter passes around a plain kernel call, and the pool's untouched slots stay as they were."""
import pytest
import torch

import flash_qla
from flash_qla import api, plans
from flash_qla.tuning import override
from test_gpu_forward import draw

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

LENGTHS = [1, 63, 64, 65, 130, 7, 200]
PATHS = {"fused": dict(use_fused=True, force_segment_chunks=0), "split": dict(use_fused=False, force_segment_chunks=0)}


def torch_passes(monkeypatch):
    monkeypatch.setattr(api, "_native_state_call", lambda *a, **kw: None)


def pool_case(v_first, seed=1):
    x = draw(LENGTHS, 2, 4, 128, 128, torch.bfloat16, seed=seed)
    N, Hv = len(LENGTHS), 4
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pool = torch.randn(3 * N, Hv, 128, 128, device="cuda", generator=gen)
    idx = torch.randperm(3 * N, device="cuda", generator=gen)[:N].to(torch.int32)
    idx[2] = -1  # padding: starts from zero, writes nothing
    return x, pool, idx


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("v_first", [False, True])
def test_pool_in_place_matches_the_torch_passes(path, v_first, monkeypatch):
    x, pool, idx = pool_case(v_first)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(cu_seqlens=x["cu_seqlens"], initial_state_indices=idx, inplace_update=True, state_v_first=v_first)
    with override(**PATHS[path]), torch.no_grad():
        native_pool = pool.clone()
        plans.clear()
        o, _ = flash_qla.chunk_gated_delta_rule(*args, initial_state=native_pool, **kw)
        stats = plans.stats()
        with monkeypatch.context() as m:
            torch_passes(m)
            torch_pool = pool.clone()
            o_ref, _ = flash_qla.chunk_gated_delta_rule(*args, initial_state=torch_pool, **kw)
    assert stats.get("recorded") == 1, stats  # the native call ran the kernels' plan
    assert torch.equal(o, o_ref)
    assert torch.equal(native_pool, torch_pool)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device="cuda")
    untouched[idx[idx >= 0].long()] = False
    assert torch.equal(native_pool[untouched], pool[untouched])


@pytest.mark.parametrize("v_first", [False, True])
def test_output_state_by_slot_matches_the_torch_passes(v_first, monkeypatch):
    """FlashInfer's spelling: state_indices with output_state (a second pool); the result is output_state itself."""
    x, pool, idx = pool_case(v_first, seed=2)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with torch.no_grad():
        out = torch.zeros_like(pool)
        o, final = flash_qla.chunk_gated_delta_rule(*args, initial_state=pool, cu_seqlens=x["cu_seqlens"],
                                                    state_indices=idx, output_state=out, output_final_state=True,
                                                    state_v_first=v_first)
        with monkeypatch.context() as m:
            torch_passes(m)
            out_ref = torch.zeros_like(pool)
            o_ref, _ = flash_qla.chunk_gated_delta_rule(*args, initial_state=pool, cu_seqlens=x["cu_seqlens"],
                                                        state_indices=idx, output_state=out_ref,
                                                        output_final_state=True, state_v_first=v_first)
    assert final is out
    assert torch.equal(o, o_ref) and torch.equal(out, out_ref)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_v_first_with_gradients_matches_the_torch_passes(path, monkeypatch):
    x = draw(LENGTHS, 2, 4, 128, 128, torch.bfloat16, seed=3)
    h0 = x["initial_state"].transpose(-1, -2).contiguous()  # [N, Hv, V, K]
    gen = torch.Generator(device="cuda").manual_seed(4)

    def run():
        leaves = [t.detach().clone().requires_grad_(True) for t in (x["q"], x["k"], x["v"], x["g"], x["beta"], h0)]
        o, ht = flash_qla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], cu_seqlens=x["cu_seqlens"],
                                                 output_final_state=True, state_v_first=True)
        do = torch.randn(o.shape, device="cuda", generator=gen.manual_seed(4)).to(o.dtype)
        dht = torch.randn(ht.shape, device="cuda", generator=gen.manual_seed(5))
        torch.autograd.backward([o, ht], [do, dht])
        return [o, ht] + [t.grad for t in leaves]

    with override(**PATHS[path]):
        got = run()
        with monkeypatch.context() as m:
            torch_passes(m)
            want = run()
    assert got[1].shape == h0.shape and got[-1].shape == h0.shape
    for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert torch.equal(a, b), name


def test_a_cp_plan_keeps_the_torch_passes(monkeypatch):
    """Intra-card CP works in [.., K, V]: a pool call whose forward plans CP takes the torch passes, with the same
    results as a plain call on the gathered states."""
    x = draw([8192], 2, 8, 128, 128, torch.bfloat16, seed=5)
    pool = torch.randn(4, 8, 128, 128, device="cuda")
    idx = torch.tensor([2], dtype=torch.int32, device="cuda")
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with torch.no_grad():
        written = pool.clone()
        o, _ = flash_qla.chunk_gated_delta_rule(*args, initial_state=written, cu_seqlens=x["cu_seqlens"],
                                                initial_state_indices=idx, inplace_update=True)
        o_ref, ht_ref = flash_qla.chunk_gated_delta_rule(*args, initial_state=pool[2:3].clone(),
                                                         cu_seqlens=x["cu_seqlens"], output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(written[2:3], ht_ref)
    assert torch.equal(written[[0, 1, 3]], pool[[0, 1, 3]])
