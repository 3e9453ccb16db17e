"""Recurrent-state input / output of a call, timed: the state layout and the state pool against gather + scatter.

Per case (sequences x tokens, heads, K = V = 128, bf16, float32 states) and mode, the call's CUDA-graph time and its
eager time (flash_qla.bench.timing: the peers' do_bench rules, cold L2):
  k_first         initial_state [N, Hv, K, V], output_final_state=True: the plain call.
  v_first         the same states stored [N, Hv, V, K], state_v_first=True (FLA's / FlashInfer's layout).
  gather_scatter  a pool [S, Hv, K, V] used as vLLM does: h0 = pool[idx]; call; pool[idx] = final state.
  pool            the same pool passed as initial_state with initial_state_indices=idx and inplace_update=True
                  (SGLang's spelling): the call reads and writes the slots itself.
  pool_v_first    pool, with a [S, Hv, V, K] pool and state_v_first=True.
With --backward, k_first and v_first are also timed forward + backward (gradients on every input and the state).
--level api (default) times flash_qla.chunk_gated_delta_rule; --level kernels times flash_qla.forward.forward /
backward.backward on prepared inputs with the kernels' own state I/O (forward(state_io=...)), i.e. what the API runs
once its plan is recorded, without the API's host path; gather_scatter is then torch's gather + forward + scatter.
Each row states the state bytes the mode moves through memory (a state read or written once is 4 K V bytes per
(sequence, head)); the comparison block gives V-first's cost over K-first and what the pool saves against gather +
scatter, in time and bytes, with the bandwidth that saving implies next to a plain device copy's.

usage (GPU machine, repository root):
  python scripts/state_io_bench.py --out bench/results/h100/state_io.json [--cases 256x8,8x2048] [--hq 16 --hv 32]
      [--backward] [--level api|kernels] [--commit SHA]
Writes {"device", "commit", "torch", "rows": [...], "comparisons": [...]}.
"""
from __future__ import annotations

import argparse
import json
import platform

import torch

import flash_qla
from flash_qla.bench.timing import eager_counts, eager_median_ms, graph_median_ms, prepare_device

MODES = ("k_first", "v_first", "gather_scatter", "pool", "pool_v_first")
# state reads + writes per sequence and head, in states: the call's read and write, plus the gather's read and
# write of a copy and the scatter's read and write
STATE_MOVES = {"k_first": 2, "v_first": 2, "gather_scatter": 6, "pool": 2, "pool_v_first": 2}


def parse_case(text: str):
    seqs, tokens = (int(x) for x in text.split("x"))
    return seqs, tokens


def make_inputs(seqs: int, tokens: int, hq: int, hv: int, K: int, V: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, dev, bf16 = seqs * tokens, "cuda", torch.bfloat16
    q = torch.nn.functional.normalize(torch.randn(1, T, hq, K, device=dev, generator=gen), dim=-1).to(bf16)
    k = torch.nn.functional.normalize(torch.randn(1, T, hq, K, device=dev, generator=gen), dim=-1).to(bf16)
    v = torch.randn(1, T, hv, V, device=dev, generator=gen).to(bf16)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, hv, device=dev, generator=gen))
    beta = torch.rand(1, T, hv, device=dev, generator=gen)
    cu = torch.arange(0, T + 1, tokens, dtype=torch.int32, device=dev)
    slots = 2 * seqs  # a pool twice the batch, the batch's slots scattered over it
    idx = torch.randperm(slots, device=dev, generator=gen)[:seqs].to(torch.int32)
    pool = torch.randn(slots, hv, K, V, device=dev, generator=gen) * 0.1
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu=cu, idx=idx, pool=pool)


