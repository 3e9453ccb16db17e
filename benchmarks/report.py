"""``python -m benchmarks.report``: BENCHMARKS.md and its figures from the committed result folders.

    python -m benchmarks.report bench/results/h100 bench/results/h200

Each folder is one card (see :mod:`benchmarks.cards`): ours.jsonl plus the peers timed in the same call
on the same card. Per card and pass: a summary line (ratios against the fastest peer and each peer, CUDA
graph and eager), one table row per matrix row, two figures; then the host cost and the validation
logs' summary lines when the folder holds them. The output depends only on the inputs (no dates), so
regenerating from unchanged files changes nothing.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

from flash_qla.bench.matrix import PASSES, load_matrix

from .cards import PEER_NAMES, Card, CardError, load_card
from .comparison import TIMINGS, RowComparison, compare_card, summarize
from .roofline import CEILINGS

COMMAND = "python -m benchmarks.report"
MISSING = "missing"
DASH = "–"
PASS_TITLES = {"fwd": "Forward", "bwd": "Backward"}


def _ms(x: Optional[float]) -> str:
    return DASH if x is None else f"{x:.3f}"


def _x(x: Optional[float]) -> str:
    return DASH if x is None else f"{x:.2f}"


def _cell(value) -> str:
    """A table cell from a data value: a '|' (row keys hold them) would end the cell."""
    return str(value).replace("|", "\\|")


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def method_section(matrix: dict) -> List[str]:
    rows = {p: len(matrix[p]["models"]) * len(matrix[p]["seqs"]) for p in PASSES if p in matrix}
    ceilings = "; ".join(f"{gpu} {flops / 1e12:.0f} TFLOP/s bf16, {bw / 1e12:.1f} TB/s copy"
                         for gpu, (flops, bw) in sorted(CEILINGS.items()))
    return [
        "## Method", "",
        f"- Rows: the matrix of `flash_qla/bench/matrix.json` ({rows.get('fwd', 0)} forward, {rows.get('bwd', 0)} "
        f"backward rows): Qwen3.5 / 3.6 head configurations, K = V = {matrix['head_dim']}, varlen batches packed "
        "with `cu_seqlens`. Inputs: bf16 q / k / v (q, k l2-normalised), fp32 g (`logsigmoid / 16`, a quarter "
        "of the v-heads never decaying) and beta, fp32 initial state; seeded, the same tensors for every library.",
        "- Forward: `chunk_gated_delta_rule(..., initial_state, output_final_state=True)` under `no_grad`. "
        "Backward: the low-level backward from the forward's saved tensors (dq, dk, dv, dbeta, dg, dh0), as "
        "each peer's own backward entry point is timed.",
        "- `graph`: median of CUDA-graph replays (kernel time; the figure libraries are compared on). "
        "`eager`: median of event-timed eager calls after a warm-up (host work included).",
        "- Peers (FlashQLA `qla`, FLA `fla`, FlashInfer `fi`, forward only) are timed in the same call on the "
        "same card as ours, after it. Ratios across cards or calls are never formed.",
        "- `x best` = fastest peer's ms / our ms, `x qla` = FlashQLA's ms / our ms: above 1.0 we are faster. "
        "Geometric means run over the rows where both sides have a timing.",
        "- `floor` = max(FLOP / peak, minimum bytes / bandwidth) with measured ceilings (" + ceilings + "); "
        "`% floor` = floor / our graph time. See `benchmarks/roofline.py` for the counts.",
        "- `missing`: no timing of ours for the row; nothing is estimated.",
        "",
        f"Regenerate: `{COMMAND} bench/results/h100 bench/results/h200` (figures in `docs/figures/`). "
        "Produce a card's files with `bash scripts/gpu_bench.sh OUT --peers \"qla fla fi\"` "
        "(see `scripts/README.md`).",
    ]


def provenance(card: Card) -> List[str]:
    def describe(records: List[dict]) -> str:
        libs = sorted({f"{r['lib']} {r.get('version', '?')}" for r in records})
        devices = sorted({r["device"] for r in records})
        return f"{', '.join(libs)} on {', '.join(devices)}"
    ours = card.ours
    backends = sorted({str(r.get("backend", "?")) for r in ours})
    torches = sorted({str(r.get("torch", "?")) for r in ours})
    lines = [f"- ours: {describe(ours)}, backend {', '.join(backends)}, torch {', '.join(torches)}"]
    for stem, records in card.peers.items():
        lines.append(f"- `{stem}` ({PEER_NAMES[stem]}): {describe(records)}")
    if any(b != "kernels" for b in backends):
        lines.append("- **warning**: some of our rows ran the pure-PyTorch reference backend: not kernel timings")
    for stem in card.mismatched_peers():
        lines.append(f"- **warning**: `{stem}` ran on another kind of card than ours: its ratios compare two "
                     "machines")
    if card.gpu is None:
        lines.append("- no floor: the card has no measured ceilings")
    firsts = [r for r in ours if r.get("first_in_process") and r.get("first_call_s") is not None]
    for r in firsts:
        lines.append(f"- first call in a fresh process (kernel loading included): {r['first_call_s']:.2f} s "
                     f"({r['pass_']} {r['model']} {r['seqs']})")
    return lines


def pass_summary(comparisons: Sequence[RowComparison], peers: Sequence[str]) -> List[str]:
    measured = sum(c.ours_ms("graph") is not None for c in comparisons)
    lines = [f"- rows measured: {measured} of {len(comparisons)}"]
    for timing in TIMINGS:
        parts = [f"x best peer {summarize(comparisons, timing).text()}"]
        parts += [f"x {p} {summarize(comparisons, timing, p).text()}" for p in peers
                  if summarize(comparisons, timing, p).rows]
        lines.append(f"- {timing}: " + "; ".join(parts))
    return lines


def pass_table(comparisons: Sequence[RowComparison], peers: Sequence[str]) -> List[str]:
    header = (["row", "tokens", "ours ms"] + [f"{p} ms" for p in peers]
              + ["x best", "x qla", "ours eager ms", "best peer eager ms", "x best eager", "floor ms", "% floor",
                 "peak MB"])
    lines = [_md_row(header), _md_row(["---"] + ["---:"] * (len(header) - 1))]
    for c in comparisons:
        graph = c.ours_ms("graph")
        peak = None if c.ours is None else c.ours.get("peak_mem_mb")
        pct = c.percent_of_floor
        lines.append(_md_row(
            [f"{c.row.model} {c.row.label}", str(c.row.tokens), MISSING if graph is None else _ms(graph)]
            + [_ms(c.peers["graph"].get(p)) for p in peers]
            + [_x(c.ratio("graph")), _x(c.ratio("graph", "qla")), _ms(c.ours_ms("eager")),
               _ms(c.best("eager")[1]), _x(c.ratio("eager")), _ms(c.floor_ms),
               DASH if pct is None else f"{pct:.0f}%", DASH if peak is None else f"{peak:.0f}"]))
    return lines


def failed_rows(comparisons: Sequence[RowComparison]) -> List[str]:
    return [f"- `{c.row.key}`: {c.ours.get('error') or c.ours.get('graph_error')}"
            for c in comparisons if c.ours is not None and c.ours_ms("graph") is None
            and (c.ours.get("error") or c.ours.get("graph_error"))]


def host_cost_section(card: Card) -> List[str]:
    """The host cost file as tables: its scalar fields (nested objects by dotted path), then each list of
    records (e.g. ``rows``: one per shape) with one column per field."""
    def flat(prefix: str, value) -> List[tuple]:
        if isinstance(value, dict):
            return [item for k, v in value.items() for item in flat(f"{prefix}.{k}" if prefix else k, v)]
        return [(prefix, value)] if isinstance(value, (int, float, str, bool)) else []
    data = card.host_cost if isinstance(card.host_cost, dict) else {}
    lines: List[str] = []
    scalars = flat("", {k: v for k, v in data.items() if not isinstance(v, list)})
    if scalars:
        lines += ["", _md_row(["measure", "value"]), _md_row(["---", "---:"])]
        lines += [_md_row([f"`{k}`", _cell(v)]) for k, v in scalars]
    for name, records in data.items():
        if not (isinstance(records, list) and records and all(isinstance(r, dict) for r in records)):
            continue
        columns = list(dict.fromkeys(k for r in records for k, _ in flat("", r)))
        lines += ["", f"`{name}`:", "", _md_row(columns), _md_row(["---"] * len(columns))]
        for r in records:
            values = dict(flat("", r))
            lines.append(_md_row([DASH if values.get(c) is None else _cell(values[c]) for c in columns]))
    if not lines:
        return []
    return ["", "### Host cost", "", f"From `{card.path.name}/host_overhead.json`."] + lines


NCU_COLUMNS = [("kernel", "kernel"), ("row", "row"), ("build", "build"), ("duration_us", "us"),
               ("dram_pct", "DRAM %"), ("sm_pct", "SM %"), ("l1tex_pct", "L1/TEX %"),
               ("issue_per_scheduler", "issued / scheduler"), ("no_eligible_pct", "no eligible %"),
               ("occupancy_pct", "occupancy %"), ("l2_input_sectors", "L2 sectors in"), ("l2_hit_pct", "L2 hit %"),
               ("dram_read_mb", "DRAM MB read"), ("shared_wavefronts_m", "shared wavefronts M"),
               ("shared_st_inst_m", "st.shared M")]


def ncu_section(card: Card) -> List[str]:
    """scripts/ncu_summary.py's rows: what bounds each profiled kernel, before and after a change."""
    if not card.ncu:
        return []
    lines = ["", "### Kernel evidence (ncu)", "",
             f"From `{card.path.name}/ncu.jsonl` (`scripts/ncu_summary.py`; one profiled launch a row).", "",
             _md_row([title for _, title in NCU_COLUMNS]), _md_row(["---"] * 3 + ["---:"] * (len(NCU_COLUMNS) - 3))]
    for r in card.ncu:
        cells = []
        for key, _ in NCU_COLUMNS:
            v = r.get(key)
            cells.append(DASH if v is None else f"`{v}`" if key == "kernel" else
                         f"{v / 1e6:.1f}M" if key == "l2_input_sectors" else _cell(v))
        lines.append(_md_row(cells))
    return lines


