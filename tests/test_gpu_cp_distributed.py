"""Context parallelism across GPUs over NCCL (2 and 4 ranks, one process a GPU, spawned here): each rank's o, final
states and every local gradient against the fp64 reference of the whole batch and against the single-GPU kernels on
the whole batch; the CP error must stay at the single-GPU path's level. Needs at least two sm_90 GPUs."""
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu

# (name, part, cu_seqlens as fractions of T, hq, hv, K, V, dtype, l2norm, warmup_tokens)
CASES = [
    ("one_sequence", 4096, [0.0, 1.0], 2, 4, 128, 128, torch.bfloat16, False, 8192),
    ("crossing_gva_exact", 4096, [0.0, 0.06, 0.55, 0.8, 1.0], 1, 4, 64, 256, torch.float16, True, 0),
    ("crossing_short_window", 3000, [0.0, 0.3, 0.9, 1.0], 2, 4, 128, 64, torch.bfloat16, False, 512),
    # shards twice the window: every boundary is cut at 8192 tokens (the g = 0 head's keys forget within ~4.5k)
    ("one_sequence_windows", 16384, [0.0, 1.0], 2, 4, 128, 128, torch.bfloat16, False, 8192),
    # GVA, K = 64, V = 256, fp16, l2norm: without gradients through the linked forward (every shard plans CP)
    ("one_sequence_gva", 4096, [0.0, 1.0], 1, 4, 64, 256, torch.float16, True, 8192),
]
# the cases whose windows must hold (no rank runs its boundaries exactly); 512 tokens cannot forget a g = 0 head
WINDOWS_HOLD = {"one_sequence": True, "one_sequence_windows": True, "crossing_short_window": False}
# whether calls without gradients take the linked forward: every shard plans intra-card CP there; 3000-token shards
# hand sequences on mid-chunk, so that case keeps the windowed path
LINKED = {"one_sequence": True, "one_sequence_windows": True, "one_sequence_gva": True,
          "crossing_short_window": False}


def _inputs(T, hq, hv, K, V, nseq, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)
    q = randn(1, T, hq, K)
    k = randn(1, T, hq, K)
    k = k / k.norm(dim=-1, keepdim=True)
    v = randn(1, T, hv, V)
    g = torch.nn.functional.logsigmoid(randn(1, T, hv)) / 16      # the benchmark's gate
    g[..., 0] = 0.0                                                   # a g = 0 head
    g[..., -1] = -torch.nn.functional.softplus(randn(1, T)) * 8      # strong decay
    beta = randn(1, T, hv).sigmoid()
    h0 = randn(nseq, hv, K, V)
    do = randn(1, T, hv, V)
    dht = randn(nseq, hv, K, V) / 8
    x = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta)
    return x, h0, do.to(dtype), dht


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _grads(fn, x, h0, do, dht_fn):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    h = h0.detach().clone().requires_grad_(True)
    o, ht = fn(leaves, h)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.autograd.backward([o, ht], [do.to(o.dtype), dht_fn(ht).to(ht.dtype)])
    # every gradient reaches the leaves on the stream that made it (the side stream's are joined first)
    assert not [w for w in caught if "stream" in str(w.message)], [str(w.message) for w in caught]
    grads = {"d" + n: t.grad for n, t in leaves.items()}
    grads["dh0"] = h.grad if h.grad is not None else torch.zeros_like(h)
    return o.detach(), ht.detach(), grads


