"""Host cost of the kernel path's eager calls: CPU microseconds per call in a host-bound loop.

For each shape, after the calls that record its plans, N calls are queued back to back behind a sleep kernel that keeps
the device busy, and the CPU time of the loop is divided by N (then the device is synchronised, outside the
timing): what a serving engine or a training loop pays on the CPU per call, whether or not the device is slower. Forward: ``chunk_gated_delta_rule``
under no_grad; forward + backward: the same call with gradients on every input, then ``autograd.backward`` on o
and the final state. Shapes: the standard matrix's forward rows, plus small batches (1 x 64 tokens, 5 + 17 + 130,
37 x 48, 256 x 8) with TP8's heads (hq 2, hv 8) and TP1-397B's (16, 64).

usage (GPU machine, repository root):
  python scripts/host_cost.py --out bench/results/h100/host_overhead.json [--calls 200] [--rows SUBSTRING]
  (it runs itself with --first-call in a fresh process for the first_call figures)
Writes {"device": ..., "autograd_floor_us", "floor_empty_us", "floor_launch_us", "floor_autograd_min_us",
"first_call": {...}, "rows": [{"shape", "tokens", "seqs", "hq", "hv", "fwd_host_us", "fwd_bwd_host_us", "plans"}]}:
the floors are what any library pays on the host (a torch.empty, a launch, autograd's own forward + backward) before
its own work; first_call is a fresh process's first forward and first forward + backward (wall time until the device
is done; kernel loading and plan recording included), on TP8 1x32768, after torch's own first backward (timed apart).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import flash_qla
from flash_qla import plans
from flash_qla.bench.inputs import draw_inputs
from flash_qla.bench.matrix import BenchRow, iter_rows, load_matrix

SLEEP_CYCLES = 400_000_000  # ~0.2 s at the H100's / H200's clocks: longer than any loop below queues
SMALL = [("1x64", (64,)), ("5+17+130", (5, 17, 130)), ("37x48", (48,) * 37), ("256x8", (8,) * 256)]
SMALL_HEADS = [("TP8", 2, 8), ("TP1-397B", 16, 64)]


def shapes(filter_: str):
    for row in iter_rows(load_matrix(), ("fwd",), ""):
        yield row
    for model, hq, hv in SMALL_HEADS:
        for label, lens in SMALL:
            yield BenchRow("fwd", model, hq, hv, label, lens, 128)


def host_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over repeats of (CPU seconds to queue `calls` calls) / calls, in microseconds. The device is held
    busy (torch.cuda._sleep) for the whole loop, so no queued call runs and none is waited for: the loop's time is
    the host's alone, whatever the device time of the shape."""
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def profile(fn, calls: int, what: str) -> None:
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    print(f"-- {what}: {calls} calls")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def breakdown(x, leaves, calls: int) -> dict:
    """Host microseconds of the layers of one call, each alone in a loop of `calls`."""
    from flash_qla import kernel_api as ops
    from flash_qla.validation import validate_inputs
    dev = x.q.device
    problem = validate_inputs(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens)
    o = x.v.new_empty(x.v.shape)
    do = torch.ones_like(o)
    with torch.no_grad():
        args = (problem, x.q, x.k, x.v, x.g, x.beta, x.h0, True, x.cu_seqlens, False)
        out = {
            "empty_us": host_us(lambda: torch.empty(1 << 20, device=dev, dtype=torch.uint8), calls),
            "validate_us": host_us(lambda: validate_inputs(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens),
                                   calls),
            "ops_forward_us": host_us(lambda: ops.run_forward(*args), calls),
            "ops_backward_us": host_us(lambda: ops.run_backward(problem, x.q, x.k, x.v, x.g, x.beta, x.h0,
                                                               x.cu_seqlens, False, do, x.dht), max(1, calls // 3)),
        }
    q, k, v, g, beta, h0 = leaves

    def forward_with_grad():
        return flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, scale=x.scale, initial_state=h0,
                                                output_final_state=True, cu_seqlens=x.cu_seqlens)
    out["api_forward_with_grad_us"] = host_us(forward_with_grad, max(1, calls // 3))
    from flash_qla.kernel_api import _forward_inputs
    with torch.no_grad():
        ops.run_forward(*args)
        out.update(program_cost(_forward_inputs(problem, x.q, x.k, x.v, x.g, x.beta, x.h0, x.cu_seqlens), calls))
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


def program_cost(inputs, calls: int) -> dict:
    """The most recently used plan (the last call's) alone: its op counts and its C program issued on one call's
    buffers (the driver calls and the crossing only)."""
    from flash_qla.launch import current_stream, side_stream
    from flash_qla.loader import native
    key, plan = next(reversed(plans._cache.items()))
    dev = plan.device
    bound = plan.bind(inputs, current_stream(dev), side_stream)
    run = native().program_run
    return {"plan": key[0], "launches": sum(n != "join" for n in plan.names),
            "joins": sum(n == "join" for n in plan.names), "outputs": len(plan.outputs),
            "program_us": host_us(lambda: run(plan.program, bound[2], bound[3]), calls)}


class _Identity(torch.autograd.Function):
    """The least a custom autograd op can do: its forward + backward host time is torch's own floor for any
    library's fwd_bwd_host_us (Function.apply, the graph, the engine's hand-off to the device thread, accumulation)."""

    @staticmethod
    def forward(ctx, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def autograd_floor_us(calls: int, leaves: int = 6, outputs: int = 2) -> float:
    """Host microseconds of forward + backward through _Identity on `leaves` CUDA leaves, backward from the first
    `outputs` of them (6 and 2: the step host_cost times, inputs q, k, v, g, beta, h0 and results o, ht)."""
    xs = [torch.zeros(8, device="cuda", requires_grad=True) for _ in range(leaves)]
    ones = torch.ones(8, device="cuda")

    def step():
        outs = _Identity.apply(*xs)
        torch.autograd.backward(list(outs[:outputs]), [ones] * outputs)
        for t in xs:
            t.grad = None
    step()
    return host_us(step, calls)


def platform_floors(calls: int) -> dict:
    """What any library's call pays on this host before doing anything of its own: one torch.empty, one kernel
    launch (an in-place add on 8 floats), and the smallest autograd op (one leaf, one output) forward + backward."""
    dev = torch.device("cuda")
    x = torch.zeros(8, device=dev)
    return {"floor_empty_us": round(host_us(lambda: torch.empty(1 << 20, device=dev, dtype=torch.uint8), calls), 2),
            "floor_launch_us": round(host_us(lambda: x.add_(1), calls), 2),
            "floor_autograd_min_us": round(autograd_floor_us(max(1, calls // 3), 1, 1), 2)}


FIRST_CALL_ROW = "TP8|1x32768"


def row_key(row: BenchRow) -> str:
    return f"{row.model}|{row.label}"


def calls_of(x):
    """(forward, forward + backward, the leaves) of one shape's inputs: the forward under no_grad; the step with
    gradients on every input, then autograd.backward on o and the final state (the leaves' grads cleared after)."""
    leaves = [t.detach().requires_grad_(True) for t in (x.q, x.k, x.v, x.g, x.beta, x.h0)]

    def fwd():
        with torch.no_grad():
            return flash_qla.chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0,
                                                    output_final_state=True, cu_seqlens=x.cu_seqlens)

    def fwd_bwd():
        q, k, v, g, beta, h0 = leaves
        o, ht = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, scale=x.scale, initial_state=h0,
                                                 output_final_state=True, cu_seqlens=x.cu_seqlens)
        torch.autograd.backward([o, ht], [x.do, x.dht])
        for t in leaves:
            t.grad = None
    return fwd, fwd_bwd, leaves


def first_call() -> dict:
    """In this (fresh) process: the first forward, then the first forward + backward, each until the device is done
    (the kernel path's modules, the manifest, the cubins and the plans all load or record on first use). The inputs
    are made, the CUDA context created and torch's first backward (timed on its own) run before either."""
    torch.zeros(1, device="cuda")
    row = next(r for r in shapes("") if row_key(r) == FIRST_CALL_ROW)
    fwd, fwd_bwd, _ = calls_of(draw_inputs(row, "cuda"))
    torch.cuda.synchronize()
    out = {"row": FIRST_CALL_ROW}
    # torch's own first backward with output gradients, as below (its lazy imports: torch.fx's symbolic shapes and
    # sympy, ~0.8-2 s), paid by any library
    t = time.perf_counter()
    two = torch.ones(2, device="cuda", requires_grad=True) * 2
    torch.autograd.backward([two], [torch.ones_like(two)])
    torch.cuda.synchronize()
    out["torch_first_backward_ms"] = (time.perf_counter() - t) * 1e3
    for name, fn in (("fwd_ms", fwd), ("fwd_bwd_ms", fwd_bwd)):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t) * 1e3
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


def first_call_in_fresh_process() -> dict:
    r = subprocess.run([sys.executable, __file__, "--first-call"], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    if "--first-call" in sys.argv[1:]:
        print(json.dumps(first_call()))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=30,
                    help="calls queued per timing (forward + backward: a third); few enough that the launch queue "
                         "never fills")
    ap.add_argument("--rows", default="", help="only shapes whose key contains this")
    ap.add_argument("--profile", action="store_true", help="print each shape's cProfile (top functions by own time)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the layers of a call alone (allocation, validation, plan replay, backward)")
    args = ap.parse_args()
    first = first_call_in_fresh_process()
    print(json.dumps({"first_call": first}), flush=True)
    rows = []
    for row in shapes(args.rows):
        key = row_key(row)
        if args.rows and args.rows not in key:
            continue
        x = draw_inputs(row, "cuda")
        fwd, fwd_bwd, leaves = calls_of(x)
        for fn in (fwd, fwd_bwd):  # record the plans, load the kernels
            fn()
            fn()
        if args.profile:
            profile(fwd, args.calls, "forward")
            profile(fwd_bwd, max(1, args.calls // 3), "forward+backward")
        if args.breakdown:
            print(json.dumps(dict(shape=key, **breakdown(x, leaves, args.calls))), flush=True)
        before = plans.stats()
        r = dict(shape=key, tokens=row.tokens, seqs=len(row.seqlens), hq=row.hq, hv=row.hv,
                 fwd_host_us=round(host_us(fwd, args.calls), 2),
                 fwd_bwd_host_us=round(host_us(fwd_bwd, max(1, args.calls // 3)), 2))
        after = plans.stats()
        r["plans"] = {k: after.get(k, 0) - before.get(k, 0) for k in ("recorded", "replayed", "as_written")}
        print(json.dumps(r), flush=True)
        rows.append(r)
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "autograd_floor_us": round(autograd_floor_us(max(1, args.calls // 3)), 2),
           **platform_floors(args.calls), "first_call": first,
           "method": "CPU time per call of N calls queued behind a device sleep (median of 5 loops), plans recorded first",
           "rows": rows}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    worst = max(rows, key=lambda r: r["fwd_host_us"])
    worst_step = max(rows, key=lambda r: r["fwd_bwd_host_us"])
    print(f"max forward host cost {worst['fwd_host_us']} us ({worst['shape']}); max forward+backward "
          f"{worst_step['fwd_bwd_host_us']} us ({worst_step['shape']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