def short_batch_section(card: Card) -> List[str]:
    """Batches of short sequences: ours against the best peer per shape, one table row per model and batch size."""
    rows = [r for r in card.short_batches if r.get("ratio")]  # best peer's graph time / ours (the merge's)
    if not rows:
        return []
    ratios = [r["ratio"] for r in rows]
    worst = min(rows, key=lambda r: r["ratio"])
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    lengths = sorted({r["tokens_per_seq"] for r in rows})
    lines = ["", "### Batches of short sequences", "",
             f"From `{card.path.name}/short_batches.jsonl` (`scripts/short_batch_sweep.py`): one varlen call of N "
             "sequences of the same length; CUDA-graph ms of ours and x = the best peer's time over ours (the "
             "peer named).", "",
             f"- x best peer geomean {geomean:.3f}x (min {min(ratios):.3f}x: {worst['model']} {worst['seqs']} x "
             f"{worst['tokens_per_seq']}); {sum(x > 1.0 for x in ratios)}/{len(ratios)} rows ahead, "
             f"{sum(x == 1.0 for x in ratios)} level", "",
             _md_row(["model", "sequences"] + [f"{n} tokens" for n in lengths]),
             _md_row(["---", "---:"] + ["---:"] * len(lengths))]
    table = {}
    for r in rows:
        table.setdefault((r["model"], r["seqs"]), {})[r["tokens_per_seq"]] = r
    for (model, seqs), by_len in table.items():
        cells = [f"{by_len[n]['ours_ms']:.4f} ({by_len[n]['ratio']:.2f}x {by_len[n]['best_peer']})" if n in by_len
                 else DASH for n in lengths]
        lines.append(_md_row([model, str(seqs)] + cells))
    return lines


