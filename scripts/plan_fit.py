"""Refit the forward planner's per-chunk / per-chain kernel times from a plan sweep (any machine, no GPU).

usage: python scripts/plan_fit.py SWEEP.jsonl [SWEEP.jsonl ...] [--sms 132]
  e.g. bench/results/h100/plan_sweep.jsonl bench/results/h100/plan_sweep_short.jsonl

Reads the rows of scripts/plan_sweep.py and `short_batch_sweep.py plans` (equal lengths, no l2norm) and fits, per V
block, the two models of the fused kernel that planner.plan_forward uses:
  FUSED_FIT_US (per_chunk, per_chain), up to FUSED_PERSISTENT_CTAS items (multi-chunk rows of the grid and standard
    sets): time = rounds x (chunks x per_chunk + per_chain), rounds = ceil(items / SMs), items = sequences x v-heads
    x V / BV, chunks = each sequence's 64-token chunks;
  FUSED_STREAM_US (a, b, ramp), past it, fitted on batches of one-chunk sequences (the planner adds the full
    chunks' per_chunk time for longer ones): time = ceil(items / SMs) x (a + b x fill)
    + ceil(min(items, FUSED_PERSISTENT_CTAS) / SMs) x ramp, fill = the chunk's tokens / 64.
  CP_FIT_US, intra-card CP's time beyond its gdn_prepare over planner.cp_features (every timed cp_L candidate of
    the grid, holdout and standard sets).
Least squares on relative error; prints each fit, its worst relative error and the planner's current values beside
it: copy the values into flash_qla/planner.py when they move.

--check [--host-lengths]: instead, the planner as it now stands (flash_qla/planner.py, the built variants) against
the sweeps' timed candidates: for every row, the plan it picks and that plan's time over the row's best, and the
rows beyond --tolerance (exit 1 if any). A row's lengths come from scripts/plan_sweep.py's shape sets: by default the
planner sees equal lengths, as the sweep's calls (no cu_seqlens_cpu); --host-lengths gives it the longest sequence,
as a caller passing cu_seqlens_cpu does. A refit can be judged this way before the next sweep on a GPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

from flash_qla.planner import (CP_FIT_US, FUSED_FIT_US, FUSED_PERSISTENT_CTAS, FUSED_STREAM_US, ForwardPlan,
                                cp_features, cp_prepare_us, plan_forward)

HEAD_DIM_V = 128  # the sweep's shapes (plan_sweep.py: K = V = 128)


def fused_samples(rows: list, bv: int, sms: int) -> list:
    """(rounds x chunks, rounds, measured us) of the fused candidate at block bv on the rows the model covers."""
    out = []
    for r in rows:
        ms = r["candidates"].get(f"fused_bv{bv}")
        if ms is None or not r["equal_lengths"] or r["l2norm"] or r["set"] not in ("grid", "standard"):
            continue
        items = r["seqs"] * r["hv"] * (HEAD_DIM_V // bv)
        chunks = math.ceil(r["tokens"] / r["seqs"] / 64)
        if items > FUSED_PERSISTENT_CTAS or chunks < 2:  # the streaming model (FUSED_STREAM_US) covers those
            continue
        rounds = math.ceil(items / sms)
        out.append((rounds * chunks, rounds, ms * 1000.0))
    return out


def stream_samples(rows: list, bv: int, sms: int) -> list:
    """(rounds, rounds x fill, ramp rounds, measured us) of the one-chunk batches past the persistent limit."""
    out = []
    for r in rows:
        ms = r["candidates"].get(f"fused_bv{bv}")
        if ms is None or not r["equal_lengths"] or r["l2norm"]:
            continue
        items = r["seqs"] * r["hv"] * (HEAD_DIM_V // bv)
        if items <= FUSED_PERSISTENT_CTAS or r["tokens"] > 64 * r["seqs"]:  # one-chunk batches (the fit's)
            continue
        fill = r["tokens"] / r["seqs"] / 64
        rounds = math.ceil(items / sms)
        ramp = math.ceil(min(items, FUSED_PERSISTENT_CTAS) / sms)
        out.append((rounds, rounds * fill, ramp, ms * 1000.0))
    return out


def cp_samples(rows: list, sms: int) -> list:
    """(cp_features..., gdn_prepare's predicted time, the timed total) of every timed CP candidate of an equal-length
    row without l2norm."""
    chain_blocks = built(False)[1]
    out = []
    for r in rows:
        if not r["equal_lengths"] or r["l2norm"] or r["set"] == "short":
            continue
        prepare = cp_prepare_us(r["tokens"], r["seqs"], r["hv"], r["hq"], sms)
        for name, ms in r["candidates"].items():
            if not name.startswith("cp_L") or ms is None:
                continue
            L = int(name[4:])
            features = cp_features(r["tokens"], r["seqs"], r["hv"], r["hq"], HEAD_DIM_V, sms, chain_blocks, L)
            out.append((*features, prepare, ms * 1000.0))
    return out


def fit(samples: list, known: bool = False) -> tuple:
    """Least squares on relative error (each row divided by its time): the planner compares plans by ratio, so a
    short shape's 10% matters as much as a long one's. A sample is (features..., time), or with known (features...,
    a predicted part outside the fit, time). Returns the coefficients and the worst relative error."""
    n = len(samples[0]) - (2 if known else 1)
    base = [s[n] if known else 0.0 for s in samples]
    a = torch.tensor([[x / s[-1] for x in s[:n]] for s in samples], dtype=torch.float64)
    b = torch.tensor([[(s[-1] - k) / s[-1]] for s, k in zip(samples, base)], dtype=torch.float64)
    coef = torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()
    worst = max(abs(k + sum(c * x for c, x in zip(coef, s[:n])) - s[-1]) / s[-1] for s, k in zip(samples, base))
    return coef, worst


def candidate_name(plan: ForwardPlan) -> str:
    """The sweep's name of a plan (scripts/plan_sweep.py's candidates)."""
    if plan.path == "fused":
        return f"fused_bv{plan.block_v}"
    if plan.path == "split":
        return f"split_bv{plan.block_v}_hpc{plan.heads_per_cta}"
    return f"cp_L{plan.segment_chunks}"


def sweep_lengths() -> dict:
    """shape name -> sequence lengths, from scripts/plan_sweep.py's shape sets."""
    spec = importlib.util.spec_from_file_location("plan_sweep", Path(__file__).resolve().parent / "plan_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return {name: tuple(lens) for which in ("grid", "holdout", "standard")
            for name, _, _, _, lens in sweep.shapes(which)}


