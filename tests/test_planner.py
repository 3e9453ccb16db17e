"""The launch planner: V blocks (fewest waves x chain cost; narrow only when it adds no wave), gdn_prepare's heads
per CTA, and the plain forward's path (fused or prepare + chain)."""
import pytest

from flash_qla.planner import (OUT_CHAIN_COST, PREPARE_MAX_HEADS, STAGED_CHAIN_COST, plan_block_v,
                               plan_fused_block_v, plan_heads_per_cta, plan_irregular_block_v, prefer_fused)


@pytest.mark.parametrize("n,hv,V,blocks,want", [
    (1, 8, 128, [64, 128], 64),      # TP8 1x32768: one wave either way, the narrow chain is cheaper
    (8, 8, 128, [64, 128], 64),      # TP8 4096x8: 128 chains of 64 still fit one wave
    (1, 64, 128, [64, 128], 64),     # TP1 1x32768: 128 chains fit one wave
    (8, 64, 128, [64, 128], 128),    # TP1 4096x8: 4 waves x 1.25 beat 8 x 1.0
    (1, 200, 256, [64], 64),         # only the built blocks are candidates
])
def test_plan_output_kernel(n, hv, V, blocks, want):
    assert plan_block_v(n, hv, V, blocks, 132, OUT_CHAIN_COST) == want


@pytest.mark.parametrize("n,hv,V,blocks,want", [
    (1, 8, 128, [32, 64], 32),       # TP8 1x32768: 16 or 32 chains, one wave either way: narrow is cheaper
    (1, 32, 128, [32, 64], 32),      # TP2 1x32768: 64 or 128 chains, still one wave
    (8, 8, 128, [32, 64], 64),       # TP8 4096x8: BV=32 would need two waves
    (8, 64, 128, [32, 64, 128], 64), # TP1 4096x8: 8 waves x 1.0 beats 4 x 2.06 and 16 x 0.86
    (1, 8, 64, [32, 64], 32),
])
def test_plan_staged_chains(n, hv, V, blocks, want):
    assert plan_block_v(n, hv, V, blocks, 132, STAGED_CHAIN_COST) == want


@pytest.mark.parametrize("tokens,n,hv,want", [
    (8192, 8, 8, 32),     # hk4_hv8 8k_8seq: the longest chain, not a second wave, sets the time: narrow
    (32768, 8, 8, 32),    # hk4_hv8 32k_8seq
    (8192, 8, 32, 64),    # hk16_hv32 8k_8seq: 1024 narrow CTAs are 7.8 SMs' worth of work each: wide
    (32768, 8, 32, 64),   # hk16_hv32 32k_8seq
])
def test_plan_irregular_chains(tokens, n, hv, want):
    costs = tuple(sorted(STAGED_CHAIN_COST.items()))
    assert plan_irregular_block_v(tokens, n, hv, 128, (32, 64), 132, costs) == want


def test_no_block_built_is_an_error():
    with pytest.raises(ValueError, match="no V block is built for V = 96"):
        plan_block_v(1, 1, 96, [], 132)


