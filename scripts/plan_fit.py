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
Least squares on relative error; prints each fit, its worst relative error and the planner's current values beside
it: copy the values into flash_qla/planner.py when they move.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from flash_qla.planner import FUSED_FIT_US, FUSED_PERSISTENT_CTAS, FUSED_STREAM_US

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


def fit(samples: list) -> tuple:
    """Least squares on relative error (each row divided by its time): the planner compares plans by ratio, so a
    short shape's 10% matters as much as a long one's. Returns the coefficients and the worst relative error."""
    a = torch.tensor([[x / s[-1] for x in s[:-1]] for s in samples], dtype=torch.float64)
    ones = torch.ones(len(samples), 1, dtype=torch.float64)
    coef = torch.linalg.lstsq(a, ones).solution.squeeze(1).tolist()
    worst = max(abs(sum(c * x for c, x in zip(coef, s[:-1])) - s[-1]) / s[-1] for s in samples)
    return coef, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", nargs="+")
    ap.add_argument("--sms", type=int, default=132, help="the card's SM count (H100 SXM: 132)")
    args = ap.parse_args()
    rows = []
    for name in args.sweeps:
        with open(name) as f:
            rows += [json.loads(line) for line in f if line.strip()]
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


if __name__ == "__main__":
    main()