def forward_call(mode: str, x: dict):
    """A no-argument callable running one forward of `mode` (no autograd)."""
    q, k, v, g, beta, cu, idx = (x[n] for n in ("q", "k", "v", "g", "beta", "cu", "idx"))
    if mode in ("k_first", "v_first"):
        h0 = x["pool"].index_select(0, idx.long())
        if mode == "v_first":
            h0 = h0.transpose(-1, -2).contiguous()

        def run():
            return flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                    cu_seqlens=cu, state_v_first=mode == "v_first")
        return run
    if mode == "gather_scatter":
        pool, rows = x["pool"], idx.long()

        def run():
            o, ht = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool[rows],
                                                     output_final_state=True, cu_seqlens=cu)
            pool[rows] = ht
            return o
        return run
    pool = x["pool"] if mode == "pool" else x["pool"].transpose(-1, -2).contiguous()

    def run():
        o, _ = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, initial_state_indices=idx,
                                                inplace_update=True, cu_seqlens=cu, state_v_first=mode != "pool")
        return o
    return run


def kernel_forward_call(mode: str, x: dict):
    """forward_call at the kernels' level: flash_qla.forward.forward with the kernels' state I/O."""
    from flash_qla import forward as fwd
    from flash_qla.states import StateIO
    from flash_qla.validation import validate_inputs
    q, k, v, g, beta, cu, idx = (x[n] for n in ("q", "k", "v", "g", "beta", "cu", "idx"))
    problem = validate_inputs(q, k, v, g, beta, None, None, cu)
    rows = idx.long()

    def call(h0, final, io=StateIO()):
        return fwd.forward(problem, q, k, v, g, beta, h0, final, cu, False, state_io=io)
    if mode in ("k_first", "v_first"):
        h0 = x["pool"].index_select(0, rows)
        if mode == "v_first":
            h0 = h0.transpose(-1, -2).contiguous()
        io = StateIO(v_first=mode == "v_first")
        return lambda: call(h0, True, io)[0]
    if mode == "gather_scatter":
        pool = x["pool"]

        def run():
            o, ht, _, _ = call(pool[rows], True)
            pool[rows] = ht
            return o
        return run
    pool = x["pool"] if mode == "pool" else x["pool"].transpose(-1, -2).contiguous()
    io = StateIO(v_first=mode != "pool", index=idx, pool_read=True, write=pool)
    return lambda: call(pool, False, io)[0]


def kernel_backward_call(mode: str, x: dict):
    """backward_call at the kernels' level: flash_qla.backward.backward (v_first reads h0 / dht and writes dh0
    V-first)."""
    from flash_qla import backward as bwd
    from flash_qla.validation import validate_inputs
    q, k, v, g, beta, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "cu"))
    problem = validate_inputs(q, k, v, g, beta, None, None, cu)
    h0 = x["pool"].index_select(0, x["idx"].long())
    if mode == "v_first":
        h0 = h0.transpose(-1, -2).contiguous()
    do, dht = torch.randn_like(v), torch.randn_like(h0)
    return lambda: bwd.backward(problem, q, k, v, g, beta, h0, cu, False, do, dht, v_first=mode == "v_first")


def backward_call(mode: str, x: dict):
    """Forward + backward with gradients on q, k, v, g, beta and the initial state."""
    h0 = x["pool"].index_select(0, x["idx"].long())
    if mode == "v_first":
        h0 = h0.transpose(-1, -2).contiguous()
    leaves = [t.detach().requires_grad_(True) for t in (x["q"], x["k"], x["v"], x["g"], x["beta"], h0)]
    do = torch.randn_like(x["v"])
    dht = torch.randn_like(h0)

    def run():
        o, ht = flash_qla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                                 cu_seqlens=x["cu"], state_v_first=mode == "v_first")
        return torch.autograd.grad([o, ht], leaves, [do, dht])
    return run


def time_call(fn, device) -> dict:
    warm, iters = eager_counts(fn, device)
    eager = eager_median_ms(fn, device, warm, iters)
    graph, why = graph_median_ms(fn, device)
    return {"graph_ms": graph, "graph_error": why, "eager_ms": eager}


