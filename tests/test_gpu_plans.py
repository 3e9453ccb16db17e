"""Plans on the GPU (flash_qla/plans.py): every kernel path, recorded once and replayed with one launcher crossing,
gives bit-identical results to the same call run as written, and the standard paths do replay."""
import pytest
import torch

import flash_qla
from flash_qla import plans
from flash_qla.tuning import override
from test_gpu_forward import LENGTHS, draw

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

PATHS = {  # name: tuning that pins the path
    "fused": dict(use_fused=True, force_segment_chunks=0),
    "split": dict(use_fused=False, force_segment_chunks=0),
    "cp": dict(force_segment_chunks=2, cp_fused=False),
    "cp_fused": dict(force_segment_chunks=2, cp_fused=True),
}


def _grads(x, l2norm):
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "initial_state")}
    o, ht = flash_qla.chunk_gated_delta_rule(**leaves, cu_seqlens=x["cu_seqlens"], output_final_state=True,
                                             use_qk_l2norm_in_kernel=l2norm)
    gen = torch.Generator(device="cuda").manual_seed(5)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, device="cuda", generator=gen)
    torch.autograd.backward([o, ht], [do, dht])
    return [o, ht] + [leaves[n].grad for n in ("q", "k", "v", "g", "beta", "initial_state")]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("l2norm", [False, True])
def test_replayed_plans_match_calls_run_as_written(path, l2norm):
    x = draw(LENGTHS["mixed"] + LENGTHS["tiny"], 2, 4, 128, 128, torch.bfloat16, seed=3)
    with override(replay=False, **PATHS[path]):
        want = _grads(x, l2norm)
    with override(**PATHS[path]):
        plans.clear()
        first = _grads(x, l2norm)  # recorded
        again = [_grads(x, l2norm) for _ in range(3)]  # replayed
        stats = plans.stats()
    assert stats.get("recorded") == 2 and stats.get("replayed") == 6, stats  # forward and backward plans
    assert not stats.get("unreplayable") and not stats.get("as_written"), stats
    for got in [first] + again:
        for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
            assert torch.equal(a, b), (path, l2norm, name)


def test_low_level_fwd_and_bwd_replay_and_dense_batches():
    x = draw([200, 200, 200], 2, 4, 64, 128, torch.float16, seed=4)
    dense = {n: (t.view(3, 200, *t.shape[2:]) if n not in ("initial_state", "cu_seqlens") else t)
             for n, t in x.items() if n != "cu_seqlens"}
    plans.clear()
    outs = []
    for _ in range(3):
        g_cumsum, A, o, _, ht = flash_qla.chunk_gated_delta_rule_fwd(**dense, output_final_state=True)
        grads = flash_qla.chunk_gated_delta_rule_bwd(dense["q"], dense["k"], dense["v"], g_cumsum, dense["beta"], A,
                                                     torch.ones_like(o), dht=torch.ones_like(ht),
                                                     initial_state=dense["initial_state"])
        outs.append([g_cumsum, A, o, ht, *grads])
    stats = plans.stats()
    assert stats.get("replayed") == 4 and not stats.get("unreplayable"), stats
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))



def test_a_workspace_above_the_cap_runs_as_written():
    """A recording whose workspace exceeds tuning.plan_workspace_max is kept as unreplayable: later calls run as
    written (the caching allocator reuses their freed temporaries), with the same bits."""
    x = draw(LENGTHS["mixed"], 2, 4, 128, 128, torch.bfloat16, seed=9)
    with override(replay=False):
        want = _grads(x, False)
    with override(plan_workspace_max=0):
        plans.clear()
        got = [_grads(x, False) for _ in range(2)]
        stats = plans.stats()
    # two signatures (forward, backward): each recorded once, then replayed or run as written; the backward has
    # temporaries, so at least it is above a zero cap (a forward with no temporaries has nothing to cap)
    assert stats.get("recorded", 0) + stats.get("unreplayable", 0) == 2, stats
    assert stats.get("replayed", 0) + stats.get("as_written", 0) == 2, stats
    assert stats.get("unreplayable", 0) >= 1 and stats.get("as_written") == stats["unreplayable"], stats
    assert any("plan_workspace_max" in r for r in stats["reasons"]), stats
    for g in got:
        assert all(torch.equal(a, b) for a, b in zip(g, want))


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("beta_dtype", [torch.float32, torch.bfloat16])
def test_fast_lane_matches_the_full_path(path, beta_dtype):
    """A repeated plain call (flash_qla.api's fast lane: no re-validation, straight to the plan) gives the full
    path's bits, with and without an initial state, and replays its plan."""
    from flash_qla import api
    x = draw(LENGTHS["mixed"] + LENGTHS["tiny"], 2, 4, 128, 128, torch.bfloat16, seed=6)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"].to(beta_dtype))
    with override(**PATHS[path]), torch.no_grad():
        for h0 in (x["initial_state"], None):
            kw = dict(cu_seqlens=x["cu_seqlens"], initial_state=h0, output_final_state=True)
            api._FAST.clear()
            want = flash_qla.chunk_gated_delta_rule(*args, **kw)  # the full path, which registers the signature
            assert len(api._FAST) == 1
            plans.clear()
            for _ in range(3):
                got = flash_qla.chunk_gated_delta_rule(*args, **kw)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (path, h0 is None)
            stats = plans.stats()
            assert stats.get("recorded") == 1 and stats.get("replayed") == 2, stats


PINS = {"fused": lambda p: dict(use_fused=True, force_block_v=p.block_v, force_segment_chunks=0),
        "split": lambda p: dict(use_fused=False, force_block_v=p.block_v, force_heads_per_cta=p.heads_per_cta,
                                force_segment_chunks=0),
        "cp": lambda p: dict(force_segment_chunks=p.segment_chunks, cp_fused=False),
        "cp_fused": lambda p: dict(force_segment_chunks=p.segment_chunks, cp_fused=True, force_block_v=p.block_v)}