def _case(rank, world, case, log):
    import flash_qla
    from flash_qla.distributed import STATS, build_cp_context, chunk_gated_delta_rule_cp
    name, part, fracs, hq, hv, K, V, dtype, l2norm, warmup = case
    fallbacks, linked = STATS["exact_fallback"], STATS["linked"]
    T = part * world
    cu = sorted({0, T, *[int(f * T) for f in fracs]})
    dev = torch.device("cuda", rank)
    x, h0, do, dht = _inputs(T, hq, hv, K, V, len(cu) - 1, dtype, dev, seed=7)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
    ctx = build_cp_context(cu_t, warmup_tokens=warmup)
    lo, hi = rank * part, (rank + 1) * part
    ids = list(ctx.seq_ids)
    # the boundary state of a sequence continuing to the next rank gets the gradient of the next piece's h0 in
    # the single-GPU runs below, where the batch is cut at the rank boundaries and the pieces chained
    h0_local = h0[ids].clone()
    if ctx.pre_num_ranks > 0:
        h0_local[0] = 0
    dht_local = dht[ids].clone()
    if ctx.post_num_ranks > 0:
        dht_local[-1] = 0        # the state handed on is differentiated only through the next rank
    x_local = {n: t[:, lo:hi] for n, t in x.items()}

    o, ht, grads = _grads(lambda leaves, h: chunk_gated_delta_rule_cp(
        **leaves, initial_state=h, output_final_state=True, use_qk_l2norm_in_kernel=l2norm, cp_context=ctx),
        x_local, h0_local, do[:, lo:hi], lambda ht: dht_local)
    # the public function routes a cp_context here too
    o_routed, _ = flash_qla.chunk_gated_delta_rule(**x_local, initial_state=h0_local, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=l2norm, cu_seqlens=ctx.cu_seqlens,
                                                   cp_context=ctx)
    o_ng, ht_ng = _check_repeats(name, rank, ctx, x_local, h0_local, l2norm, warmup, o, ht, cu_t)
    assert torch.equal(o_routed, o_ng), (name, rank, "routed call")   # no gradients: the same path
    if name in LINKED:
        assert (STATS["linked"] > linked) == LINKED[name], (name, rank, dict(STATS))
    if name in WINDOWS_HOLD:
        assert (STATS["exact_fallback"] == fallbacks) == WINDOWS_HOLD[name], (name, rank, dict(STATS))

    def whole(backend, cast):
        def fn(leaves, h):
            return flash_qla.chunk_gated_delta_rule(**{n: cast(t) for n, t in leaves.items()}, initial_state=cast(h),
                                                    output_final_state=True, cu_seqlens=cu_t,
                                                    use_qk_l2norm_in_kernel=l2norm, backend=backend)
        return fn
    f64 = lambda t: t.double()
    o1, ht1, g1 = _grads(whole("auto", lambda t: t), x, h0, do, lambda ht: dht)
    o64, ht64, g64 = _grads(whole("reference", f64), x, h0, do, lambda ht: dht)
    last = [i for i, s in enumerate(ids) if i < len(ids) - 1 or ctx.post_num_ranks == 0]
    rows = []
    checks = [("o", o, o1[:, lo:hi], o64[:, lo:hi]), ("o no-grad", o_ng, o1[:, lo:hi], o64[:, lo:hi])]
    if last:
        checks.append(("final", ht[last], ht1[[ids[i] for i in last]], ht64[[ids[i] for i in last]]))
        checks.append(("final no-grad", ht_ng[last], ht1[[ids[i] for i in last]], ht64[[ids[i] for i in last]]))
    for n in ("dq", "dk", "dv", "dg", "dbeta"):
        checks.append((n, grads[n], g1[n][:, lo:hi], g64[n][:, lo:hi]))
    own = [i for i in range(len(ids)) if i > 0 or ctx.pre_num_ranks == 0]
    if own:
        checks.append(("dh0", grads["dh0"][own], g1["dh0"][[ids[i] for i in own]], g64["dh0"][[ids[i] for i in own]]))
    for label, got, single, exact in checks:
        e_cp, e_single, d = _rel(got, exact), _rel(single, exact), _rel(got, single)
        rows.append(f"{name} rank {rank}/{world} {label}: cp-vs-fp64 {e_cp:.2e} single-vs-fp64 {e_single:.2e} "
                    f"cp-vs-single {d:.2e}")
        assert torch.isfinite(got).all(), (name, rank, label)
        assert e_cp < 1.5e-2, (name, rank, label, e_cp)
        assert e_cp < 1.5 * e_single + 2e-3, (name, rank, label, e_cp, e_single)
    log.extend(rows)


def _check_repeats(name, rank, ctx, x_local, h0_local, l2norm, warmup, o, ht, cu_t):
    """Calls without autograd (the entry's remembered checks; the linked forward or the windowed path's flags read
    at the end) repeat bit for bit, and for other inputs of the same shape match a new context's first call; on the
    windowed path they give the autograd call's o and final state exactly. Returns the first one's (o, final)."""
    from flash_qla.distributed import build_cp_context, chunk_gated_delta_rule_cp
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    other = {n: t.roll(1, dims=1).contiguous() for n, t in x_local.items()}
    with torch.no_grad():
        runs = [chunk_gated_delta_rule_cp(**x_local, initial_state=h0_local, cp_context=ctx, **kw) for _ in range(3)]
        o_other, ht_other = chunk_gated_delta_rule_cp(**other, initial_state=h0_local, cp_context=ctx, **kw)
        fresh = build_cp_context(cu_t, warmup_tokens=warmup)
        o_new, ht_new = chunk_gated_delta_rule_cp(**other, initial_state=h0_local, cp_context=fresh, **kw)
    from flash_qla.distributed import _checked_call, _link_layout
    call = _checked_call(ctx, *x_local.values(), None, h0_local, True, l2norm, "auto")
    same = (o, ht) if _link_layout(call, ctx, tuple(x_local.values()), h0_local) is None else runs[0]
    for o_r, ht_r in runs:
        assert torch.equal(o_r, same[0].detach()) and torch.equal(ht_r, same[1].detach()), (name, rank, "repeat")
    assert torch.equal(o_other, o_new) and torch.equal(ht_other, ht_new), (name, rank, "other inputs")
    return runs[0]


def _worker(rank, world, init_file, out_dir):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    log = []
    try:
        for case in CASES:
            _case(rank, world, case, log)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.log"), "w") as f:
            f.write("\n".join(log) + "\n")
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_cp_across_gpus(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    for r in range(world):
        print((tmp_path / f"rank{r}.log").read_text(), end="")