@pytest.mark.parametrize("slots,hv,hq,want", [
    (520, 64, 16, 4),   # TP1 4096x8: 33k one-head CTAs, many waves: whole GVA groups
    (129, 8, 2, 2),     # TP8 1x8192: two waves of one-head CTAs become one of two-head CTAs
    (33, 8, 2, 1),      # TP8 1x2048: one wave either way, the shortest CTA wins
    (520, 48, 16, 3),   # a GVA ratio of 3: its divisor
    (520, 40, 8, 1),    # a ratio of 5 has no divisor in 2..4
    (520, 16, 16, 1),   # no GVA
])
def test_plan_heads_per_cta(slots, hv, hq, want):
    d = plan_heads_per_cta(slots, hv, hq, 132)
    assert d == want and (hv // hq) % d == 0 and d <= PREPARE_MAX_HEADS


@pytest.mark.parametrize("tokens,n,hv,split_bv,hpc,want", [
    (32768, 8, 16, 128, 1, True),     # 2B 4096x8: gdn_prepare's 8k one-head CTAs weigh as much as the chain
    (32768, 4, 16, 64, 1, True),      # 2B 8192x4: one wave of fused chains
    (32768, 1, 64, 64, 4, True),      # TP1 1x32768: one wave, 64 heads of prepare
    (32768, 8, 64, 128, 4, False),    # TP1 4096x8: eight waves of fused chains at BV = 64 against four at 128
    (32768, 4, 32, 128, 4, False),    # TP2 8192x4: two waves against one
    (2048, 1, 8, 64, 1, False),       # TP8 1x2048: prepare is cheap, the chain at BV = 64 faster per chunk
    (2048, 1, 16, 64, 1, False),      # 2B 1x2048
])
def test_prefer_fused_on_the_standard_rows(tokens, n, hv, split_bv, hpc, want):
    """gdn_fwd_fused at BV = 64 vs gdn_prepare + gdn_fwd_chain, as measured on the H200 (the fused kernel's chunk is
    ~1.4x gdn_fwd_chain's at BV = 64, but it has no prepare pass)."""
    assert prefer_fused(tokens, n, hv, 128, 132, split_bv, hpc) == want


@pytest.mark.parametrize("tokens,n,hv,want", [
    (32768, 1, 64, 64),     # TP1 1x32768: 128 chains of 64 columns fit one wave
    (32768, 8, 8, 64),      # TP8 4096x8: 128 chains too
    (32768, 8, 16, 128),    # 2B 4096x8: 256 chains of 64 would take two waves, 128 of 128 one (0.24 vs 0.31 ms)
    (32768, 8, 64, 128),    # TP1 4096x8: 4 waves of 128 columns against 8 of 64 (0.96 vs 1.24 ms)
])
def test_fused_block_v(tokens, n, hv, want):
    assert plan_fused_block_v(tokens, n, hv, 128, 132, (64, 128)) == want
    assert plan_fused_block_v(tokens, n, hv, 128, 132, (64,)) == 64  # only built blocks


@pytest.mark.parametrize("tokens,n,hv,split_bv,hpc", [
    (32768, 8, 64, 128, 4),           # TP1 4096x8: fused 0.99 ms against split 1.19 (H200 bench)
    (32768, 4, 32, 128, 4),           # TP2 8192x4: 0.48 against 0.55
    (8192, 8, 32, 128, 4),            # TP2 1024x8: 0.134 against 0.159
])
def test_two_consumer_fused_beats_split_on_many_waves(tokens, n, hv, split_bv, hpc):
    assert prefer_fused(tokens, n, hv, 128, 132, split_bv, hpc, fused_bv=128)


@pytest.mark.parametrize("tokens,n,hv,split_bv,hpc,want", [
    (32768, 8, 16, 128, 1, True),     # 2B 4096x8 with l2norm: split 0.537 ms, fused 0.402 (H200)
    (32768, 8, 8, 64, 4, False),      # TP8 4096x8 with l2norm: split 0.205, fused 0.227
    (32768, 8, 64, 128, 4, False),    # TP1 4096x8 with l2norm: split 1.26, fused 1.58
])
def test_prefer_fused_with_l2norm(tokens, n, hv, split_bv, hpc, want):
    assert prefer_fused(tokens, n, hv, 128, 132, split_bv, hpc, l2norm=True) == want


@pytest.mark.parametrize("hq,hv,tokens,want", [(4, 8, 8192, 32), (4, 8, 32768, 32), (16, 32, 8192, 64),
                                                (16, 32, 32768, 64)])
def test_backward_chains_plan_batches_for_unequal_chains(monkeypatch, hq, hv, tokens, want):
    """Both backward chains (gdn_bwd_recompute's save build and gdn_bwd_dh) plan a batch's V block for unequal chains (H200: the
    save build at 32 on hk4_hv8 8k_8seq 0.345 -> 0.323 ms with the chains in order; beside each other, 32k_8seq at 32
    0.878 ms against 0.899 forced to 64)."""
    import torch

    from flash_qla import forward as fwd
    from flash_qla import launch
    from flash_qla.validation import Problem
    monkeypatch.setattr(fwd, "num_sms", lambda device: 132)
    problem = Problem(batch=1, tokens=tokens, num_qk_heads=hq, num_v_heads=hv, head_dim_k=128, head_dim_v=128,
                      num_seqs=8, scale=128 ** -0.5, varlen=True)
    cpu = torch.device("cpu")
    assert fwd._block_v(problem, "bf16", cpu, kernel=launch.RECOMPUTE_KERNEL, mode="save") == want
    assert fwd._block_v(problem, "bf16", cpu, kernel="gdn_bwd_dh", mode="chain") == want
    single = Problem(batch=1, tokens=tokens, num_qk_heads=hq, num_v_heads=hv, head_dim_k=128, head_dim_v=128,
                     num_seqs=1, scale=128 ** -0.5, varlen=False)  # one sequence: equal chains, planned by waves
    assert fwd._block_v(single, "bf16", cpu, kernel=launch.RECOMPUTE_KERNEL, mode="save") == plan_block_v(
        1, hv, 128, [32, 64], 132, STAGED_CHAIN_COST)
