"""Idle time between kernels inside one CUDA-graph replay of a bench row (GPU machine): JSON lines.

Replays the row's captured graph under torch.profiler, one replay at a time, and from the kernels' device
timestamps reports per replay: the span (first kernel start to last kernel end), the time some kernel ran (the
union of the kernels' intervals) and the idle rest, with the largest idle gaps named by the kernels around them.
That idle time bounds what programmatic dependent launch (or any other launch-latency trim) can take off a row.
usage: python scripts/graph_gaps.py OUT.jsonl ROW_SUBSTRING [ROW_SUBSTRING ...]   (e.g. "bwd|hk16_hv32|32k_8seq")
"""
import itertools
import json
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flash_qla.bench.timing import warm_up_on_side_stream
from flash_qla.bench.workloads import backward_rows, forward_rows

REPLAYS = 20


def kernel_intervals(prof):
    """[(start_us, end_us, name)] of every device kernel the profiler saw, in start order."""
    out = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.end > ev.time_range.start:
            out.append((ev.time_range.start, ev.time_range.end, ev.name[:40]))
    return sorted(out)


def profiled_replays(call, device, replays):
    """Each of `replays` replays (one at a time) of a fresh capture of call: its kernels' (start_us, end_us, name)."""
    warm_up_on_side_stream(call, device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    kernels = kernel_intervals(prof)
    per = len(kernels) // replays
    return [kernels[r * per:(r + 1) * per] for r in range(replays)]


def replay_gaps(kernels):
    """(span, busy, [(gap_us, before, after)]) of one replay's kernels (sorted by start)."""
    span = kernels[-1][1] - kernels[0][0]
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = kernels[0]
    for start, end, name in kernels[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_name, name))
            cur_start, cur_end, cur_name = start, end, name
        elif end > cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    return span, busy, gaps


def measure(row, call):
    replays = profiled_replays(call, torch.device("cuda", torch.cuda.current_device()), REPLAYS)
    spans, idles, gap_counts, worst = [], [], [], {}
    for one in replays:
        span, busy, gaps = replay_gaps(one)
        spans.append(span)
        idles.append(span - busy)
        gap_counts.append(len(gaps))
        for gap, before, after in gaps:
            worst.setdefault((before, after), []).append(gap)
    top = sorted(((statistics.median(v), k) for k, v in worst.items()), reverse=True)[:8]
    return {"row": row.key, "kernels_per_replay": len(replays[0]), "span_us": round(statistics.median(spans), 1),
            "idle_us": round(statistics.median(idles), 1), "gaps": statistics.median(gap_counts),
            "largest_gaps_us": [[round(g, 1), b, a] for g, (b, a) in top]}


def main():
    out_path, wants = sys.argv[1], sys.argv[2:]
    with open(out_path, "a") as out:
        for row, _, call in itertools.chain(forward_rows(wants), backward_rows(wants)):
            rec = dict(measure(row, call), device=torch.cuda.get_device_name())
            print(json.dumps(rec), flush=True)
            out.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
