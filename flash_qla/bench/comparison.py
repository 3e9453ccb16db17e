"""Join our results with the peers' timings, row by row, as ``../shared/bench/compare.py`` does.

Peer sources, each becoming one or more named columns:
* fresh peer runs (``--peers-fresh``: peer_bench.py JSONL from the same run and GPU as ours): ``qla``, ``fla``;
* the stored anchors (``--peers``: anchors_h200.jsonl, the same schema): ``qla anchor``, ``fla anchor``;
* FlashQLA's published table (``--published``: published_h200.json): ``pub flash_qla``, ``pub fla``, ...

best peer = the fastest column for the row; ``x best`` = best_ms / ours_graph_ms (above 1: we are faster);
``x qla`` = FlashQLA's time / ours, from the fresh run when there is one, else the anchors.
Our missing rows stay missing: no ratio is computed for them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

from .matrix import BenchRow, row_key
from .roofline import floor_ms


def load_jsonl(path: str) -> List[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def records_by_key(records: Iterable[dict]) -> Dict[str, dict]:
    """Index records by ``pass|model|seqs``; a later record for the same row replaces an earlier one."""
    return {row_key(r["pass_"], r["model"], r["seqs"]): r for r in records}


@dataclass
class PeerTimings:
    """graph_ms of every peer column for every row key, plus the column order to show them in."""
    columns: List[str] = field(default_factory=list)
    by_key: Dict[str, Dict[str, float]] = field(default_factory=dict)
    devices: Dict[str, str] = field(default_factory=dict)  # column -> GPU it was measured on
    qla_column: Optional[str] = None

    def add(self, column: str, key: str, ms: Optional[float], device: str = "") -> None:
        if column not in self.columns:
            self.columns.append(column)
        if device:
            self.devices.setdefault(column, device)
        if ms:  # null (cannot be captured) or 0 is no timing
            self.by_key.setdefault(key, {})[column] = float(ms)

    def add_jsonl_records(self, records: Iterable[dict], suffix: str = "") -> None:
        for r in records:
            column = f"{r['lib']}{suffix}"
            self.add(column, row_key(r["pass_"], r["model"], r["seqs"]), r.get("graph_ms"), r.get("device", ""))
            if r["lib"] == "qla" and (self.qla_column is None or not suffix):
                self.qla_column = column  # a fresh qla run outranks the anchors

    def add_published(self, published: dict) -> None:
        source = published.get("source", "published table")
        for key, libs in published["rows"].items():
            for lib, ms in libs.items():
                self.add(f"pub {lib}", key, ms, source)


def load_peers(anchors: Optional[str], published: Optional[str], fresh: Sequence[str] = ()) -> PeerTimings:
    peers = PeerTimings()
    for path in fresh:
        peers.add_jsonl_records(load_jsonl(path))
    if anchors:
        peers.add_jsonl_records(load_jsonl(anchors), suffix=" anchor")
    if published:
        with open(published) as f:
            peers.add_published(json.load(f))
    return peers


@dataclass
class RowComparison:
    row: BenchRow
    ours: Optional[dict]                    # our record, or None when the row was never measured
    peers: Dict[str, float]                 # column -> graph_ms
    best_column: Optional[str]
    best_ms: Optional[float]
    qla_ms: Optional[float]
    floor_ms: Optional[float]

    @property
    def ours_graph_ms(self) -> Optional[float]:
        return None if self.ours is None else self.ours.get("graph_ms")

    @property
    def ours_eager_ms(self) -> Optional[float]:
        return None if self.ours is None else self.ours.get("eager_ms")

    @property
    def measured(self) -> bool:
        return self.ours_graph_ms is not None

    def _over_ours(self, ms: Optional[float]) -> Optional[float]:
        return ms / self.ours_graph_ms if (ms and self.measured) else None

    @property
    def speedup_vs_best(self) -> Optional[float]:
        return self._over_ours(self.best_ms)

    @property
    def speedup_vs_qla(self) -> Optional[float]:
        return self._over_ours(self.qla_ms)

    @property
    def percent_of_floor(self) -> Optional[float]:
        return None if (self.floor_ms is None or not self.measured) else 100 * self.floor_ms / self.ours_graph_ms


def compare_rows(rows: Sequence[BenchRow], ours: Dict[str, dict], peers: PeerTimings,
                 gpu: Optional[str]) -> List[RowComparison]:
    out = []
    for row in rows:
        timings = peers.by_key.get(row.key, {})
        best_column = min(timings, key=timings.get) if timings else None
        out.append(RowComparison(
            row=row, ours=ours.get(row.key), peers=timings, best_column=best_column,
            best_ms=timings.get(best_column) if best_column else None,
            qla_ms=timings.get(peers.qla_column) if peers.qla_column else None,
            floor_ms=floor_ms(row.pass_, row.seqlens, row.hq, row.hv, gpu) if gpu else None))
    return out


def geomean(values: Sequence[float]) -> Optional[float]:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None
