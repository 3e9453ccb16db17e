"""Refit the forward planner's kernel-time models from plan sweeps (any machine, no GPU).

usage: python scripts/plan_fit.py SWEEP.jsonl [SWEEP.jsonl ...] [--sms 132]
  e.g. bench/results/h100/plan_sweep.jsonl bench/results/h100/plan_sweep_l2norm.jsonl
       bench/results/h100/plan_sweep_short.jsonl

Reads the rows of scripts/plan_sweep.py and `short_batch_sweep.py plans` and fits, by least squares on relative error:
  FUSED_FIT_US (per_chunk, per_chain) per V block, up to FUSED_PERSISTENT_CTAS items (multi-chunk equal-length rows of
    the grid and standard sets): time = rounds x (chunks x per_chunk + per_chain), rounds = ceil(items / SMs), items =
    sequences x v-heads x V / BV, chunks = each sequence's 64-token chunks;
  FUSED_STREAM_US (a, b, ramp, per_chunk), past it: time = ceil(items / SMs) x (a + b x the last chunk's fill +
    per_chunk x the chunks before it) + ceil(min(items, FUSED_PERSISTENT_CTAS) / SMs) x ramp;
  L2NORM_FUSED_FIT_US and L2NORM_STREAM_US, the same over the l2norm rows (the l2norm build);
  CHAIN_FIT_US, gdn_fwd_chain's (per chunk, per chain) per V block in the split plan beyond its gdn_prepare part as
    predicted, over the plain multi-chunk rows; then L2NORM_SHORT_FILL_US, the split plan's term on l2norm batches of
    one-chunk sequences beyond prepare and chain;
  CP_FIT_US, intra-card CP's time beyond its gdn_prepare over planner.cp_features (every timed cp_L candidate of the
    grid, holdout and standard sets).
Each fit prints its worst relative error and the planner's current values beside it: copy the values into
flash_qla/planner.py when they move (CHAIN_FIT_US first: the fill term is fitted beyond it).

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

from flash_qla.planner import (CHAIN_FIT_US, CP_FIT_US, CP_FUSED_US, FUSED_FIT_US, FUSED_PERSISTENT_CTAS,
                               FUSED_STREAM_US, L2NORM_FUSED_FIT_US, L2NORM_PREPARE_US, L2NORM_SHORT_FILL_US, L2NORM_STREAM_US,
                               PREPARE_FIT_US, PRENORM_US, ForwardPlan, cheaper_l2norm, cp_features, cp_fused_parts, cp_prepare_us, plan_forward,
                               prenorm_mb, prepare_features, short_fill_features)

HEAD_DIM_V = 128  # the sweep's shapes (plan_sweep.py: K = V = 128)
# The CP fits below weigh the candidates within NEAR_BEST of their row's best, among which the planner chooses: fitted
# over every L, the fused-CP model was 3-5% off near the best plans (far candidates, L = 8 on long sequences at 15-35%,
# pulled it), 363 against 355 of 396 sweep rows within 3% of their best. The plain split-CP terms keep their fit over
# every candidate: refitted near the best they planned TP8 1x2048 on the split kernels at 1.11x its best
NEAR_BEST = 1.25


def fused_samples(rows: list, bv: int, sms: int, l2norm: bool = False) -> list:
    """(rounds x chunks, rounds, measured us) of the fused candidate at block bv on the rows the model covers."""
    out = []
    for r in rows:
        ms = r["candidates"].get(f"fused_bv{bv}")
        if ms is None or not r["equal_lengths"] or r["l2norm"] != l2norm or r["set"] not in ("grid", "standard"):
            continue
        items = r["seqs"] * r["hv"] * (HEAD_DIM_V // bv)
        chunks = math.ceil(r["tokens"] / r["seqs"] / 64)
        if items > FUSED_PERSISTENT_CTAS or chunks < 2:  # the streaming model (FUSED_STREAM_US) covers those
            continue
        rounds = math.ceil(items / sms)
        out.append((rounds * chunks, rounds, ms * 1000.0))
    return out


def stream_samples(rows: list, bv: int, sms: int, l2norm: bool = False) -> list:
    """(rounds, rounds x the last chunk's fill, ramp rounds, rounds x the chunks before it, measured us) of the
    equal-length batches past the persistent limit."""
    out = []
    for r in rows:
        ms = r["candidates"].get(f"fused_bv{bv}")
        if ms is None or not r["equal_lengths"] or r["l2norm"] != l2norm:
            continue
        items = r["seqs"] * r["hv"] * (HEAD_DIM_V // bv)
        if items <= FUSED_PERSISTENT_CTAS:
            continue
        mean = r["tokens"] / r["seqs"]
        chunks = math.ceil(mean / 64)
        fill = (mean - 64 * (chunks - 1)) / 64
        rounds = math.ceil(items / sms)
        ramp = math.ceil(min(items, FUSED_PERSISTENT_CTAS) / sms)
        out.append((rounds, rounds * fill, ramp, rounds * (chunks - 1), ms * 1000.0))
    return out


def cp_samples(rows: list, sms: int, l2norm: bool = False) -> list:
    """CP candidates of the equal-length rows: without l2norm every timed one, (cp_features' first six, gdn_prepare's
    predicted time, the timed total); with l2norm those within NEAR_BEST of their row's best, (the l2norm feature,
    gdn_prepare's predicted time + the plain terms at CP_FIT_US, the timed total)."""
    chain_blocks = built(False)[1]
    out = []
    for r in rows:
        if not r["equal_lengths"] or r["l2norm"] != l2norm or r["set"] == "short":
            continue
        prepare = cp_prepare_us(r["tokens"], r["seqs"], r["hv"], r["hq"], sms, l2norm)
        for name, ms in r["candidates"].items():
            if not name.startswith("cp_L") or ms is None or (l2norm and ms > NEAR_BEST * r["best_ms"]):
                continue
            L = int(name[4:])
            features = cp_features(r["tokens"], r["seqs"], r["hv"], r["hq"], HEAD_DIM_V, sms, chain_blocks, L, None, 128,
                                   l2norm)
            if l2norm:
                known = prepare + sum(a * x for a, x in zip(CP_FIT_US[:6], features[:6]))
                out.append((features[6], known, ms * 1000.0))
            else:
                out.append((*features[:6], prepare, ms * 1000.0))
    return out


def cp_fused_samples(rows: list, sms: int) -> list:
    """(cp_fused_parts' features..., its out pass's predicted time, the timed total) of the CP-on-the-fused-kernel
    candidates (cpf_L*) of the equal-length rows within NEAR_BEST of their row's best."""
    out = []
    for r in rows:
        if not r["equal_lengths"] or r["set"] == "short":
            continue
        fused = built(r["l2norm"])[0]
        for name, ms in r["candidates"].items():
            if not name.startswith("cpf_L") or ms is None or ms > NEAR_BEST * r["best_ms"]:
                continue
            predicted, _, features = cp_fused_parts(r["tokens"], r["seqs"], r["hv"], r["hq"], 128, HEAD_DIM_V, sms,
                                                    fused, int(name[5:]), r["l2norm"])
            out.append((*features, predicted, ms * 1000.0))
    return out


def split_samples(rows: list, sms: int, one_chunk: bool, chain_fit: dict) -> list:
    """Every timed split candidate (gdn_prepare + gdn_fwd_chain) of the equal-length rows, gdn_prepare's part as the
    planner predicts it (PREPARE_FIT_US, L2NORM_PREPARE_US: its kernel has not changed since their fit; fitting them
    beside the chain placed 9 more rows of the sweeps beyond 3%). one_chunk False: the plain rows of two chunks or
    more, (per chain block (rounds x chunks, rounds) (2 x 2), the prepare part, the timed total), CHAIN_FIT_US's
    coefficients; True: the l2norm batches of one-chunk sequences, (short_fill_features, the prepare and chain parts
    (chain_fit's), the timed total), L2NORM_SHORT_FILL_US's. (The chain fitted on all of them at once placed 8 more
    rows beyond 3%; the same fill term for plain batches fitted below zero and moved no plan.)"""
    prepare_coefficients = PREPARE_FIT_US + (L2NORM_PREPARE_US,)
    out = []
    for r in rows:
        chunks = math.ceil(r["tokens"] / r["seqs"] / 64)
        if not r["equal_lengths"] or (chunks == 1) != one_chunk or r["l2norm"] != one_chunk:
            continue
        for name, ms in r["candidates"].items():
            if not name.startswith("split_bv") or ms is None:
                continue
            bv, hpc = (int(x) for x in name[len("split_bv"):].split("_hpc"))
            rounds = math.ceil(r["seqs"] * r["hv"] * (HEAD_DIM_V // bv) / sms)
            prepare = prepare_features(chunks, r["seqs"], r["hv"], r["hq"], hpc, sms, r["l2norm"])
            known = sum(a * x for a, x in zip(prepare_coefficients, prepare))
            if not one_chunk:
                chain = [0.0] * 4
                chain[2 * (bv == 128)], chain[2 * (bv == 128) + 1] = rounds * chunks, rounds
                out.append((*chain, known, ms * 1000.0))
                continue
            c, f = chain_fit[bv]
            out.append((*short_fill_features(r["tokens"], r["seqs"], r["hv"], sms), known + rounds * (c + f),
                        ms * 1000.0))
    return out


def prenorm_samples(rows: list) -> list:
    """(1, megabytes gdn_l2norm moves, the pass's time in us) of every pn_ candidate of an l2norm row whose plain plan
    was timed in the plain sweep's row of the same set and shape: the pn_ time less that plan's."""
    plain = {(r["set"], r["shape"]): r for r in rows if not r["l2norm"]}
    out = []
    for r in rows:
        base = plain.get((r["set"], r["shape"]))
        if not r["l2norm"] or base is None:
            continue
        for name, ms in r["candidates"].items():
            if name.startswith("pn_") and ms is not None and base["candidates"].get(name[3:]) is not None:
                out.append((1.0, prenorm_mb(r["tokens"], r["hq"], 128), (ms - base["candidates"][name[3:]]) * 1000.0))
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
    if plan.prenorm:
        return "pn_" + candidate_name(plan._replace(prenorm=False))
    if plan.path == "fused":
        return f"fused_bv{plan.block_v}"
    if plan.path == "split":
        return f"split_bv{plan.block_v}_hpc{plan.heads_per_cta}"
    if plan.path == "cp_fused":
        return f"cpf_L{plan.segment_chunks}"
    return f"cp_L{plan.segment_chunks}"


def sweep_lengths() -> dict:
    """shape name -> sequence lengths, from scripts/plan_sweep.py's shape sets."""
    spec = importlib.util.spec_from_file_location("plan_sweep", Path(__file__).resolve().parent / "plan_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return {name: tuple(lens) for which in sweep.SETS
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
        if r["l2norm"] and any(n.startswith("pn_") for n in r["candidates"]):  # the sweep timed the gdn_l2norm pass
            plain = plan_forward(r["tokens"], r["seqs"], r["hv"], r["hq"], HEAD_DIM_V, sms, blocks(False)[0], chain,
                                 cp.SEGMENT_CHUNKS, False, longest=longest)
            plan = cheaper_l2norm(plan, plain, r["tokens"], r["hq"], 128)
        name = candidate_name(plan)
        if name in r["candidates"]:
            out.append((r["candidates"][name] / r["best_ms"], r, name))
    return out


def built(l2norm: bool) -> tuple:
    from flash_qla.launch import CHAIN_KERNEL, FUSED_KERNEL, built_blocks
    return (tuple(built_blocks(FUSED_KERNEL, "out", "bf16", 128, HEAD_DIM_V, int(l2norm))),
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
    for l2norm, names, chunk_table, stream_table in (
            (False, ("FUSED_FIT_US", "FUSED_STREAM_US"), FUSED_FIT_US, FUSED_STREAM_US),
            (True, ("L2NORM_FUSED_FIT_US", "L2NORM_STREAM_US"), L2NORM_FUSED_FIT_US, L2NORM_STREAM_US)):
        for bv in sorted(chunk_table):
            samples = fused_samples(rows, bv, args.sms, l2norm)
            if len(samples) < 2:
                print(f"{names[0]}[{bv}]: {len(samples)} usable rows, no fit")
                continue
            (c, f), worst = fit(samples)
            print(f"{names[0]}[{bv}] = ({c:.3f}, {f:.2f}) over {len(samples)} rows (worst error {worst:.1%}); "
                  f"planner now {chunk_table[bv]}")
            samples = stream_samples(rows, bv, args.sms, l2norm)
            if len(samples) < 3:
                continue
            coef, worst = fit(samples)
            print(f"{names[1]}[{bv}] = ({', '.join(f'{c:.3f}' for c in coef)}) over {len(samples)} rows "
                  f"(worst error {worst:.1%}); planner now {stream_table.get(bv)}")
    (c64, f64, c128, f128), worst = fit(split_samples(rows, args.sms, False, {}), known=True)
    print(f"CHAIN_FIT_US = {{64: ({c64:.3f}, {f64:.3f}), 128: ({c128:.3f}, {f128:.3f})}} (worst error {worst:.1%}); "
          f"planner now {CHAIN_FIT_US}")
    samples = split_samples(rows, args.sms, True, {64: (c64, f64), 128: (c128, f128)})
    (a, b), worst = fit(samples, known=True)
    print(f"L2NORM_SHORT_FILL_US = ({a:.3f}, {b:.3f}) over {len(samples)} one-chunk l2norm split candidates (worst "
          f"error {worst:.1%}); planner now {L2NORM_SHORT_FILL_US}")
    samples = cp_samples(rows, args.sms)
    if len(samples) > 6:
        coef, worst = fit(samples, known=True)
        samples = cp_samples(rows, args.sms, l2norm=True)
        (l2, ), worst_l2 = fit(samples, known=True) if samples else ((0.0, ), 0.0)
        print(f"CP_FIT_US = ({', '.join(f'{c:.3f}' for c in coef + [l2])}) over the CP candidates (worst error "
              f"{worst:.1%}; the l2norm term over {len(samples)} near-best ones, {worst_l2:.1%}); planner now {CP_FIT_US}")
    samples = prenorm_samples(rows)
    if len(samples) > 2:  # absolute least squares: the samples are time differences
        a = torch.tensor([s[:2] for s in samples], dtype=torch.float64)
        b = torch.tensor([[s[2]] for s in samples], dtype=torch.float64)
        fixed, per_mb = torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()
        print(f"PRENORM_US = ({fixed:.2f}, {per_mb:.3f}) over {len(samples)} pn_ candidates; planner now {PRENORM_US}")
    samples = cp_fused_samples(rows, args.sms)
    if len(samples) > len(CP_FUSED_US):
        coef, worst = fit(samples, known=True)
        print(f"CP_FUSED_US = ({', '.join(f'{c:.3f}' for c in coef)}) over {len(samples)} fused CP candidates "
              f"(worst error {worst:.1%}); planner now {CP_FUSED_US}")


if __name__ == "__main__":
    main()
