"""Time context parallelism across GPUs: one sequence of T tokens sharded over 1, 2 or 4 GPUs (one process a GPU,
NCCL), forward and backward, ours (flash_qla.distributed; the plain single-GPU call at world size 1) or FLA 0.6's
``fla.ops.cp`` (run with the peers' site bundle unpacked on PYTHONPATH, e.g. tar -xJf .peers/peers-site.tar.xz -C
/tmp/peersite; PYTHONPATH=$PWD:/tmp/peersite python3 scripts/cp_bench.py --lib fla ...).

usage: python3 scripts/cp_bench.py --lib ours|fla --out-dir DIR [--worlds 1,2,4] [--tokens 131072,524288,1048576]
                                   [--heads 16/64,2/8] [--passes fwd,bwd] [--iters 10] [--commit SHA]
                                   [--timing wall|events] [--profile [--trace FILE]]
Appends rows {lib, pass_, world_size, tokens, hq, hv, ms, card[, error][, local_ms, rank_ms, rank_local_ms,
exact_fallbacks]} to DIR/<card>.jsonl. ms: the median over iterations of the slowest rank's wall time of one call
(synchronised before and after, so the host synchronisations inside the call count); with --timing events (the row
says "timing": "events") instead the calls are issued back to back with a CUDA-event pair around each and no
synchronisation between them, as the project's eager timing (flash_qla/bench/timing.py, triton's do_bench) and a
training or serving loop issue them: the host runs ahead, so its path to a call's first kernel is hidden where the
previous call's GPU work covers it (no L2 flush: a shard's working set is far beyond the L2). local_ms (ours, world
size > 1): the same for the plain single-GPU call on the rank's shard alone (an entering state in, the final state out),
the floor CP's windows and exchange add to; rank_ms / rank_local_ms (world size > 1): each rank's own median of the
same timed calls, by rank (the chain of ranks and the spread of the GPUs: a rank's state arrives when the previous
rank's main pass ends); exact_fallbacks: how many of the row's timed CP calls found a window too short and ran their
boundaries exactly (0 where the times are the windowed path's). Inputs as the project's benchmark draws them
(flash_qla.bench.inputs): unit q / k in bf16, g = logsigmoid(randn) / 16 with a quarter of the v-heads at g = 0,
beta = sigmoid(randn); each rank draws its own shard.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HEAD_DIM = 128


def card_name() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((c for c in ("h200", "h100", "h20", "b200", "a100") if c in name), name.replace(" ", "_"))


def shard(P, hq, hv, rank, device, requires_grad):
    torch.manual_seed(1000 + rank)
    l2n = lambda x: (x.float() / x.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)).to(torch.bfloat16)
    q = l2n(torch.randn(1, P, hq, HEAD_DIM, device=device, dtype=torch.bfloat16))
    k = l2n(torch.randn(1, P, hq, HEAD_DIM, device=device, dtype=torch.bfloat16))
    v = torch.randn(1, P, hv, HEAD_DIM, device=device, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(1, P, hv, device=device)) / 16
    g[:, :, torch.arange(hv, device=device) % 4 == 3] = 0.0          # a quarter of the v-heads never decay
    beta = torch.randn(1, P, hv, device=device).sigmoid()
    do = torch.randn_like(v)
    x = [q, k, v, g, beta]
    if requires_grad:
        x = [t.requires_grad_(True) for t in x]
    return x, do


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sync_all(device):
    dist.all_reduce(torch.zeros(1, device=device))
    sync(device)


def timed(fn, device, warmup, iters, setup=None, events=False):
    """(median over iterations of the slowest rank's time of fn(setup()), each rank's own median), in ms: wall time
    between synchronisations, or with events the CUDA-event time of calls issued back to back (on the CPU: the
    host's time, which there is the same thing)."""
    if events and device.type == "cuda":
        pairs = []
        sync_all(device)
        for i in range(warmup + iters):
            arg = setup() if setup else None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(arg)
            end.record()
            pairs.append((start, end))
        sync(device)
        times = [s.elapsed_time(e) / 1e3 for s, e in pairs]
    else:
        times = []
        for i in range(warmup + iters):
            arg = setup() if setup else None
            if not events:
                sync_all(device)
            t0 = time.perf_counter()
            fn(arg)
            if not events:
                sync(device)
            times.append(time.perf_counter() - t0)
    t = torch.tensor(times[warmup:], device=device, dtype=torch.float64)
    ranks = torch.zeros(dist.get_world_size(), device=device, dtype=torch.float64)
    ranks[dist.get_rank()] = statistics.median(t.tolist())
    dist.all_reduce(ranks)                      # each rank's own median, by rank
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist()) * 1e3, [round(x * 1e3, 4) for x in ranks.tolist()]