def check(rows: list, sms: int, host_lengths: bool, blocks, lengths: dict) -> list:
    """(ratio, row, chosen candidate) for every row whose chosen plan was timed: the planner's choice over the best.
    blocks(l2norm) -> (fused blocks, chain blocks) built."""
    from flash_qla import cp
    out = []
    for r in rows:
        lens = lengths.get(r["shape"])
        longest = max(lens) if host_lengths and lens and len(set(lens)) > 1 else None
        fused, chain = blocks(r["l2norm"])
        plan = plan_forward(r["tokens"], r["seqs"], r["hv"], r["hq"], HEAD_DIM_V, sms, fused, chain,
                            cp.SEGMENT_CHUNKS, r["l2norm"], longest=longest)
        name = candidate_name(plan)
        if name in r["candidates"]:
            out.append((r["candidates"][name] / r["best_ms"], r, name))
    return out


def built(l2norm: bool) -> tuple:
    from flash_qla.launch import CHAIN_KERNEL, FUSED_KERNEL, built_blocks
    return (tuple(built_blocks(FUSED_KERNEL, None, "bf16", 128, HEAD_DIM_V, int(l2norm))),
            tuple(built_blocks(CHAIN_KERNEL, "out", "bf16", 128, HEAD_DIM_V)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", nargs="+")
    ap.add_argument("--sms", type=int, default=132, help="the card's SM count (H100 SXM: 132)")
    ap.add_argument("--check", action="store_true", help="the planner's choices against the sweeps (no fit)")
    ap.add_argument("--host-lengths", action="store_true", help="with --check: plan from the longest sequence")
    ap.add_argument("--tolerance", type=float, default=0.03)
    args = ap.parse_args()
    rows = []
    for name in args.sweeps:
        with open(name) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    if args.check:
        results = check(rows, args.sms, args.host_lengths, built, sweep_lengths())
        over = sorted((x for x in results if x[0] > 1 + args.tolerance), key=lambda x: -x[0])
        for ratio, r, name in over:
            print(f"{ratio:.3f}  {r['set']} {r['shape']} l2norm={r['l2norm']}: planned {name} "
                  f"{r['candidates'][name]:.4f} ms, best {r['best']} {r['best_ms']:.4f} ms")
        print(f"{len(results) - len(over)} of {len(results)} rows within {args.tolerance:.0%} of their best plan "
              f"({len(rows) - len(results)} rows without the chosen plan timed)")
        sys.exit(1 if over else 0)
    for bv in sorted(FUSED_FIT_US):
        samples = fused_samples(rows, bv, args.sms)
        if len(samples) < 2:
            print(f"BV {bv}: {len(samples)} usable rows, no fit")
            continue
        (c, f), worst = fit(samples)
        print(f"FUSED_FIT_US[{bv}] = ({c:.3f}, {f:.2f}) over {len(samples)} rows (worst error {worst:.1%}); "
              f"planner now {FUSED_FIT_US[bv]}")
        samples = stream_samples(rows, bv, args.sms)
        if len(samples) < 3:
            continue
        coef, worst = fit(samples)
        print(f"FUSED_STREAM_US[{bv}] = ({coef[0]:.3f}, {coef[1]:.3f}, {coef[2]:.3f}) over {len(samples)} rows "
              f"(worst error {worst:.1%}); planner now {FUSED_STREAM_US.get(bv)}")
    samples = cp_samples(rows, args.sms)
    if len(samples) > len(CP_FIT_US):
        coef, worst = fit(samples, known=True)
        print(f"CP_FIT_US = ({', '.join(f'{c:.3f}' for c in coef)}) over {len(samples)} CP candidates "
              f"(worst error {worst:.1%}); planner now {CP_FIT_US}")


if __name__ == "__main__":
    main()