def logs_section(card: Card) -> List[str]:
    if not card.log_summaries:
        return []
    lines = []
    for name, summary in card.log_summaries.items():
        seen = list(dict.fromkeys(s[:200] for s in summary))
        if seen:  # a log without a test, sanitizer or stress verdict (e.g. the bench's own log) is not quoted
            lines.append(f"- `{card.path.name}/{name}`: " + "; ".join(f"`{s}`" for s in seen))
    return ["", "### Validation logs", ""] + lines if lines else []


def card_section(matrix: dict, card: Card, plots: Dict[str, List[str]], out_dir: str) -> List[str]:
    title = card.gpu or card.name
    lines = ["", f"## {title}", ""] + provenance(card)
    peers = list(card.peers)
    for pass_ in PASSES:
        if pass_ not in matrix:
            continue
        comparisons = compare_card(matrix, card, pass_)
        lines += ["", f"### {title} {PASS_TITLES[pass_].lower()} ({pass_})", ""]
        lines += pass_summary(comparisons, peers) + [""] + pass_table(comparisons, peers)
        failed = failed_rows(comparisons)
        if failed:
            lines += ["", "Rows without a graph timing:", ""] + failed
        for path in plots.get(pass_, []):
            rel = os.path.relpath(path, out_dir).replace(os.sep, "/")
            kind = os.path.basename(path)[:-len(".png")].rsplit("_", 1)[-1]
            lines += ["", f"![{title} {pass_} {kind}]({rel})"]
    return lines + host_cost_section(card) + short_batch_section(card) + ncu_section(card) + logs_section(card)


