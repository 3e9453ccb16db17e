"""The planner against every plan it could have chosen: CUDA-graph time of each candidate on a grid of shapes.

For each shape of a set (grid: v-heads 4 to 128 with GVA ratios 2 and 4, K = V = 128, bf16, one long sequence,
equal batches, unequal mixes and many short sequences; holdout: other head counts and lengths; standard: the
benchmark matrix's forward rows; mixes: unequal lengths outside the fit), the forward is timed under each pinned plan:
  fused  gdn_fwd_fused at V block 64 / 128 (no CP)
  split  gdn_prepare + gdn_fwd_chain at V block 64 / 128, each gdn_prepare heads-per-CTA the GVA ratio allows (no CP)
  cp     intra-card CP at each segment length the shape admits (the planner's V block and heads per CTA)
  cpf    intra-card CP on the fused kernel (flash_qla/fused_cp.py) at each of those lengths
and under the planner's own choice ("planned"). A row reports the best candidate and planned / best.
--pass bwd sweeps the backward's plans instead (the low-level backward the benchmark times, after its forward):
  bwd    the recompute and dh chains at V block 32 / 64 (force_block_v), each without CP and at each segment length
         the shape admits
on its own grid (BWD_HEADS x BWD_LENGTHS), held-out shapes (BWD_HOLDOUT) or the benchmark matrix's backward rows
(standard); with --host-lengths the backward gets cu_seqlens_cpu too.

usage (GPU machine, repository root):
  python scripts/plan_sweep.py --out bench/results/h100/plan_sweep.jsonl [--sets grid,holdout,standard] [--l2norm]
                               [--pass bwd]
                               [--shapes SUBSTRING] [--tolerance 0.03] [--only PREFIX[,PREFIX] --merge OLD.jsonl]
--only times just the candidates whose names start with a prefix (e.g. fused, after a change to gdn_fwd_fused alone)
and --merge takes every other candidate's time from OLD's row of the same set, shape and l2norm: a refresh of the
plans whose kernels changed, in a fraction of the sweep's time (the planner's choice is timed again either way).
Writes one JSON line per shape: {"pass_", "set", "shape", "hq", "hv", "tokens", "seqs", "equal_lengths", "l2norm",
"planned_ms", "best", "best_ms", "ratio", "candidates": {name: ms}}; exits 1 when a shape's planned time is more than
--tolerance above its best.
"""
from __future__ import annotations

import argparse
import json
import random
import sys

import torch

import flash_qla
from flash_qla import cp, planner, plans
from flash_qla.bench.inputs import draw_inputs
from flash_qla.bench.matrix import BenchRow, iter_rows, load_matrix
from flash_qla.bench.timing import graph_median_ms
from flash_qla.bench.workloads import backward_call, forward_for_backward
from flash_qla.launch import CHAIN_KERNEL, FUSED_KERNEL, RECOMPUTE_KERNEL, built_blocks
from flash_qla.planner import PREPARE_MAX_HEADS
from flash_qla.tuning import override

HEADS = [(2, 4), (2, 8), (4, 8), (3, 12), (4, 16), (6, 24), (8, 32), (16, 32), (12, 48), (16, 64), (32, 64),
         (24, 96), (32, 128)]


def length_mixes() -> list:
    rng = random.Random(7)
    return [
        ("1x4096", (4096,)), ("1x16384", (16384,)), ("1x32768", (32768,)),
        ("4x4096", (4096,) * 4), ("8x2048", (2048,) * 8), ("16x1024", (1024,) * 16),
        ("14336+2048", (14336, 2048)), ("mixed8", tuple(rng.choice((256, 1024, 3000, 6000)) for _ in range(8))),
        ("64x256", (256,) * 64), ("256x32", (32,) * 256),
    ]  # two of unequal lengths: rows with equal_lengths false


# shapes the model was not fitted on: other lengths and head counts
HOLDOUT_HEADS = [(1, 4), (2, 6), (5, 20), (10, 40), (20, 80), (14, 56)]
HOLDOUT_LENGTHS = [("1x8192", (8192,)), ("2x8192", (8192,) * 2), ("32x512", (512,) * 32), ("128x64", (64,) * 128),
                   ("512x16", (16,) * 512), ("1x65536", (65536,))]


