"""Batches of short sequences (the agentic prefill case): ours against FlashInfer and FlashQLA, side by side.

Each row is one varlen call of `seqs` sequences of `tokens_per_seq` tokens, at one of the standard matrix's forward
head configurations (K = V = 128, bf16, fp32 initial and final states). On such rows the state bytes (a 64 KB state
read and a 64 KB state written per sequence and v-head) dominate what moves through memory.

Subcommands (the GPU-machine steps of one sweep, then the merge here):
  matrix OUT.json                 the sweep as a matrix file in the peers' format: `python -m flash_qla.bench --matrix
                                  OUT.json --pass fwd` times ours, `.peers/run_peers.sh .peers qla OUT.json ...` and
                                  `run_peers.sh .peers fi ...` the peers, on the same seeded inputs
  profile --hq --hv --seqs --tokens [--v-first] [--calls N] [--split] [--fused-ctas N]
                                  runs one row's call N times (for ncu); --split prints each kernel's mean GPU time
                                  (torch.profiler) and the state bytes' rate; --fused-ctas pins gdn_fwd_fused's
                                  grid cap (A/B of the planner's choice)
  plans --out F [--shapes SUBSTRING] [--candidates PREFIXES]
                                  every sweep shape timed under each forward plan of scripts/plan_sweep.py (CUDA graph)
                                  and under the planner's choice: JSON lines in plan_sweep's schema, set "short"
                                  (bench/results/<card>/plan_sweep_short.jsonl, which tests/test_planner_short.py
                                  holds the planner to)
  merge --ours F [--peer LIB=F ...] [--source LIB=TEXT ...] --out short_batches.jsonl [--min-ratio R]
                                  one row per (lib, shape) {lib, model, hq, hv, seqs, tokens_per_seq, ms, eager_ms,
                                  state_GB, state_TBps} plus per shape ours over the best peer; exits 1 when a ratio
                                  (best peer's graph time / ours) is under --min-ratio
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Dict, List

MODELS = [["TP8", 2, 8], ["TP2", 8, 32], ["TP1-397B", 16, 64], ["2B-TP1", 16, 16]]  # the standard forward heads
SEQS = (16, 64, 256, 512)
TOKENS = (8, 16, 32, 64)
HEAD_DIM = 128


def label(seqs: int, tokens: int) -> str:
    return f"{seqs}x{tokens}"


def parse_label(text: str):
    seqs, tokens = text.split("x")
    return int(seqs), int(tokens)


def sweep_matrix(seqs=SEQS, tokens=TOKENS) -> dict:
    return {"about": "Batches of short sequences (scripts/short_batch_sweep.py): the standard forward head "
                     "configurations, each row N sequences of t tokens packed in one varlen call.",
            "head_dim": HEAD_DIM,
            "fwd": {"models": MODELS,
                    "seqs": [[label(n, t), [t] * n] for n in seqs for t in tokens]}}


def state_bytes(seqs: int, hv: int, head_dim: int = HEAD_DIM) -> int:
    """Initial states read plus final states written, fp32."""
    return 2 * seqs * hv * head_dim * head_dim * 4


def _lib(name: str) -> str:
    return {"flash_qla_aot": "ours", "flashinfer": "fi", "qla": "qla", "flash_qla": "qla"}.get(name, name)


def merge(ours: str, peers: Dict[str, str], sources: Dict[str, str] = None) -> List[dict]:
    """Rows of every library (graph ms preferred, eager when a library cannot be captured) and one comparison row per
    shape (lib "compare": ours over the best peer)."""
    by_shape: Dict[tuple, Dict[str, dict]] = defaultdict(dict)
    for lib, path in [("ours", ours)] + sorted(peers.items()):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line or not line.startswith("{"):
                    continue
                r = json.loads(line)
                if r.get("pass_", "fwd") != "fwd" or "x" not in str(r.get("seqs", "")):
                    continue
                n, t = parse_label(r["seqs"])
                ms = r.get("graph_ms") or r.get("eager_ms")
                if ms is None:
                    continue
                nbytes = state_bytes(n, r["hv"])
                row = {"lib": lib, "version": r.get("version"), "device": r.get("device"), "model": r["model"],
                       "hq": r["hq"], "hv": r["hv"], "seqs": n, "tokens_per_seq": t, "ms": ms,
                       "graph_ms": r.get("graph_ms"), "eager_ms": r.get("eager_ms"),
                       "state_GB": round(nbytes / 1e9, 4), "state_TBps": round(nbytes / (ms * 1e-3) / 1e12, 3)}
                if sources and lib in sources:
                    row["source"] = sources[lib]
                by_shape[(r["model"], r["hq"], r["hv"], n, t)][lib] = row
    out = []
    for key in sorted(by_shape, key=lambda k: ([m[0] for m in MODELS].index(k[0]) if k[0] in
                                               [m[0] for m in MODELS] else 99, k[3], k[4])):
        libs = by_shape[key]
        out.extend(libs[lib] for lib in sorted(libs))
        if "ours" in libs:
            peer_rows = [r for lib, r in libs.items() if lib != "ours"]
            if peer_rows:
                best = min(peer_rows, key=lambda r: r["ms"])
                out.append({"lib": "compare", "model": key[0], "hq": key[1], "hv": key[2], "seqs": key[3],
                            "tokens_per_seq": key[4], "ours_ms": libs["ours"]["ms"], "best_peer": best["lib"],
                            "best_peer_ms": best["ms"], "ratio": round(best["ms"] / libs["ours"]["ms"], 4)})
    return out


def summary(rows: List[dict]) -> dict:
    cmp_rows = [r for r in rows if r["lib"] == "compare"]
    if not cmp_rows:
        return {"rows": 0}
    ratios = [r["ratio"] for r in cmp_rows]
    prod = 1.0
    for x in ratios:
        prod *= x
    worst = min(cmp_rows, key=lambda r: r["ratio"])
    return {"rows": len(ratios), "ahead": sum(x > 1.0 for x in ratios), "min_ratio": min(ratios),
            "geomean_ratio": round(prod ** (1 / len(ratios)), 4),
            "worst": f"{worst['model']} {worst['seqs']}x{worst['tokens_per_seq']} vs {worst['best_peer']}"}


def _profile(args) -> None:
    import torch
    import flash_qla
    from flash_qla.tuning import settings
    settings.fused_ctas_max = args.fused_ctas
    from flash_qla.bench.inputs import draw_inputs
    from flash_qla.bench.matrix import BenchRow
    row = BenchRow("fwd", "profile", args.hq, args.hv, label(args.seqs, args.tokens), (args.tokens,) * args.seqs,
                   HEAD_DIM)
    x = draw_inputs(row, "cuda")
    h0 = x.h0.transpose(-1, -2).contiguous() if args.v_first else x.h0

    def call():
        return flash_qla.chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=h0,
                                                output_final_state=True, cu_seqlens=x.cu_seqlens,
                                                state_v_first=args.v_first)
    with torch.no_grad():
        for _ in range(3 if args.split else 0):
            call()
        torch.cuda.synchronize()
        if not args.split:
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
            return
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
    times: Dict[str, List[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            times[e.name].append(e.device_time)
    total = sum(sum(v) for v in times.values()) / args.calls
    nbytes = state_bytes(args.seqs, args.hv)
    rec = {"hq": args.hq, "hv": args.hv, "seqs": args.seqs, "tokens": args.tokens, "v_first": args.v_first,
           "kernels_us": {k[:60]: round(sum(v) / args.calls, 2) for k, v in times.items()},
           "total_us": round(total, 2), "state_TBps": round(nbytes / (total * 1e-6) / 1e12, 3)}
    print(json.dumps(rec), flush=True)


def _plans(args) -> int:
    import os
    import torch
    from flash_qla import plans
    from flash_qla.bench.inputs import draw_inputs
    from flash_qla.bench.matrix import BenchRow
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import plan_sweep
    device = torch.device("cuda")
    worst = 1.0
    with open(args.out, "w") as f:
        for model, hq, hv in MODELS:
            for n in SEQS:
                for t in TOKENS:
                    name = f"{model}|{label(n, t)}"
                    if args.shapes and args.shapes not in name:
                        continue
                    lens = (t,) * n
                    x = draw_inputs(BenchRow("fwd", model, hq, hv, label(n, t), lens, HEAD_DIM), "cuda")
                    times = {c: plan_sweep.time_plan(x, pins, device, False)
                             for c, pins in plan_sweep.candidates(hq, hv, lens, False).items()
                             if not args.candidates or any(c.startswith(w) for w in args.candidates.split(","))}
                    planned = plan_sweep.time_plan(x, {}, device, False)
                    best = min(times, key=times.get)
                    ratio = planned / min(times[best], planned)
                    worst = max(worst, ratio)
                    rec = dict(set="short", shape=name, hq=hq, hv=hv, tokens=n * t, seqs=n, equal_lengths=True,
                               l2norm=False, planned_ms=round(planned, 4), best=best, best_ms=round(times[best], 4),
                               ratio=round(ratio, 4), candidates={c: round(v, 4) for c, v in times.items()})
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    print(f"{name:22s} planned {planned:.4f} best {best} {times[best]:.4f} ratio {ratio:.3f}",
                          flush=True)
                    plans.clear()
                    del x
    print(f"worst planned / best: {worst:.3f}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("matrix")
    m.add_argument("out")
    m.add_argument("--seqs", default=",".join(map(str, SEQS)))
    m.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    pr = sub.add_parser("profile")
    pr.add_argument("--hq", type=int, default=16)
    pr.add_argument("--hv", type=int, default=32)
    pr.add_argument("--seqs", type=int, default=256)
    pr.add_argument("--tokens", type=int, default=8)
    pr.add_argument("--v-first", action="store_true")
    pr.add_argument("--calls", type=int, default=1)
    pr.add_argument("--split", action="store_true")
    pr.add_argument("--fused-ctas", type=int, default=None,
                    help="pin gdn_fwd_fused's persistent grid cap (tuning.fused_ctas_max; default: the planner's)")
    pl = sub.add_parser("plans")
    pl.add_argument("--out", required=True)
    pl.add_argument("--shapes", default="")
    pl.add_argument("--candidates", default="", help="comma-separated name prefixes (default: every plan)")
    mg = sub.add_parser("merge")
    mg.add_argument("--ours", required=True)
    mg.add_argument("--peer", action="append", default=[], help="LIB=FILE (qla, fi)")
    mg.add_argument("--out", required=True)
    mg.add_argument("--min-ratio", type=float, default=None)
    mg.add_argument("--source", action="append", default=[],
                    help="LIB=TEXT: where a library's rows come from (commit, call, card), kept in its rows")
    args = p.parse_args(argv)
    if args.cmd == "matrix":
        seqs = [int(s) for s in args.seqs.split(",")]
        tokens = [int(t) for t in args.tokens.split(",")]
        with open(args.out, "w") as f:
            json.dump(sweep_matrix(seqs, tokens), f, indent=1)
        return 0
    if args.cmd == "profile":
        _profile(args)
        return 0
    if args.cmd == "plans":
        return _plans(args)
    peers = {}
    for spec in args.peer:
        if "=" not in spec:
            raise SystemExit(f"--peer takes LIB=FILE, got {spec!r}")
        lib, path = spec.split("=", 1)
        peers[lib] = path
    rows = merge(args.ours, peers, dict(spec.split("=", 1) for spec in args.source))
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    s = summary(rows)
    print(json.dumps(s))
    if args.min_ratio is not None and s.get("rows") and s["min_ratio"] < args.min_ratio:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
