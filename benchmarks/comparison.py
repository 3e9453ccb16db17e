"""Join one card's rows: ours against every peer timed beside it, per matrix row.

``x best`` = the fastest peer's ms / our ms (above 1: we are faster), computed for the CUDA-graph medians
(``graph``: kernel time, what libraries are compared on) and for the eager medians (``eager``: what an
eager PyTorch caller sees, host work included). Rows we did not measure stay missing: no ratio is invented.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from flash_qla.bench.matrix import BenchRow, iter_rows

from .cards import Card, by_key
from .roofline import floor_ms

TIMINGS = ("graph", "eager")


@dataclass
class RowComparison:
    row: BenchRow
    ours: Optional[dict]                       # our record, or None when the row was never measured
    peers: Dict[str, Dict[str, float]]         # timing -> {peer: ms}; peers without a timing are left out
    floor_ms: Optional[float]

    def ours_ms(self, timing: str) -> Optional[float]:
        return None if self.ours is None else self.ours.get(f"{timing}_ms")

    def best(self, timing: str) -> Tuple[Optional[str], Optional[float]]:
        times = self.peers[timing]
        if not times:
            return None, None
        name = min(times, key=times.get)
        return name, times[name]

    def ratio(self, timing: str, peer: Optional[str] = None) -> Optional[float]:
        """peer ms / our ms (the fastest peer when ``peer`` is None); None when either is missing."""
        mine = self.ours_ms(timing)
        theirs = self.best(timing)[1] if peer is None else self.peers[timing].get(peer)
        return theirs / mine if (mine and theirs) else None

    @property
    def percent_of_floor(self) -> Optional[float]:
        mine = self.ours_ms("graph")
        return 100 * self.floor_ms / mine if (mine and self.floor_ms) else None


def compare_card(matrix: dict, card: Card, pass_: str) -> List[RowComparison]:
    ours = by_key(card.ours)
    peers = {stem: by_key(records) for stem, records in card.peers.items()}
    gpu = card.gpu
    out = []
    for row in iter_rows(matrix, (pass_,)):
        timed = {t: {stem: rec[row.key][f"{t}_ms"] for stem, rec in peers.items()
                     if row.key in rec and rec[row.key].get(f"{t}_ms")} for t in TIMINGS}
        out.append(RowComparison(row=row, ours=ours.get(row.key), peers=timed,
                                 floor_ms=floor_ms(pass_, row.seqlens, row.hq, row.hv, gpu) if gpu else None))
    return out


def geomean(values: Sequence[float]) -> Optional[float]:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


@dataclass
class RatioSummary:
    rows: int                 # rows with a ratio
    geomean: Optional[float]
    minimum: Optional[float]
    at_or_above: int          # rows where we are at least as fast

    def text(self) -> str:
        if not self.rows:
            return "no rows to compare"
        return (f"geomean {self.geomean:.2f}x (min {self.minimum:.3f}x, {self.at_or_above}/{self.rows} rows "
                f"at or above 1.0)")


def summarize(comparisons: Sequence[RowComparison], timing: str, peer: Optional[str] = None) -> RatioSummary:
    ratios = [r for r in (c.ratio(timing, peer) for c in comparisons) if r is not None]
    return RatioSummary(rows=len(ratios), geomean=geomean(ratios), minimum=min(ratios) if ratios else None,
                        at_or_above=sum(r >= 1.0 for r in ratios))
