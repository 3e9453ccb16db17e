"""The benchmark matrix: which (pass, head configuration, sequence lengths) rows get timed.

The file format is the one the peer libraries' benchmark reads (packaged as ``matrix.json``, so an installed
wheel can benchmark without the repository)::

    {"head_dim": 128,
     "fwd": {"models": [[name, hq, hv], ...], "seqs": [[label, [len, ...]], ...]},
     "bwd": {...}}

Every pass times the cross product of its models and its sequence sets, in file order.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

PASSES = ("fwd", "bwd")
DEFAULT_MATRIX = Path(__file__).with_name("matrix.json")


@dataclass(frozen=True)
class BenchRow:
    """One timed configuration; ``key`` is the ``pass|model|seqs`` name peers and reports join on."""
    pass_: str
    model: str
    hq: int
    hv: int
    label: str
    seqlens: Tuple[int, ...]
    head_dim: int

    @property
    def key(self) -> str:
        return row_key(self.pass_, self.model, self.label)

    @property
    def tokens(self) -> int:
        return sum(self.seqlens)


def row_key(pass_: str, model: str, label: str) -> str:
    """The join key of every results file (ours and the peers')."""
    return f"{pass_}|{model}|{label}"


def load_matrix(path: Optional[str] = None) -> dict:
    """Read a matrix file (the packaged standard matrix when ``path`` is None) and check its shape."""
    with open(path or DEFAULT_MATRIX) as f:
        matrix = json.load(f)
    if not isinstance(matrix.get("head_dim"), int):
        raise ValueError(f"{path or DEFAULT_MATRIX}: 'head_dim' must be an integer")
    for pass_ in PASSES:
        section = matrix.get(pass_)
        if section is None:
            continue
        for model in section.get("models", []):
            if len(model) != 3:
                raise ValueError(f"{pass_}.models entries must be [name, hq, hv], got {model!r}")
        for seqs in section.get("seqs", []):
            if len(seqs) != 2 or not seqs[1] or any(int(n) < 1 for n in seqs[1]):
                raise ValueError(f"{pass_}.seqs entries must be [label, [len >= 1, ...]], got {seqs!r}")
    return matrix


def iter_rows(matrix: dict, passes: Sequence[str] = PASSES, substring: Optional[str] = None) -> Iterator[BenchRow]:
    """Rows of ``matrix`` for ``passes`` in file order; ``substring`` keeps rows whose key contains it."""
    for pass_ in PASSES:
        if pass_ not in passes or pass_ not in matrix:
            continue
        for model, hq, hv in matrix[pass_]["models"]:
            for label, seqlens in matrix[pass_]["seqs"]:
                row = BenchRow(pass_, model, int(hq), int(hv), label, tuple(int(n) for n in seqlens),
                               int(matrix["head_dim"]))
                if substring is None or substring in row.key:
                    yield row


def all_rows(matrix: dict, passes: Sequence[str] = PASSES) -> List[BenchRow]:
    return list(iter_rows(matrix, passes))