# unequal lengths the model was not fitted on, for the planner with the lengths on the host (plan_fit.py --check
# --host-lengths): a long sequence beside short ones, and random mixes
MIX_HEADS = [(2, 6), (2, 8), (4, 16), (8, 32), (10, 40), (16, 64)]


def unequal_mixes() -> list:
    rng = random.Random(11)
    return [("3000+1000", (3000, 1000)), ("20000+700+700", (20000, 700, 700)),
            ("mixed4", tuple(rng.choice((512, 2000, 5000, 9000)) for _ in range(4))),
            ("mixed16", tuple(rng.choice((64, 300, 1500, 4000)) for _ in range(16))),
            ("1000+3000", (1000, 3000)), ("700+700+20000", (700, 700, 20000))]  # the longest last


SETS = ("grid", "holdout", "standard", "mixes")
# the backward's grid: v-heads 4 to 128, one long sequence, equal batches, unequal mixes, many short sequences
BWD_HEADS = [(2, 4), (2, 8), (4, 16), (8, 32), (16, 32), (16, 64), (32, 128)]
BWD_LENGTHS = [("1x4096", (4096,)), ("1x32768", (32768,)), ("8x2048", (2048,) * 8), ("14336+2048", (14336, 2048)),
               ("mixed8", (3000, 256, 6000, 1024, 256, 3000, 1024, 6000)), ("64x256", (256,) * 64)]
# the backward's held-out shapes: other head counts, lengths and sequence counts near the CP model's choices' edges
BWD_HOLDOUT = [(1, 4, "2x4096", (4096,) * 2), (1, 4, "4x16384", (16384,) * 4), (1, 4, "2x65536", (65536,) * 2),
               (2, 8, "1x2048", (2048,)), (2, 8, "2x16384", (16384,) * 2), (2, 8, "1x65536", (65536,)),
               (4, 16, "1x16384", (16384,)), (4, 16, "1x8192", (8192,)), (6, 24, "1x4096", (4096,)),
               (8, 32, "1x8192", (8192,)), (5, 20, "3x6000", (6000,) * 3), (3, 12, "1x12000", (12000,))]


def shapes(which: str, pass_: str = "fwd"):
    """(name, hq, hv, lengths) of a set: grid (the fit's), holdout, standard (the benchmark matrix's rows of the
    pass), mixes (unequal lengths outside the fit); with pass_ bwd, grid is the backward's (BWD_HEADS x BWD_LENGTHS)."""
    if pass_ == "bwd" and which == "grid":
        for hq, hv in BWD_HEADS:
            for label, lens in BWD_LENGTHS:
                yield f"hq{hq}_hv{hv}|{label}", hq, hv, label, lens
    elif pass_ == "bwd" and which == "holdout":
        for hq, hv, label, lens in BWD_HOLDOUT:
            yield f"hq{hq}_hv{hv}|{label}", hq, hv, label, lens
    elif pass_ == "bwd" and which != "standard":
        raise ValueError(f"the backward sweeps the grid, holdout and standard sets, not {which!r}")
    elif which == "grid":
        for hq, hv in HEADS:
            for label, lens in length_mixes():
                yield f"hq{hq}_hv{hv}|{label}", hq, hv, label, lens
    elif which == "holdout":
        for hq, hv in HOLDOUT_HEADS:
            for label, lens in HOLDOUT_LENGTHS:
                yield f"hq{hq}_hv{hv}|{label}", hq, hv, label, lens
    elif which == "mixes":
        for hq, hv in MIX_HEADS:
            for label, lens in unequal_mixes():
                yield f"hq{hq}_hv{hv}|{label}", hq, hv, label, lens
    elif which == "standard":
        for row in iter_rows(load_matrix(), (pass_,), ""):
            yield f"{row.model}|{row.label}", row.hq, row.hv, row.label, row.seqlens
    else:
        raise ValueError(f"unknown shape set {which!r}: one of {', '.join(SETS)}")


