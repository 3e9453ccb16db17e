"""Replay one backward row's CUDA graph many times, checking that every replay finishes (GPU machine).

A hang in a kernel (an mbarrier wait that never completes) or in the multi-stream capture shows as a replay
batch that does not finish within the watchdog's time: the script then prints which batch stalled and exits
with status 2 (the device call's own timeout should be longer than the watchdog). Every batch's gradients are
compared with the first replay's, so a race shows as a difference.
usage: python scripts/stress_backward.py ROW_SUBSTRING [REPLAYS] [WATCHDOG_S]
"""
import os
import sys
import threading
import time

import torch

from flash_qla.bench.inputs import draw_inputs
from flash_qla.bench.matrix import iter_rows, load_matrix
from flash_qla.bench.timing import warm_up_on_side_stream
from flash_qla.bench.workloads import backward_call, forward_for_backward

BATCH = 50


def main():
    want = sys.argv[1]
    replays = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    watchdog_s = float(sys.argv[3]) if len(sys.argv) > 3 else 60.0
    for row in iter_rows(load_matrix(), ("bwd",), want):
        x = draw_inputs(row, "cuda")
        g_cumsum, A = forward_for_backward(x, "kernels")
        call = backward_call(x, g_cumsum, A, "kernels")
        warm_up_on_side_stream(call, torch.device("cuda", torch.cuda.current_device()))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            grads = call()
        graph.replay()
        torch.cuda.synchronize()
        first = [g.clone() if g is not None else None for g in grads]
        state = {"batch": 0, "done": False}

        def watchdog():
            last, since = -1, time.time()
            while not state["done"]:
                time.sleep(1.0)
                if state["batch"] != last:
                    last, since = state["batch"], time.time()
                elif time.time() - since > watchdog_s:
                    print(f"STALL: {row.key} batch {last} (replays {last * BATCH}..) did not finish in "
                          f"{watchdog_s:.0f} s", flush=True)
                    os._exit(2)
        threading.Thread(target=watchdog, daemon=True).start()
        start = time.time()
        mismatches = 0
        for b in range(replays // BATCH):
            for _ in range(BATCH):
                graph.replay()
            torch.cuda.synchronize()
            mismatches += sum(int(not torch.equal(g, f)) for g, f in zip(grads, first) if g is not None)
            state["batch"] = b + 1
        state["done"] = True
        print(f"{row.key}: {replays} replays in {time.time() - start:.1f} s, {mismatches} gradient mismatches "
              f"against the first replay", flush=True)
        if mismatches:
            sys.exit(1)


if __name__ == "__main__":
    main()