def build_report(matrix: dict, cards: Sequence[Card], plots: Dict[str, Dict[str, List[str]]],
                 out_dir: str) -> str:
    lines = ["# Benchmarks", "",
             "Gated DeltaNet chunked prefill (forward and backward) of flash-qla-aot against FlashQLA, FLA and "
             f"FlashInfer, one section per card. Generated by `{COMMAND}` from the files in `bench/results/`; "
             "do not edit by hand.", ""]
    lines += method_section(matrix)
    for card in cards:
        lines += card_section(matrix, card, plots.get(card.name, {}), out_dir)
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    p.add_argument("cards", nargs="+", help="result folders, one per card (ours.jsonl and the peers' files)")
    p.add_argument("--out", default="BENCHMARKS.md")
    p.add_argument("--plots", default="docs/figures", help="folder for the PNG figures (default: docs/figures)")
    p.add_argument("--no-plots", action="store_true", help="tables only (no matplotlib needed)")
    p.add_argument("--matrix", help="matrix file (default: the packaged standard matrix)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        matrix = load_matrix(args.matrix)
        cards = [load_card(path) for path in args.cards]
    except (CardError, OSError, ValueError) as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return 2
    names = [c.name for c in cards]
    if len(set(names)) != len(names):
        print(f"{COMMAND}: two result folders share a name ({', '.join(names)}): their figures would collide",
              file=sys.stderr)
        return 2
    out_dir = os.path.dirname(os.path.abspath(args.out))
    plots: Dict[str, Dict[str, List[str]]] = {}
    if not args.no_plots:
        from .plots import write_plots  # matplotlib only when figures are asked for
        for card in cards:
            by_pass = {p: compare_card(matrix, card, p) for p in PASSES if p in matrix}
            written = write_plots(card.name, by_pass, list(card.peers), args.plots)
            plots[card.name] = {p: [os.path.abspath(x) for x in paths] for p, paths in written.items()}
    with open(args.out, "w") as f:
        f.write(build_report(matrix, cards, plots, out_dir))
    count = sum(len(v) for by_pass in plots.values() for v in by_pass.values())
    print(f"wrote {args.out}" + (f" and {count} figures in {args.plots}" if count else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
