"""PNG figures for BENCHMARKS.md, per card and pass: CUDA-graph latency per head configuration, and our
speedup over the fastest peer per row.

Deterministic by construction: the Agg backend, fixed sizes and dpi, no dates, and the PNG
'Software' tag dropped, so regenerating from the same JSONL gives the same bytes (same matplotlib).
Rows we have not measured are drawn as gaps / labelled 'missing', never interpolated.
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Sequence

import matplotlib

matplotlib.use("Agg")  # headless and reproducible; must precede the pyplot import
import matplotlib.pyplot as plt  # noqa: E402

from .cards import PEER_NAMES  # noqa: E402
from .comparison import RowComparison  # noqa: E402

OURS_LABEL = "flash-qla-aot"
PNG_METADATA = {"Software": None}
DPI = 110


def _save(fig, path: str) -> str:
    fig.savefig(path, dpi=DPI, metadata=PNG_METADATA)
    plt.close(fig)
    return path


def _by_model(comparisons: Sequence[RowComparison]) -> Dict[str, List[RowComparison]]:
    groups: Dict[str, List[RowComparison]] = {}
    for c in comparisons:
        groups.setdefault(c.row.model, []).append(c)
    return groups


def _tokens_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def latency_figure(title: str, comparisons: Sequence[RowComparison], peer_columns: Sequence[str], path: str) -> str:
    """One panel per head configuration; x = the matrix's sequence sets in order of total tokens,
    y = CUDA-graph latency (log scale: rows span more than a decade); one line per library."""
    groups = _by_model(comparisons)
    cols = min(2, len(groups))
    nrows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.4 * cols, 4.2 * nrows), squeeze=False)
    for ax, (model, rows) in zip(axes.flat, groups.items()):
        rows = sorted(rows, key=lambda c: (c.row.tokens, c.row.label))
        xs = list(range(len(rows)))
        ours = [c.ours_ms("graph") or math.nan for c in rows]
        label = OURS_LABEL if any(c.ours_ms("graph") for c in rows) else f"{OURS_LABEL}: not measured"
        ax.plot(xs, ours, marker="o", linewidth=2.2, color="black", label=label, zorder=3)
        for column in peer_columns:
            ys = [c.peers["graph"].get(column, math.nan) for c in rows]
            if not all(math.isnan(y) for y in ys):
                ax.plot(xs, ys, marker=".", linewidth=1.2, label=PEER_NAMES.get(column, column))
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{c.row.label}\n{_tokens_label(c.row.tokens)}" for c in rows], fontsize=7)
        ax.set_title(f"{title} {model} (hq={rows[0].row.hq}, hv={rows[0].row.hv})", fontsize=10)
        ax.set_ylabel("CUDA-graph latency, ms (log)")
        ax.set_xlabel("sequences packed (total tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.tight_layout()
    return _save(fig, path)


def speedup_figure(title: str, comparisons: Sequence[RowComparison], path: str) -> str:
    """Bars of best_peer_ms / ours_ms per row, a line at 1.0; unmeasured rows say 'missing'."""
    fig, ax = plt.subplots(figsize=(max(6.4, 0.32 * len(comparisons) + 2), 4.4))
    xs = list(range(len(comparisons)))
    for x, c in zip(xs, comparisons):
        ratio = c.ratio("graph")
        if ratio is None:
            ax.text(x, 0.05, "missing", rotation=90, ha="center", va="bottom", fontsize=7, color="gray")
            continue
        ax.bar(x, ratio, color="tab:green" if ratio >= 1 else "tab:red", width=0.8)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{c.row.model}|{c.row.label}" for c in comparisons], rotation=90, fontsize=7)
    ax.set_xlim(-0.6, len(comparisons) - 0.4)
    top = max([c.ratio("graph") for c in comparisons if c.ratio("graph") is not None] + [1.0])
    ax.set_ylim(0, 1.15 * top)
    ax.set_ylabel("speedup vs best peer (best peer ms / ours ms)")
    ax.set_title(f"{title}: {OURS_LABEL} against the fastest peer per row (CUDA graph)", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def write_plots(card: str, by_pass: Dict[str, List[RowComparison]], peer_columns: Sequence[str],
                out_dir: str) -> Dict[str, List[str]]:
    """The figures of one card: pass -> [latency PNG, speedup PNG], named ``<card>_<pass>_<kind>.png``."""
    os.makedirs(out_dir, exist_ok=True)
    written: Dict[str, List[str]] = {}
    for pass_, comparisons in by_pass.items():
        if comparisons:
            title = f"{card.upper()} {pass_}"
            stem = os.path.join(out_dir, f"{card}_{pass_}")
            written[pass_] = [latency_figure(title, comparisons, peer_columns, f"{stem}_latency.png"),
                              speedup_figure(title, comparisons, f"{stem}_speedup.png")]
    return written