def ours_calls(world, cu, rank):
    import flash_qla
    from flash_qla.distributed import build_cp_context, chunk_gated_delta_rule_cp
    if world == 1:
        return lambda x: flash_qla.chunk_gated_delta_rule(*x, cu_seqlens=cu)[0], None
    ctx = build_cp_context(cu)
    local_cu = torch.tensor([0, cu[-1].item() // world], dtype=torch.int32, device=cu.device)

    def local(x):  # the rank's main pass alone: an entering state in, its final state out (gradient zero)
        h0 = torch.zeros(1, x[2].shape[2], HEAD_DIM, HEAD_DIM, device=cu.device)
        o, ht = flash_qla.chunk_gated_delta_rule(*x, initial_state=h0, output_final_state=True, cu_seqlens=local_cu)
        return o + 0 * ht.sum() if torch.is_grad_enabled() and o.requires_grad else o
    return lambda x: chunk_gated_delta_rule_cp(*x, cp_context=ctx)[0], local


def _fallbacks() -> int:
    from flash_qla.distributed import STATS
    return STATS["exact_fallback"]


def fla_calls(world, cu, rank):
    from fla.ops.cp import build_cp_context
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    if world == 1:
        return lambda x: chunk_gated_delta_rule(*x, cu_seqlens=cu.long())[0], None
    ctx = build_cp_context(cu.long(), group=dist.group.WORLD)
    return lambda x: chunk_gated_delta_rule(*x, cp_context=ctx)[0], None


def worker(rank, world, args, init_file, out_path):
    if args.device == "cpu":  # a dry run of the script itself (gloo, the reference), not a measurement
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                device_id=device)
    lib = "flash_qla" if args.lib == "ours" else "fla"
    make = ours_calls if args.lib == "ours" else fla_calls
    for heads in args.heads.split(","):
        hq, hv = map(int, heads.split("/"))
        for tokens in map(int, args.tokens.split(",")):
            P = tokens // world
            cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
            call, local = make(world, cu, rank)
            for pass_ in args.passes.split(","):
                row = dict(lib=lib, pass_=pass_, world_size=world, tokens=tokens, hq=hq, hv=hv, ms=None,
                           card=card_name())
                if args.commit:
                    row["commit"] = args.commit
                events = args.timing == "events"
                if events:
                    row["timing"] = "events"
                fallbacks = _fallbacks() if args.lib == "ours" else 0
                try:
                    if pass_ == "fwd":
                        x, _ = shard(P, hq, hv, rank, device, False)
                        with torch.no_grad():
                            row["ms"], ranks = timed(call, device, args.warmup, args.iters, lambda: x, events)
                            if local is not None:
                                row["local_ms"], local_ranks = timed(local, device, args.warmup, args.iters,
                                                                     lambda: x, events)
                    else:
                        x, do = shard(P, hq, hv, rank, device, True)

                        def fwd_for(fn):
                            return lambda: fn(x)
                        bwd = lambda o: torch.autograd.backward([o], [do])
                        row["ms"], ranks = timed(bwd, device, 2, max(3, args.iters // 2), fwd_for(call), events)
                        if local is not None:
                            row["local_ms"], local_ranks = timed(bwd, device, 2, max(3, args.iters // 2),
                                                                 fwd_for(local), events)
                    if world > 1:
                        row["rank_ms"] = ranks
                        if local is not None:
                            row["rank_local_ms"] = local_ranks
                except Exception as e:  # recorded, not hidden: an OOM at world size 1, FLA's Triton check
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    row["ms"] = None
                if local is not None:
                    row["exact_fallbacks"] = _fallbacks() - fallbacks
                x = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if rank == 0:
                    print(json.dumps(row), flush=True)
                    with open(out_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
    if args.profile and world > 1 and world == max(map(int, args.worlds.split(","))) and args.lib == "ours":
        profile(call_args=(args, world, rank, device))
    dist.destroy_process_group()


def profile(call_args):
    """One CP forward and one backward of the last configuration under torch.profiler; rank 1 prints its tables (by
    host time and by device time) and, with --trace, every rank writes its Chrome trace (FILE.rank<r>.json)."""
    args, world, rank, device = call_args
    hq, hv = map(int, args.heads.split(",")[-1].split("/"))
    tokens = int(args.tokens.split(",")[-1])
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    call, _ = ours_calls(world, cu, rank)
    x, do = shard(tokens // world, hq, hv, rank, device, True)
    for _ in range(2):
        torch.autograd.backward([call(x)], [do])
    sync_all(device)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        o = call(x)
        sync_all(device)
        torch.autograd.backward([o], [do])
        sync_all(device)
    if rank == 1:  # a middle rank: both boundaries (rank 0 has no reverse part)
        print(f"profile: world {world} tokens {tokens} hq {hq} hv {hv} (rank 1)", flush=True)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=30, max_name_column_width=60))
    if args.trace:
        root, ext = os.path.splitext(args.trace)
        prof.export_chrome_trace(f"{root}.rank{rank}{ext or '.json'}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", choices=("ours", "fla"), required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--tokens", default="131072,524288,1048576")
    p.add_argument("--heads", default="16/64,2/8")
    p.add_argument("--passes", default="fwd,bwd")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timing", choices=("wall", "events"), default="wall",
                   help="wall: each call between synchronisations; events: calls back to back, CUDA-event pairs")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler tables of the last configuration at the largest world size")
    p.add_argument("--trace", default=None, help="with --profile: write each rank's Chrome trace (FILE.rank<r>.json)")
    p.add_argument("--commit", default=None, help="the code's commit, recorded in every row")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run over gloo")
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    out_path = os.path.join(args.out_dir, f"{card_name()}.jsonl")
    for world in map(int, args.worlds.split(",")):
        if args.device == "cuda" and world > torch.cuda.device_count():
            print(f"world size {world}: only {torch.cuda.device_count()} GPUs, skipped", file=sys.stderr)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(world, args, os.path.join(tmp, "init"), out_path), nprocs=world, join=True)


if __name__ == "__main__":
    main()