def candidates(hq: int, hv: int, seqlens, l2norm: bool) -> dict:
    """Every plan of the shape, as tuning pins by candidate name; with l2norm the l2norm builds' plans and, named
    pn_<plain name>, the plain plans after the gdn_l2norm pass."""
    if not l2norm:
        return plain_candidates(hq, hv, seqlens, False)
    out = {n: dict(p, prenorm=False) for n, p in plain_candidates(hq, hv, seqlens, True).items()}
    out.update((f"pn_{n}", dict(p, prenorm=True)) for n, p in plain_candidates(hq, hv, seqlens, False).items())
    return out


def plain_candidates(hq: int, hv: int, seqlens, l2norm: bool) -> dict:
    """The plans over the fused builds with that l2norm flag, the split chains, and both CP flavours."""
    ratio = hv // hq
    fused = built_blocks(FUSED_KERNEL, "out", "bf16", 128, 128, int(l2norm))
    out = {f"fused_bv{bv}": dict(use_fused=True, force_block_v=bv, force_segment_chunks=0) for bv in fused}
    for bv in built_blocks(CHAIN_KERNEL, "out", "bf16", 128, 128):
        for hpc in (d for d in range(1, PREPARE_MAX_HEADS + 1) if ratio % d == 0):
            out[f"split_bv{bv}_hpc{hpc}"] = dict(use_fused=False, force_block_v=bv, force_heads_per_cta=hpc,
                                                 force_segment_chunks=0)
    longest_chunks = -(-max(seqlens) // 64)
    for L in cp.SEGMENT_CHUNKS:
        if 2 * L <= longest_chunks:  # a sequence of at least two segments
            out[f"cp_L{L}"] = dict(force_segment_chunks=L, cp_fused=False)
            if 64 in fused:  # CP on the fused kernel (its pre-pass builds are at V block 64)
                out[f"cpf_L{L}"] = dict(force_segment_chunks=L, cp_fused=True)
    return out


def bwd_candidates(seqlens) -> dict:
    """The backward's plans: the chains' V block (the recompute's and gdn_bwd_dh's, both built at 32 and 64) without
    CP and at each segment length that gives the longest sequence two segments."""
    out = {}
    longest_chunks = -(-max(seqlens) // 64)
    for bv in built_blocks(RECOMPUTE_KERNEL, "save", "bf16", 128, 128):
        out[f"bwd_bv{bv}"] = dict(force_block_v=bv, force_segment_chunks=0)
        for L in cp.SEGMENT_CHUNKS:
            if 2 * L <= longest_chunks:
                out[f"bwd_bv{bv}_cp_L{L}"] = dict(force_block_v=bv, force_segment_chunks=L)
    return out


def merged_times(timed: dict, old_row, only: tuple, names) -> dict:
    """The row's candidate times (names: every candidate of the shape): those timed now, the others (names without an
    --only prefix) from the earlier sweep's row. A candidate the earlier row lacks and this run did not time is an
    error, not a gap."""
    times = dict(timed)
    if only:
        if old_row is None:
            raise SystemExit("plan_sweep: --merge has no row for this shape: time every candidate instead")
        times.update((n, old_row["candidates"][n]) for n in names if not n.startswith(only)
                     and n in old_row["candidates"])
        missing = sorted(set(names) - set(times))
        if missing:
            raise SystemExit(f"plan_sweep: --merge's row lacks {missing}: time them (widen --only)")
    return times


def time_plan(x, pins: dict, device, l2norm: bool, cu_cpu=None) -> float:
    """A plan's CUDA-graph median; cu_cpu: the lengths on the host (the planner's choice and a fused plan's order
    follow them)."""
    def run():
        with torch.no_grad():
            return flash_qla.chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0,
                                                    output_final_state=True, cu_seqlens=x.cu_seqlens,
                                                    cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=l2norm)
    with override(**pins):
        ms, why = graph_median_ms(run, device, replays=5, rounds=3)
    if ms is None:
        raise RuntimeError(why)
    return ms


def time_bwd_plan(call, pins: dict, device) -> float:
    """A backward plan's CUDA-graph median (call: the benchmark's low-level backward on one shape's inputs)."""
    with override(**pins):
        ms, why = graph_median_ms(call, device, replays=5, rounds=3)
    if ms is None:
        raise RuntimeError(why)
    return ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="", help="only shapes whose name contains this")
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--sets", default="grid", help=f"comma-separated shape sets: {', '.join(SETS)}")
    ap.add_argument("--l2norm", action="store_true", help="time with use_qk_l2norm_in_kernel=True")
    ap.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="fwd",
                    help="bwd: the backward's plans (grid, holdout and standard sets; no --l2norm, --batch-order, "
                         "--merge)")
    ap.add_argument("--host-lengths", action="store_true",
                    help="pass cu_seqlens_cpu: the planner plans from the lengths and the fused kernel walks lengths "
                         "out of order longest first (--pass bwd: the chains' V blocks plan from the longest)")
    ap.add_argument("--batch-order", action="store_true",
                    help="with --host-lengths, the fused kernel keeps the batch's order (the longest-first walk's A/B)")
    ap.add_argument("--only", default="", help="comma-separated candidate-name prefixes to time (with --merge)")
    ap.add_argument("--merge", default="", help="an earlier sweep whose rows give the other candidates' times")
    args = ap.parse_args()
    only = tuple(p for p in args.only.split(",") if p)
    if args.batch_order:
        if not args.host_lengths:
            raise SystemExit("plan_sweep: --batch-order is the A/B of --host-lengths' order: pass both")
        planner.FUSED_ORDER_MAX = 0
    if args.pass_ == "bwd" and (args.l2norm or args.batch_order or args.merge):
        raise SystemExit("plan_sweep: --pass bwd sweeps plain calls: no --l2norm, --batch-order or --merge")
    if bool(only) != bool(args.merge):
        raise SystemExit("plan_sweep: --only and --merge go together")
    old_rows = {}
    if args.merge:
        with open(args.merge) as f:
            old_rows = {(r["set"], r["shape"], r["l2norm"]): r for r in map(json.loads, filter(str.strip, f))}
    device = torch.device("cuda")
    worst = 1.0
    with open(args.out, "w") as f:
        for which in args.sets.split(","):
            for name, hq, hv, label, lens in shapes(which, args.pass_):
                if args.shapes and args.shapes not in name:
                    continue
                x = draw_inputs(BenchRow(args.pass_, name, hq, hv, label, tuple(lens), 128), "cuda")
                cu_cpu = x.cu_seqlens.cpu() if args.host_lengths and x.cu_seqlens is not None else None
                if args.pass_ == "bwd":
                    call = backward_call(x, *forward_for_backward(x, "kernels"), "kernels", cu_cpu)
                    cands = bwd_candidates(lens)
                    times = {c: time_bwd_plan(call, pins, device) for c, pins in cands.items()
                             if c.startswith(only or "")}
                    planned = time_bwd_plan(call, {}, device)
                else:
                    cands = candidates(hq, hv, lens, args.l2norm)
                    timed = {c: time_plan(x, pins, device, args.l2norm, cu_cpu)
                             for c, pins in cands.items() if c.startswith(only or "")}
                    times = merged_times(timed, old_rows.get((which, name, args.l2norm)), only, cands)
                    planned = time_plan(x, {}, device, args.l2norm, cu_cpu)
                best = min(times, key=times.get)
                ratio = planned / min(times[best], planned)
                worst = max(worst, ratio)
                rec = dict(pass_=args.pass_, set=which, shape=name, hq=hq, hv=hv, tokens=sum(lens), seqs=len(lens),
                           equal_lengths=len(set(lens)) == 1, l2norm=args.l2norm, host_lengths=args.host_lengths,
                           batch_order=args.batch_order,
                           planned_ms=round(planned, 4), best=best, best_ms=round(times[best], 4),
                           ratio=round(ratio, 4), candidates={c: round(t, 4) for c, t in times.items()})
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(f"{which:8s} {name:28s} planned {planned:.4f} best {best} {times[best]:.4f} ratio {ratio:.3f}",
                      flush=True)
                plans.clear()
                del x
    print(f"worst planned / best: {worst:.3f}")
    return 0 if worst <= 1 + args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