@pytest.mark.parametrize("lengths,hq,hv", [([7168, 1024], 16, 64), ([6144, 512, 512], 2, 8), ([14336, 2048], 16, 32)])
def test_host_lengths_plan_from_the_longest_sequence(lengths, hq, hv):
    """With cu_seqlens_cpu the forward is planned from the longest sequence (planner.plan_forward): the call runs that
    plan (bit-identical to the call pinned to it) and the plan differs from the equal-length one where the model
    says so."""
    from flash_qla import forward as fwd
    from flash_qla.validation import validate_inputs
    x = draw(lengths, hq, hv, 128, 128, torch.bfloat16, seed=8)
    cu_cpu = x["cu_seqlens"].cpu()
    problem = validate_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], x["cu_seqlens"])
    with_lengths = fwd.forward_plan(problem, "bf16", x["q"].device, False, False, max(lengths))
    equal = fwd.forward_plan(problem, "bf16", x["q"].device, False, False)
    assert with_lengths[:4] != equal[:4], (with_lengths, equal)
    with torch.no_grad():
        # the first call takes the full path; the repeats the API's fast lane (checked offsets, plan by longest)
        runs = [flash_qla.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens_cpu=cu_cpu) for _ in range(3)]
        with override(**PINS[with_lengths.path](with_lengths)):
            want = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    for got in runs:
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the same shapes with equal lengths: the fast lane's signature matches, the plan follows the new offsets
    even = [sum(lengths) // len(lengths)] * len(lengths)
    even[-1] += sum(lengths) - sum(even)
    y = draw(even, hq, hv, 128, 128, torch.bfloat16, seed=9)
    plan = fwd.forward_plan(problem, "bf16", x["q"].device, False, False, max(even))
    with torch.no_grad():
        got = flash_qla.chunk_gated_delta_rule(**y, output_final_state=True, cu_seqlens_cpu=y["cu_seqlens"].cpu())
        with override(**PINS[plan.path](plan)):
            want = flash_qla.chunk_gated_delta_rule(**y, output_final_state=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("lengths,hv,ctas", [
    ([1000, 3000], 32, None),
    # 40 sequences (more than one warp's lanes), long ones late and between short ones; 7 CTAs walk ~90 items each
    ([40] * 30 + [700, 64, 1, 65, 300, 700, 2, 130, 64, 9], 8, 7),
])
@pytest.mark.parametrize("tag,K,V,bv,l2norm", [("bf16", 128, 128, 64, False), ("bf16", 128, 128, 128, False),
                                               ("fp16", 64, 128, 64, True), ("bf16", 128, 64, 64, True)])
def test_fused_forward_walks_the_longest_sequences_first(monkeypatch, lengths, hv, ctas, tag, K, V, bv, l2norm):
    """Host lengths out of order: the fused kernel's order build ranks the sequences and walks them longest first,
    and every output and final state is bit-identical to the batch's order (each item is made alone, so only which
    CTA makes it, and when, changes) and close to the fp64 reference (plain and l2norm builds, both dtypes)."""
    from flash_qla import forward as fwd, reference
    from test_gpu_forward import TOL
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[tag]
    x = draw(lengths, 2, hv, K, V, dtype, seed=12)
    if l2norm:  # unnormalised q / k, as the kernels' l2norm sees them
        x["q"], x["k"] = (x["q"].float() * 3).to(dtype), (x["k"].float() * 0.5).to(dtype)
    cu_cpu = x["cu_seqlens"].cpu()
    orders = []
    launch = fwd.launch
    monkeypatch.setattr(fwd, "launch", lambda name, variant, dev, sz, *a: (orders.append(variant.get("order")),
                                                                           launch(name, variant, dev, sz, *a)))
    # the l2norm builds' own order build (prenorm off: not the plain builds after a gdn_l2norm pass)
    with torch.no_grad(), override(use_fused=True, force_block_v=bv, force_segment_chunks=0, fused_ctas_max=ctas,
                                   replay=False, prenorm=False):
        ordered = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens_cpu=cu_cpu,
                                                   use_qk_l2norm_in_kernel=l2norm)
        in_batch_order = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    assert orders == [1, 0], orders
    assert torch.isfinite(ordered[0]).all() and torch.isfinite(ordered[1]).all()
    assert torch.equal(ordered[0], in_batch_order[0]) and torch.equal(ordered[1], in_batch_order[1])
    d = {n: (t.double() if t is not None else None) for n, t in x.items() if n != "cu_seqlens"}
    o, ht = reference.chunked_gated_delta_rule(**d, output_final_state=True, cu_seqlens=cu_cpu,
                                               use_qk_l2norm_in_kernel=l2norm)
    assert reference.relative_l2(ordered[0], o) <= TOL[dtype] and reference.relative_l2(ordered[1], ht) <= TOL[dtype]


def test_auto_cp_false_plans_no_intra_card_cp():
    """FlashQLA's auto_cp=False: a shape the planner runs with intra-card CP runs without it, with the same results
    as the call pinned to the plain path."""
    from flash_qla import forward as fwd
    from flash_qla.validation import validate_inputs
    x = draw([8192], 2, 8, 128, 128, torch.bfloat16, seed=10)
    problem = validate_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], x["cu_seqlens"])
    assert fwd.forward_plan(problem, "bf16", x["q"].device, False, False).path in ("cp", "cp_fused")
    plan = fwd.forward_plan(problem, "bf16", x["q"].device, False, False, allow_cp=False)
    with torch.no_grad():
        got = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True, auto_cp=False)
        with override(**PINS[plan.path](plan)):
            want = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
