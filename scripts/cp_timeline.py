"""Where one rank's context-parallel call spends its time: GPU and host timestamps of each step, no profiler.

usage (one GPU): python scripts/cp_timeline.py [--tokens 262144] [--heads 2/8] [--rank 1] [--world 4] [--calls 15]
                [--kernels]

One process plays rank --rank of a --world-rank group over one sequence of --world x --tokens tokens, its shard
--tokens long: a single-rank NCCL group whose all-gather and point-to-point exchange are replaced by local copies
(every rank's payload is this rank's), so the boundary work runs as on a real rank but the exchange costs a copy
and no rank waits for another.
Each step of flash_qla.distributed's forward (the main pass, the head window and its pass, the exchange with its
correction) is wrapped in CUDA events recorded on the stream it runs on, and host perf_counter stamps beside them;
the medians over the calls after three warm-up calls are printed in microseconds from the call's start, GPU then
host: a step whose GPU stamp follows its host stamp by little waited for the host. The plain call on the shard (an entering state in,
the final state out, as cp_bench.py's local_ms) is timed last. Inputs as cp_bench.py draws them. --kernels also
lists one call's kernels (torch.profiler): start and duration in us from the first, and the stream each ran on.
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

import flash_qla
from flash_qla import distributed as cpd

HEAD_DIM = 128


def copy_gather(out: torch.Tensor, payload: torch.Tensor, group=None) -> None:
    """The all-gather as a local copy: every rank's row is this rank's payload."""
    out.view(-1, payload.numel()).copy_(payload.reshape(1, -1).expand(out.numel() // payload.numel(), -1))


def copy_pass_on(ctx, send, shape, dtype, device, reverse=False):
    """The neighbour's state as a local copy of this rank's (where one arrives)."""
    receives = (ctx.post_num_ranks if reverse else ctx.pre_num_ranks) > 0
    if not receives:
        return None
    return send.to(dtype, copy=True) if send is not None else torch.zeros(shape, dtype=dtype, device=device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=262144, help="the shard's tokens")
    p.add_argument("--heads", default="2/8", help="hq/hv")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--calls", type=int, default=15)
    p.add_argument("--kernels", action="store_true", help="list one call's kernels and their streams")
    args = p.parse_args()
    if not 0 <= args.rank < args.world:
        raise SystemExit(f"cp_timeline: --rank must lie in [0, {args.world})")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cp_bench import shard

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/init", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        try:
            run(args, shard)
        finally:
            dist.destroy_process_group()


def run(args, shard) -> None:
    cpd._gather_single = copy_gather
    cpd._pass_on = copy_pass_on
    hq, hv = map(int, args.heads.split("/"))
    P, r, world = args.tokens, args.rank, args.world
    device = torch.device("cuda", 0)
    x, _ = shard(P, hq, hv, r, device, False)
    cu = torch.tensor([0, P], dtype=torch.int64)
    ctx = cpd.CPContext(group=None, rank=r, world_size=world, part_len=P, cu_seqlens=cu.to(device, torch.int32),
                        cu_seqlens_cpu=cu, seq_ids=(0,), pre_num_ranks=r, post_num_ranks=world - 1 - r,
                        pre_all=tuple(range(world)), post_all=tuple(world - 1 - i for i in range(world)),
                        nseq_all=(1,) * world)
    marks: list = []

    def mark(name: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((name, ev, time.perf_counter()))

    def wrapped(fn, name):
        def step(*a, **kw):
            mark(name + " start")
            out = fn(*a, **kw)
            mark(name + " end")
            return out
        return step

    for attr, name in (("_head_windows", "head window"), ("_exchange", "exchange")):
        setattr(cpd, attr, wrapped(getattr(cpd, attr), name))
    run_kept = cpd._Call.run_kept

    def marked_pass(self, role, *a, **kw):    # the main pass and the head window's pass, by their role
        mark(f"{role[0]} pass start")
        out = run_kept(self, role, *a, **kw)
        mark(f"{role[0]} pass end")
        return out
    cpd._Call.run_kept = marked_pass
    stamps: dict = {}
    with torch.no_grad():
        for i in range(args.calls):
            marks.clear()
            torch.cuda.synchronize()
            mark("call")
            cpd.chunk_gated_delta_rule_cp(*x, cp_context=ctx)
            mark("return")
            torch.cuda.synchronize()
            if i >= 3:
                ev0, t0 = marks[0][1], marks[0][2]
                for name, ev, t in marks:
                    stamps.setdefault(name, []).append((ev0.elapsed_time(ev) * 1e3, (t - t0) * 1e6))
        print(f"rank {r} of {world}, shard {P} tokens, heads {hq}/{hv}: us from the call's start "
              f"(medians of {args.calls - 3})")
        print(f"{'step':20s} {'GPU':>9s} {'host':>9s}")
        for name, vals in stamps.items():
            gpu, host = statistics.median(a for a, _ in vals), statistics.median(b for _, b in vals)
            print(f"{name:20s} {gpu:9.1f} {host:9.1f}")
        h0 = torch.zeros(1, hv, HEAD_DIM, HEAD_DIM, device=device)
        times = []
        for i in range(args.calls):
            torch.cuda.synchronize()
            t = time.perf_counter()
            flash_qla.chunk_gated_delta_rule(*x, initial_state=h0, output_final_state=True, cu_seqlens=ctx.cu_seqlens)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        print(f"the plain call on the shard: {statistics.median(times[3:]):.3f} ms")
        if args.kernels:
            print_kernels(lambda: cpd.chunk_gated_delta_rule_cp(*x, cp_context=ctx))


def print_kernels(call) -> None:
    """One call's GPU kernels and copies from a torch.profiler trace: start and duration in us, stream, name."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    rows = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if not rows:
        return
    t0 = rows[0]["ts"]
    print(f"{'start':>9s} {'us':>8s} {'stream':>6s}  kernel")
    for e in rows:
        print(f"{e['ts'] - t0:9.1f} {e['dur']:8.1f} {e['args'].get('stream', '?'):>6}  {e['name'][:60]}")


if __name__ == "__main__":
    main()
