"""``python -m flash_qla.bench.report``: BENCHMARKS.md tables and PNG plots from benchmark JSONL.

    python -m flash_qla.bench.report --ours bench/results/h200.jsonl \\
        --peers ../shared/bench/anchors_h200.jsonl --published ../shared/bench/published_h200.json \\
        [--peers-fresh qla.jsonl fla.jsonl] --out BENCHMARKS.md --plots docs/

Per pass, one table row per matrix row: ours (graph, eager, peak memory), every peer column, the best
peer, ``x best`` and ``x qla`` (peer ms / our ms, above 1 = we are faster), the roofline floor and the
percentage of it we reach (formula of ../shared/bench/compare.py, see :mod:`flash_qla.bench.roofline`).
The output depends only on the inputs: no dates, so regenerating is a no-op when nothing changed.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence

from .comparison import PeerTimings, RowComparison, compare_rows, geomean, load_jsonl, load_peers, records_by_key
from .matrix import PASSES, iter_rows, load_matrix
from .roofline import CEILINGS, gpu_family

MISSING = "missing"
DASH = "–"


def _ms(x: Optional[float]) -> str:
    return DASH if x is None else f"{x:.3f}"


def _ratio(x: Optional[float]) -> str:
    return DASH if x is None else f"{x:.2f}"


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def pass_table(comparisons: Sequence[RowComparison], peer_columns: Sequence[str]) -> List[str]:
    header = (["row", "tokens", "ours graph ms", "ours eager ms", "peak MB"] + list(peer_columns)
              + ["best peer", "x best", "x qla", "floor ms", "% floor"])
    lines = [_md_row(header), _md_row(["---"] + ["---:"] * (len(header) - 1))]
    for c in comparisons:
        peak = None if c.ours is None else c.ours.get("peak_mem_mb")
        ours_cells = ([_ms(c.ours_graph_ms), _ms(c.ours_eager_ms), DASH if peak is None else f"{peak:.0f}"]
                      if c.measured else [MISSING, _ms(c.ours_eager_ms), DASH])
        pct = c.percent_of_floor
        lines.append(_md_row(
            [f"{c.row.model} {c.row.label}", str(c.row.tokens)] + ours_cells
            + [_ms(c.peers.get(col)) for col in peer_columns]
            + [c.best_column or DASH, _ratio(c.speedup_vs_best), _ratio(c.speedup_vs_qla), _ms(c.floor_ms),
               DASH if pct is None else f"{pct:.0f}%"]))
    return lines


def pass_summary(pass_: str, comparisons: Sequence[RowComparison], qla_column: Optional[str]) -> str:
    """compare.py's summary line: geomean and minimum of x best, rows at or above 1, geomean x qla."""
    measured = [c for c in comparisons if c.speedup_vs_best is not None]
    text = f"**{pass_}**: {len(measured)} of {len(comparisons)} rows measured"
    if measured:
        ratios = [c.speedup_vs_best for c in measured]
        text += (f"; geomean x best peer {geomean(ratios):.2f} (min {min(ratios):.2f}, "
                 f"{sum(r >= 1 for r in ratios)}/{len(ratios)} rows at or above 1.0)")
        vs_qla = [c.speedup_vs_qla for c in measured if c.speedup_vs_qla is not None]
        if vs_qla:
            text += f"; geomean x qla ({qla_column}) {geomean(vs_qla):.2f} (min {min(vs_qla):.2f})"
    return text + "."


def _failed_rows(comparisons: Sequence[RowComparison]) -> List[str]:
    return [f"- `{c.row.key}`: {c.ours.get('error') or c.ours.get('graph_error')}"
            for c in comparisons if c.ours is not None and not c.measured
            and (c.ours.get("error") or c.ours.get("graph_error"))]


def _first_call_line(ours: Dict[str, dict]) -> Optional[str]:
    firsts = [r for r in ours.values() if r.get("first_in_process") and r.get("first_call_s") is not None]
    if not firsts:
        return None
    parts = [f"{r['first_call_s']:.2f} s ({r['pass_']} {r['model']} {r['seqs']})" for r in firsts]
    return ("First call in a fresh process (synchronised, kernel loading included): " + "; ".join(parts)
            + ". Every row's `first_call_s` is in the JSONL.")


def _provenance(ours_records: List[dict], peers: PeerTimings, gpu: str, gpu_inferred: bool) -> List[str]:
    devices = sorted({r.get("device", "?") for r in ours_records})
    versions = sorted({str(r.get("version", "?")) for r in ours_records})
    backends = sorted({str(r.get("backend", "?")) for r in ours_records})
    torches = sorted({str(r.get("torch", "?")) for r in ours_records})
    if ours_records:
        lines = [f"- ours: flash_qla_aot {', '.join(versions)} on {', '.join(devices)}, backend "
                 f"{', '.join(backends)}, torch {', '.join(torches)}"]
    else:
        lines = ["- ours: **no results yet**: every row of ours below reads `missing`"]
    columns_by_source: Dict[str, List[str]] = {}
    for column in peers.columns:  # the published columns share one source line
        columns_by_source.setdefault(peers.devices.get(column, "unknown device"), []).append(f"`{column}`")
    for source, columns in columns_by_source.items():
        lines.append(f"- {', '.join(columns)}: {source}")
    peak_flops, bandwidth = CEILINGS[gpu]
    lines.append(f"- floor: {gpu} ceilings {peak_flops / 1e12:.0f} TFLOP/s bf16, {bandwidth / 1e12:.1f} TB/s"
                 + (" (assumed: ours did not run on a GPU with measured ceilings)" if gpu_inferred else ""))
    warnings = []
    if any(b != "kernels" for b in backends):
        warnings.append("some of our rows ran the pure-PyTorch **reference** backend: those are not "
                        "kernel timings and say nothing about kernel speed")
    our_families = {gpu_family(d) for d in devices}
    for column in peers.columns:
        family = gpu_family(peers.devices.get(column))
        if ours_records and family and our_families != {family}:
            warnings.append(f"`{column}` was measured on {family}, ours on {', '.join(devices)}: "
                            f"ratios across GPU models are not comparable")
    return lines + [f"- **warning**: {w}" for w in warnings]


