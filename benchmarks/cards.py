"""One card's result folder: what ``scripts/gpu_bench.sh`` and ``scripts/gpu_validate.sh`` leave behind.

    bench/results/h100/
        ours.jsonl            python -m flash_qla.bench (required)
        qla.jsonl, fla.jsonl, fi.jsonl
                              the peers (FlashQLA, FLA, FlashInfer), timed in the same call on the same card
        host_overhead.json    host cost of one call (optional)
        ncu.jsonl             scripts/ncu_summary.py's rows (optional)
        short_batches.jsonl   scripts/short_batch_sweep.py merge: batches of short sequences, ours beside the peers
                              (optional)
        *.log                 validation and sanitizer logs (optional; their summary lines are quoted)

Every JSONL line is one matrix row: lib, version, device, pass_, model, hq, hv, seqs, eager_ms, graph_ms,
first_call_s (ours adds backend, torch, peak_mem_mb, ...). A later line for the same row replaces an earlier one.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from flash_qla.bench.matrix import row_key

from .roofline import gpu_family

OURS_FILE = "ours.jsonl"
PEER_FILES = ("qla", "fla", "fi")                       # file stems, in column order
PEER_NAMES = {"qla": "FlashQLA", "fla": "FLA", "fi": "FlashInfer"}
REQUIRED_KEYS = ("lib", "device", "pass_", "model", "seqs", "graph_ms", "eager_ms")
# Lines of a log worth quoting: pytest's totals, compute-sanitizer's summaries, the stress check's verdicts.
SUMMARY_LINE = re.compile(r"(\d+ (passed|failed)|ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY|"
                          r"gradient mismatches|STALL)")


class CardError(ValueError):
    """A result folder that cannot be reported (missing or malformed file)."""


def load_jsonl(path: Path) -> List[dict]:
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CardError(f"{path}:{number}: not JSON ({exc.msg})") from None
            missing = [k for k in REQUIRED_KEYS if k not in record]
            if missing:
                raise CardError(f"{path}:{number}: missing {', '.join(missing)}")
            records.append(record)
    return records


def _plain_jsonl(path: Path) -> List[dict]:
    """An optional file's JSON lines, any schema (none when the file is absent)."""
    if not path.is_file():
        return []
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise CardError(f"{path}: not JSON ({exc.msg})") from None


def by_key(records: List[dict]) -> Dict[str, dict]:
    """Index records by ``pass|model|seqs``; a later record for the same row replaces an earlier one."""
    return {row_key(r["pass_"], r["model"], r["seqs"]): r for r in records}


@dataclass
class Card:
    name: str                                  # the folder's name, e.g. h100
    path: Path
    ours: List[dict]
    peers: Dict[str, List[dict]] = field(default_factory=dict)   # file stem -> records
    host_cost: Optional[dict] = None
    log_summaries: Dict[str, List[str]] = field(default_factory=dict)
    ncu: List[dict] = field(default_factory=list)  # scripts/ncu_summary.py's rows (ncu.jsonl)
    short_batches: List[dict] = field(default_factory=list)  # short_batch_sweep.py merge's "compare" rows

    @property
    def devices(self) -> List[str]:
        return sorted({r["device"] for r in self.ours})

    @property
    def gpu(self) -> Optional[str]:
        """The card kind whose ceilings set the floor: where ours ran, else where the peers ran."""
        for records in [self.ours] + list(self.peers.values()):
            kinds = {gpu_family(r["device"]) for r in records} - {None}
            if len(kinds) == 1:
                return kinds.pop()
        return None

    def mismatched_peers(self) -> List[str]:
        """Peers timed on another kind of card than ours: their ratios would compare two machines."""
        ours = {gpu_family(d) for d in self.devices}
        return [stem for stem, records in self.peers.items()
                if {gpu_family(r["device"]) for r in records} != ours]


def load_card(path: str) -> Card:
    folder = Path(path)
    if not folder.is_dir():
        raise CardError(f"{folder}: no such result folder")
    ours_path = folder / OURS_FILE
    if not ours_path.is_file():
        raise CardError(f"{folder}: no {OURS_FILE} (write it with scripts/gpu_bench.sh or python -m flash_qla.bench)")
    card = Card(name=folder.name, path=folder, ours=load_jsonl(ours_path))
    for stem in PEER_FILES:
        peer_path = folder / f"{stem}.jsonl"
        if peer_path.is_file():
            card.peers[stem] = load_jsonl(peer_path)
    host = folder / "host_overhead.json"
    if host.is_file():
        try:
            card.host_cost = json.loads(host.read_text())
        except json.JSONDecodeError as exc:
            raise CardError(f"{host}: not JSON ({exc.msg})") from None
    card.ncu = _plain_jsonl(folder / "ncu.jsonl")
    card.short_batches = [r for r in _plain_jsonl(folder / "short_batches.jsonl") if r.get("lib") == "compare"]
    for log in sorted(folder.glob("*.log")):
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if SUMMARY_LINE.search(ln)]
        card.log_summaries[log.name] = lines
    return card