def copy_bandwidth(nbytes: int, device) -> float:
    """GB/s of a plain device-to-device copy of nbytes (read + write counted), graph-timed."""
    a = torch.empty(nbytes // 4, device=device)
    b = torch.empty_like(a)
    ms, _ = graph_median_ms(lambda: b.copy_(a), device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="256x8,8x2048")
    p.add_argument("--hq", type=int, default=16)
    p.add_argument("--hv", type=int, default=32)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--backward", action="store_true")
    p.add_argument("--level", choices=("api", "kernels"), default="api")
    p.add_argument("--commit", default=None, help="the commit these kernels are from (label only)")
    args = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    prepare_device(dev)
    rows, comparisons = [], []
    for case in args.cases.split(","):
        seqs, tokens = parse_case(case)
        state_bytes = seqs * args.hv * args.K * args.V * 4
        got = {}
        for mode in args.modes.split(","):
            x = make_inputs(seqs, tokens, args.hq, args.hv, args.K, args.V)
            with torch.no_grad():
                r = time_call((kernel_forward_call if args.level == "kernels" else forward_call)(mode, x), dev)
            r.update(level=args.level, case=case, seqs=seqs, tokens=tokens, hq=args.hq, hv=args.hv, K=args.K,
                     V=args.V, pass_="fwd", mode=mode, state_bytes_moved=STATE_MOVES[mode] * state_bytes)
            rows.append(r)
            got[("fwd", mode)] = r
            print(json.dumps(r), flush=True)
        if args.backward:
            bpass = "bwd" if args.level == "kernels" else "fwd+bwd"  # backward.backward alone at the kernels' level
            for mode in ("k_first", "v_first"):
                x = make_inputs(seqs, tokens, args.hq, args.hv, args.K, args.V)
                if args.level == "kernels":
                    with torch.no_grad():
                        r = time_call(kernel_backward_call(mode, x), dev)
                else:
                    r = time_call(backward_call(mode, x), dev)
                r.update(level=args.level, case=case, seqs=seqs, tokens=tokens, hq=args.hq, hv=args.hv, K=args.K,
                         V=args.V, pass_=bpass, mode=mode)
                rows.append(r)
                got[(bpass, mode)] = r
                print(json.dumps(r), flush=True)
        bw = copy_bandwidth(state_bytes, dev)
        for pass_ in ("fwd", "fwd+bwd", "bwd"):
            a, b = got.get((pass_, "k_first")), got.get((pass_, "v_first"))
            if a and b:
                comparisons.append({"level": args.level, "case": case, "pass": pass_, "what": "v_first over k_first",
                                    "graph_ratio": b["graph_ms"] / a["graph_ms"] if a["graph_ms"] else None,
                                    "eager_ratio": b["eager_ms"] / a["eager_ms"]})
        gs, pool = got.get(("fwd", "gather_scatter")), got.get(("fwd", "pool"))
        if gs and pool and gs["graph_ms"] and pool["graph_ms"]:
            saved = gs["state_bytes_moved"] - pool["state_bytes_moved"]
            dt = (gs["graph_ms"] - pool["graph_ms"]) * 1e-3
            comparisons.append({"level": args.level, "case": case, "pass": "fwd",
                                "what": "pool against gather + call + scatter",
                                "graph_ms_saved": gs["graph_ms"] - pool["graph_ms"],
                                "eager_ms_saved": gs["eager_ms"] - pool["eager_ms"], "bytes_saved": saved,
                                "implied_GBps": saved / dt / 1e9 if dt > 0 else None,
                                "copy_GBps": bw,
                                "time_for_saved_bytes_at_copy_bandwidth_ms": saved / (bw * 1e9) * 1e3})
        for c in comparisons:
            if c["case"] == case:
                print(json.dumps(c), flush=True)
    out = {"device": torch.cuda.get_device_name(dev), "commit": args.commit, "torch": torch.__version__,
           "python": platform.python_version(), "rows": rows, "comparisons": comparisons}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
