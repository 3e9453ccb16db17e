"""Repeat the bench's whole sequence for backward rows (fresh inputs, eager calls, side-stream warm-ups, graph
capture, replays), watching for a hang and naming the kernel it is in (GPU machine).

stress_backward.py replays one captured graph and never stalled; the bench stalled twice on CP rows
(bwd_bench_stalled_run_h200.log and a 2026-11-22 eighth-session run). Here every eager launch records an event on
its stream, so when a phase makes no progress for WATCHDOG_S the script prints, per stream, the first launch whose
event has not completed (the kernel that is stuck, or the one waiting behind it), then exits with status 2.
usage: python scripts/hunt_backward_hang.py ROW_SUBSTRING [SECONDS_PER_ROW] [WATCHDOG_S]
"""
import os
import sys
import threading
import time

import torch

import flash_qla.ops as ops
from flash_qla.bench.inputs import draw_inputs
from flash_qla.bench.matrix import iter_rows, load_matrix
from flash_qla.bench.workloads import backward_call, forward_for_backward

STATE = {"phase": "start", "tick": 0, "trace": True, "launches": []}
_launch = ops._launch


def traced_launch(name, variant, device, sizes, pointers, stream=None):
    _launch(name, variant, device, sizes, pointers, stream)
    if STATE["trace"]:  # not while capturing: an event record there would become a graph node
        handle = stream if stream is not None else ops.current_stream(device)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.ExternalStream(handle, device=device))
        STATE["launches"].append((name, dict(variant), handle, ev))


def report_stall():
    print(f"STALL in phase {STATE['phase']} (iteration {STATE['tick']})", flush=True)
    seen = set()
    for name, variant, handle, ev in STATE["launches"]:
        if handle in seen or ev.query():
            continue
        seen.add(handle)
        print(f"  stream {handle:#x}: first unfinished launch {name} {variant}", flush=True)
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


def main():
    want = sys.argv[1]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    limit_s = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
    ops._launch = traced_launch
    threading.Thread(target=watchdog, args=(limit_s,), daemon=True).start()
    for row in iter_rows(load_matrix(), ("bwd",), want):
        start, n = time.time(), 0
        while time.time() - start < seconds:
            STATE["tick"] += 1
            phase("inputs")
            x = draw_inputs(row, "cuda", seed=1000 + n)
            g_cumsum, A = forward_for_backward(x, "kernels")
            call = backward_call(x, g_cumsum, A, "kernels")
            phase("eager")
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            phase("side warm-ups")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    call()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            phase("capture")
            STATE["trace"] = False
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            STATE["trace"] = True
            phase("replay")
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
            phase("eager after graph")
            for _ in range(10):
                call()
            torch.cuda.synchronize()
            del graph
            n += 1
        print(f"{row.key}: {n} full sequences in {time.time() - start:.0f} s, no stall", flush=True)


if __name__ == "__main__":
    main()
