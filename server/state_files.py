"""One session per safetensors file under ``--state-dir``: its state (when it has one) and its record.

``<state-dir>/<session_id>.safetensors`` holds the tensor ``state`` [Hv, K, V] and string metadata (format,
ttl, last use, tokens, head configuration). Files are written to a temporary name, flushed to the disk and
renamed over the old one, so a crash leaves either the previous file or the new one, never half of one.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FORMAT = "flash-qla-session/1"
SUFFIX = ".safetensors"


@dataclass
class SessionRecord:
    session_id: str
    created_at: float
    last_used: float
    ttl_s: Optional[float]
    tokens: int
    config: Optional[tuple]      # SessionConfig fields, or None before the first prefill
    has_state: bool = False

    def metadata(self) -> Dict[str, str]:
        return {"format": FORMAT, "session_id": self.session_id, "created_at": repr(self.created_at),
                "last_used": repr(self.last_used), "ttl_s": "" if self.ttl_s is None else repr(self.ttl_s),
                "tokens": str(self.tokens), "config": "" if self.config is None else json.dumps(list(self.config))}

    @classmethod
    def from_metadata(cls, meta: Dict[str, str], has_state: bool) -> "SessionRecord":
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file (format {meta.get('format')!r})")
        config = json.loads(meta["config"]) if meta.get("config") else None
        return cls(meta["session_id"], float(meta["created_at"]), float(meta["last_used"]),
                   float(meta["ttl_s"]) if meta.get("ttl_s") else None, int(meta["tokens"]),
                   tuple(config) if config is not None else None, has_state)


def path_of(state_dir: Path, session_id: str) -> Path:
    return state_dir / f"{session_id}{SUFFIX}"


def write(state_dir: Path, record: SessionRecord, state: Optional[torch.Tensor]) -> None:
    """Write (or replace) a session's file atomically."""
    final = path_of(state_dir, record.session_id)
    tmp = final.with_name(final.name + ".tmp")
    tensors = {} if state is None else {"state": state.detach().to("cpu").contiguous()}
    save_file(tensors, str(tmp), metadata=record.metadata())
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def read_record(path: Path) -> SessionRecord:
    """The record of one file, without reading its state."""
    with safe_open(str(path), framework="pt") as f:
        return SessionRecord.from_metadata(dict(f.metadata() or {}), has_state="state" in f.keys())


def read_state(state_dir: Path, session_id: str) -> torch.Tensor:
    return load_file(str(path_of(state_dir, session_id)))["state"]


def remove(state_dir: Path, session_id: str) -> None:
    try:
        path_of(state_dir, session_id).unlink()
    except FileNotFoundError:
        pass
