"""Timers: eager median, CUDA-graph replay median, first call, peak memory.

They follow the peer libraries' benchmark so that our numbers and the peers' compare:

* eager: ``triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")`` semantics (the peers' call)
  without needing Triton: the call counts come from a time budget (``eager_counts``: five calls estimate one call's
  time, then 10 ms of warm-up calls and 60 ms of timed calls), one CUDA-event pair around each call, the 256 MB L2
  scratch zeroed before each call (so every call starts with a cold L2, as in do_bench), median over calls. On the
  CPU, ``time.perf_counter``. The counts matter beyond the eager figure: the graph timing follows them, and a longer
  eager phase (100 calls of a 3 ms row against do_bench's ~20) left the GPU in a state that cost the graph median of
  the 32k backward rows ~1% on an H100.
* graph: capture one call after three side-stream warm-ups, then ``rounds`` rounds of ``replays``
  back-to-back replays, median of the per-replay means (the peers' 20 x 5).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Tuple

import torch

GRAPH_REPLAYS = 20
GRAPH_ROUNDS = 5
PEER_WARMUP_MS = 10.0  # the peers': triton.testing.do_bench(call, warmup=10, rep=60, return_mode="median")
PEER_REP_MS = 60.0
ESTIMATE_CALLS = 5     # do_bench's estimate of one call's time
L2_SCRATCH_BYTES = 256 * 1000 * 1000  # do_bench's empty-cache buffer: larger than any Hopper L2

_l2_scratch: Optional[torch.Tensor] = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _flush_l2(device: torch.device) -> None:
    global _l2_scratch
    if _l2_scratch is None or _l2_scratch.device != device:
        _l2_scratch = torch.empty(L2_SCRATCH_BYTES // 4, dtype=torch.int32, device=device)
    _l2_scratch.zero_()


def prepare_device(device: torch.device) -> None:
    """Allocate the L2 scratch up front so it is not counted in any row's peak memory."""
    if device.type == "cuda":
        _flush_l2(device)
        torch.cuda.synchronize(device)


def first_call_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one call until its device work is done (includes any kernel loading)."""
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def host_us_per_call(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    """Host wall time of one call in microseconds: calls calls issued back to back from a drained device and not
    waited for (keep calls x launches below the launch queue's depth, or the figure counts the device's time)."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    synchronize(device)
    return host


def eager_counts(fn: Callable[[], object], device: torch.device, warmup_ms: float = PEER_WARMUP_MS,
                 rep_ms: float = PEER_REP_MS) -> Tuple[int, int]:
    """(warm-up calls, timed calls) for time budgets, as do_bench picks them: one call, then ESTIMATE_CALLS calls each
    after an L2 flush, timed together; then max(1, budget / estimate) calls of each kind."""
    fn()
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(ESTIMATE_CALLS):
            _flush_l2(device)
            fn()
        end.record()
        synchronize(device)
        estimate_ms = start.elapsed_time(end) / ESTIMATE_CALLS
    else:
        began = time.perf_counter()
        for _ in range(ESTIMATE_CALLS):
            fn()
        estimate_ms = 1e3 * (time.perf_counter() - began) / ESTIMATE_CALLS
    estimate_ms = max(estimate_ms, 1e-6)
    return max(1, int(warmup_ms / estimate_ms)), max(1, int(rep_ms / estimate_ms))


def eager_median_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median time of one eager call in milliseconds, host launch overhead included."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        _flush_l2(device)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def warm_up_on_side_stream(fn: Callable[[], object], device: torch.device, calls: int = 3) -> None:
    """calls calls of fn on a fresh side stream, joined back: graph capture wants its warm-ups off the default
    stream (the bench and scripts/stress_backward.py do this before capturing)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)


def graph_median_ms(fn: Callable[[], object], device: torch.device, replays: int = GRAPH_REPLAYS,
                    rounds: int = GRAPH_ROUNDS) -> Tuple[Optional[float], Optional[str]]:
    """(median per-replay ms, None), or (None, why) when there is no graph: a CPU device, or a call
    that cannot be captured (e.g. one that reads device values on the host)."""
    if device.type != "cuda":
        return None, "no CUDA graphs on the CPU"
    try:
        warm_up_on_side_stream(fn, device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        per_replay = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize(device)
            per_replay.append(start.elapsed_time(end) / replays)
        return sorted(per_replay)[len(per_replay) // 2], None
    except Exception as exc:  # capture failed: report it, as the peers' benchmark does, instead of a number
        torch.cuda.synchronize(device)
        return None, f"graph capture failed: {type(exc).__name__}: {str(exc)[:200]}"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def allocated_mb(device: torch.device) -> Optional[float]:
    return torch.cuda.memory_allocated(device) / 2 ** 20 if device.type == "cuda" else None


def peak_mb(device: torch.device) -> Optional[float]:
    """Peak bytes held by PyTorch's allocator since the last reset (None on the CPU: not tracked)."""
    return torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda" else None