def compare_passes(matrix: dict, ours_records: List[dict], peers: PeerTimings,
                   gpu: str) -> Dict[str, List[RowComparison]]:
    ours = records_by_key(ours_records)
    return {p: compare_rows(list(iter_rows(matrix, (p,))), ours, peers, gpu) for p in PASSES if p in matrix}


def build_report(by_pass: Dict[str, List[RowComparison]], ours_records: List[dict], peers: PeerTimings,
                 gpu: str, gpu_inferred: bool, plot_paths: Dict[str, List[str]], out_dir: str,
                 command: str) -> str:
    """The whole BENCHMARKS.md text."""
    lines = ["# Benchmarks", "",
             "Gated DeltaNet chunked prefill, K = V = 128, bf16 q/k/v, fp32 g/beta/state, varlen batches "
             "(`cu_seqlens`); inputs drawn as FlashQLA's own benchmark draws them. Times are medians of "
             "CUDA-graph replays (`graph`, the kernel-time figure compared across libraries) and of "
             "event-timed eager calls (`eager`, host overhead included).", "",
             f"Generated by `{command}` from JSONL written by `python -m flash_qla.bench`; "
             "`scripts/gpu_bench.sh` runs ours and the peers on one GPU in one sequence.", "",
             "Columns: `x best` = fastest peer's ms / our ms and `x qla` = FlashQLA's ms / our ms (above 1.0: we "
             "are faster); `floor` = max(FLOP / peak FLOP/s, minimum bytes / bandwidth), the formula of "
             "`../shared/bench/compare.py`; `% floor` = floor / ours. `missing` = no timing of ours for the row "
             "(never estimated). Peer columns: plain = measured in the same run as ours, `anchor` = stored "
             "side-by-side measurement, `pub` = FlashQLA's published table.", "",
             "## Provenance", ""]
    lines += _provenance(ours_records, peers, gpu, gpu_inferred)
    first = _first_call_line(records_by_key(ours_records))
    if first:
        lines += ["", first]
    for pass_, comparisons in by_pass.items():
        title = "Forward" if pass_ == "fwd" else "Backward"
        lines += ["", f"## {title} ({pass_})", "", pass_summary(pass_, comparisons, peers.qla_column), ""]
        lines += pass_table(comparisons, peers.columns)
        failed = _failed_rows(comparisons)
        if failed:
            lines += ["", "Rows without a graph timing:", ""] + failed
        for path in plot_paths.get(pass_, []):
            rel = os.path.relpath(path, out_dir).replace(os.sep, "/")
            figure = os.path.basename(path)[:-len(".png")].split("_")[-1]  # bench_fwd_latency.png -> latency
            lines += ["", f"![{pass_} {figure}]({rel})"]
    return "\n".join(lines) + "\n"


def choose_gpu(requested: Optional[str], ours_records: List[dict], fresh_records: List[dict]) -> Optional[str]:
    """The GPU whose ceilings set the floor: asked for, else where ours ran, else where fresh peers ran."""
    if requested:
        return requested
    for records in (ours_records, fresh_records):
        families = {gpu_family(r.get("device")) for r in records} - {None}
        if len(families) == 1:
            return families.pop()
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flash_qla.bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--ours", nargs="+", required=True, help="our JSONL file(s); later files win per row")
    p.add_argument("--peers", help="stored peer timings in the same schema (../shared/bench/anchors_h200.jsonl)")
    p.add_argument("--published", help="FlashQLA's published table (../shared/bench/published_h200.json)")
    p.add_argument("--peers-fresh", nargs="*", default=[], help="peer_bench.py JSONL from the same run as ours")
    p.add_argument("--matrix", help="matrix file (default: the packaged standard matrix)")
    p.add_argument("--gpu", choices=sorted(CEILINGS), help="ceilings for the floor (default: where ours ran)")
    p.add_argument("--out", default="BENCHMARKS.md")
    p.add_argument("--plots", help="folder for the PNG plots (none when omitted)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    matrix = load_matrix(args.matrix)
    ours_records = [r for path in args.ours for r in load_jsonl(path)]
    fresh_records = [r for path in args.peers_fresh for r in load_jsonl(path)]
    peers = load_peers(args.peers, args.published, args.peers_fresh)
    gpu = choose_gpu(args.gpu, ours_records, fresh_records)
    gpu_inferred = gpu is None
    gpu = gpu or "H200"  # the GPU of the anchors and the published table
    by_pass = compare_passes(matrix, ours_records, peers, gpu)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    plot_paths: Dict[str, List[str]] = {}
    if args.plots:
        from .plots import write_plots  # matplotlib only when plots are asked for
        for pass_, paths in write_plots(by_pass, peers.columns, args.plots).items():
            plot_paths[pass_] = [os.path.abspath(p) for p in paths]
    command = " ".join(["python -m flash_qla.bench.report"] + (argv if argv is not None else sys.argv[1:]))
    text = build_report(by_pass, ours_records, peers, gpu, gpu_inferred, plot_paths, out_dir, command)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}" + (f" and {sum(map(len, plot_paths.values()))} plots in {args.plots}"
                                 if args.plots else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
