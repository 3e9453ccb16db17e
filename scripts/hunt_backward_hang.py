"""Repeat the bench's whole sequence for backward rows (fresh inputs, eager calls, side-stream warm-ups, graph
capture, replays), watching for a hang and naming the kernel it is in (GPU machine).

stress_backward.py replays one captured graph and never stalled; the bench stalled twice on 32k single-sequence
rows (bwd_bench_stalled_run_h200.log and a 2026-11-22 eighth-session run). Here every eager launch records an event on
its stream, so when a phase makes no progress for WATCHDOG_S the script prints, per stream, the first launch whose
event has not completed (the kernel that is stuck, or the one waiting behind it), then exits with status 2.
usage: python scripts/hunt_backward_hang.py ROW_SUBSTRING [SECONDS_PER_ROW] [WATCHDOG_S]
(HUNT_SAVE_BESIDE_DH=1: sets flash_qla.backward.SAVE_CHAIN_BESIDE_DH, the save chain on a side stream beside the dh
chain, the arrangement that stalled before aot/kernels/producer_warp.py; the library's default since the tenth
session, so the flag now only records the intent in a log; HUNT_NO_CARVEOUT=1: no kernel
asks for a shared-memory carveout; HUNT_HOLD_ON_STALL=1: on a stall keep the process, and its hung kernel, for a
debugger: cuda-gdb -p PID)
"""
import os
import sys
import threading
import time

import torch

import flash_qla.backward as backward
import flash_qla.ops as ops
from flash_qla.bench.inputs import draw_inputs
from flash_qla.bench.matrix import iter_rows, load_matrix
from flash_qla.bench.timing import warm_up_on_side_stream
from flash_qla.bench.workloads import backward_call, forward_for_backward

STATE = {"phase": "start", "tick": 0, "trace": True, "launches": [], "call": 0}
_launch = ops._launch


def traced_launch(name, variant, device, sizes, pointers, stream=None):
    _launch(name, variant, device, sizes, pointers, stream)
    if STATE["trace"]:  # not while capturing: an event record there would become a graph node
        handle = stream if stream is not None else ops.current_stream(device)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.ExternalStream(handle, device=device))
        STATE["launches"].append((name, dict(variant), handle, ev, STATE["call"], time.time()))


def report_stall():
    print(f"STALL in phase {STATE['phase']} (iteration {STATE['tick']})", flush=True)
    launches = STATE["launches"]
    done = [ev.query() for _, _, _, ev, _, _ in launches]
    seen = set()
    for (name, variant, handle, ev, call, _), ok in zip(launches, done):
        if handle not in seen and not ok:
            seen.add(handle)
            print(f"  stream {handle:#x}: first unfinished launch {name} {variant} (call {call})", flush=True)
    first = min([i for i, ok in enumerate(done) if not ok], default=len(done))
    t_end = launches[-1][5] if launches else 0.0
    print(f"  launches this phase: {len(launches)}; from {max(first - 4, 0)} (host time before the last launch):")
    for i in range(max(first - 4, 0), min(len(launches), first + 36)):
        name, variant, handle, _, call, t = launches[i]
        print(f"   {i:3d} call {call} {'done' if done[i] else 'PENDING'} {handle:#x} {name} "
              f"{variant.get('mode', '')} BV={variant.get('BV', '')} {t_end - t:.3f}s", flush=True)
    if os.environ.get("HUNT_HOLD_ON_STALL") == "1":  # keep the hung kernel for a debugger (cuda-gdb -p PID)
        print(f"HOLDING pid {os.getpid()}", flush=True)
        while True:
            time.sleep(60)
    os._exit(2)


def watchdog(limit_s):
    last, since = None, time.time()
    while True:
        time.sleep(0.5)
        now = (STATE["phase"], STATE["tick"])
        if now != last:
            last, since = now, time.time()
        elif time.time() - since > limit_s:
            report_stall()


def phase(name):
    STATE["phase"] = name
    STATE["launches"].clear()


def watch_plan_tables():
    """Keep every call's device planning tables (cu_seqlens, chunk_offsets, seq_order) alive, so check_tables() can
    tell whether any kernel wrote them after gdn_plan (a producer and a consumer warpgroup that read them at
    different times could disagree on the chunk count and wait on each other)."""
    offsets = ops._offsets

    def kept(problem, cu_seqlens, device, stream=None, want_order=False):
        cu, off, order = offsets(problem, cu_seqlens, device, stream, want_order)
        STATE.setdefault("tables", []).append((cu, off, order if want_order else None))
        return cu, off, order
    ops._offsets = kept


def check_tables():
    """After a synchronize: every kept call's tables must still be what gdn_plan wrote from its cu_seqlens (printed
    when not; then they are dropped)."""
    for tabs in STATE.pop("tables", []):
        cu, off, order = (t.cpu() if t is not None else None for t in tabs)
        counts = (cu[1:] - cu[:-1] + 63) // 64
        want_off = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)])
        if not torch.equal(off, want_off):
            print(f"TABLE CHANGED: chunk_offsets {off.tolist()[:8]} != {want_off.tolist()[:8]}", flush=True)
        if order is not None and sorted(order.tolist()) != list(range(len(order))):
            print(f"TABLE CHANGED: seq_order {order.tolist()[:8]} is not a permutation", flush=True)


def counted(call):
    def run():
        STATE["call"] += 1
        return call()
    return run


def main():
    want = sys.argv[1]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    limit_s = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
    device = torch.device("cuda", torch.cuda.current_device())
    ops._launch = traced_launch
    watch_plan_tables()
    if os.environ.get("HUNT_NO_CARVEOUT") == "1":  # every kernel loads with the driver's carveout (the manifest's ignored)
        from driver_carveout import use_driver_carveout
        use_driver_carveout()
    if os.environ.get("HUNT_SAVE_BESIDE_DH") == "1":  # the arrangement that hung: save chain beside the dh chain
        backward.SAVE_CHAIN_BESIDE_DH = True
        print("save chain beside the dh chain", flush=True)
    threading.Thread(target=watchdog, args=(limit_s,), daemon=True).start()
    for row in iter_rows(load_matrix(), ("bwd",), want):
        start, n = time.time(), 0
        while time.time() - start < seconds:
            STATE["tick"] += 1
            phase("inputs")
            x = draw_inputs(row, "cuda", seed=1000 + n)
            g_cumsum, A = forward_for_backward(x, "kernels")
            call = counted(backward_call(x, g_cumsum, A, "kernels"))
            phase("eager")
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            check_tables()
            phase("side warm-ups")
            warm_up_on_side_stream(call, device)
            torch.cuda.synchronize()
            check_tables()
            phase("capture")
            STATE["trace"] = False
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            STATE["trace"] = True
            STATE.pop("tables", None)  # the capture's tables live in the graph's pool
            phase("replay")
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
            phase("eager after graph")
            for _ in range(10):
                call()
            torch.cuda.synchronize()
            check_tables()
            del graph
            n += 1
        print(f"{row.key}: {n} full sequences in {time.time() - start:.0f} s, no stall", flush=True)


if __name__ == "__main__":
    main()
