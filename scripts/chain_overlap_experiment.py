"""How the backward's two chains (gdn_bwd_dh, gdn_fwd's save build) share the GPU (GPU machine): JSON lines.

For each backward row and each launch arrangement: the CUDA-graph and eager medians of the whole backward
(chunk_gated_delta_rule_bwd, as the bench times it), one eager call's and one graph replay's kernel timeline (start
offset and duration of every kernel, from a torch.profiler trace), so a chain that waits for SMs shows as a late start.
Arrangements (monkeypatched here, nothing changes in the library):
  base          both chains on the caller's stream, the save build first (in order)
  beside        as shipped: the save build on a side stream beside the dh chain (backward.SAVE_CHAIN_BESIDE_DH; it
                hung now and then until producer_warp.py: bench/results/experiments/backward_hang_hunt_h200.md)
  serial        with beside: both chains on the caller's stream all the same (the save build first)
  dh_first      the save build's launch is held back until the dh chain's launch has been issued
  dh_bvN / save_bvN   that chain's V block forced to N (the planner's choice otherwise)
  unordered     both chains dispatched in sequence index order (not gdn_plan's longest first)
  cpL           intra-card CP segments of L chunks (cp0: no CP; the planner's choice otherwise)
usage: python scripts/chain_overlap_experiment.py ARRANGEMENT[,ARRANGEMENT...] ROW_SUBSTRING [...]
(an arrangement may combine parts with '+', e.g. beside+dh_first or save_bv32+dh_bv32)
"""
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from flash_qla import backward, cp, ops
from flash_qla.bench import timing
from flash_qla.bench.workloads import backward_rows

ORIG_LAUNCH, ORIG_BLOCK_V, ORIG_SIDE, ORIG_SEGMENTS = ops._launch, ops._block_v, ops._side_stream, ops._segment_chunks
STATE = {"parts": set(), "held": [], "chosen": {}}


def _launch(name, variant, device, sizes, pointers, stream=None):
    if "unordered" in STATE["parts"] and "ordered" in sizes:
        sizes = dict(sizes, ordered=0)
    if "dh_first" in STATE["parts"] and name == ops.FWD_KERNEL and variant.get("mode") == "save":
        STATE["held"].append((name, variant, device, sizes, pointers, stream))
        return None
    ORIG_LAUNCH(name, variant, device, sizes, pointers, stream)
    if name == backward.DH_KERNEL and variant.get("mode") == "chain":
        while STATE["held"]:
            ORIG_LAUNCH(*STATE["held"].pop())


def _block_v(problem, tag, device, kernel=ops.OUT_KERNEL, mode="out", chains_per_head=None):
    for part in STATE["parts"]:
        if kernel == backward.DH_KERNEL and part.startswith("dh_bv"):
            bv = int(part[5:])
            break
        if kernel == ops.FWD_KERNEL and mode == "save" and part.startswith("save_bv"):
            bv = int(part[7:])
            break
    else:
        bv = ORIG_BLOCK_V(problem, tag, device, kernel=kernel, mode=mode, chains_per_head=chains_per_head)
    STATE["chosen"][f"{kernel}:{mode}"] = bv
    return bv


def _segment_chunks(problem, tag, device, save=False):
    cp.FORCE_SEGMENT_CHUNKS = next((int(p[2:]) for p in STATE["parts"] if p.startswith("cp")), None)
    L = ORIG_SEGMENTS(problem, tag, device, save=save)
    cp.FORCE_SEGMENT_CHUNKS = None
    if save:
        STATE["chosen"]["L"] = L
    return L


def _side_stream(device, name="side"):
    if "serial" in STATE["parts"]:
        return torch.cuda.current_stream(device)
    return ORIG_SIDE(device, name)


def timeline(call, graph=False):
    """One eager call's kernels (graph: one replay of the call's CUDA graph): (name, start offset us, duration us),
    in start order."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    if graph:  # captured as the bench captures it; CUPTI reports the kernels of a graph replay as well
        timing.warm_up_on_side_stream(call, torch.device("cuda"))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        call = g.replay
        for _ in range(2):
            call()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
    events.sort(key=lambda e: e["ts"])
    t0 = events[0]["ts"] if events else 0.0
    return [(e["name"].replace("_kernel", "")[:24], round(e["ts"] - t0, 1), round(e["dur"], 1)) for e in events
            if e["dur"] > 3.0]


def main():
    ops._launch, ops._block_v, ops._side_stream, ops._segment_chunks = _launch, _block_v, _side_stream, _segment_chunks
    arrangements, wants = sys.argv[1].split(","), sys.argv[2:] or [""]
    device = torch.device("cuda")
    timing.prepare_device(device)
    for row, _, call in backward_rows(wants):
        for arrangement in arrangements:
            STATE["parts"] = set(arrangement.split("+"))
            STATE["chosen"] = {}
            backward.SAVE_CHAIN_BESIDE_DH = "beside" in STATE["parts"]
            graph_ms, err = timing.graph_median_ms(call, device)
            eager_ms = timing.eager_median_ms(call, device, warmup=5, iters=30)
            rec = {"row": row.key, "arrangement": arrangement, "graph_ms": round(graph_ms, 4) if graph_ms else None,
                   "eager_ms": round(eager_ms, 4), "error": err, "blocks": dict(STATE["chosen"]),
                   "timeline": timeline(call), "graph_timeline": timeline(call, graph=True)}
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
