"""Reading and writing flash_qla/_kernels/sm90a (manifest.json + xz-compressed cubins)."""
from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Dict

from .variants import ROOT

KERNEL_DIR = ROOT / "flash_qla" / "_kernels" / "sm90a"
MANIFEST = KERNEL_DIR / "manifest.json"


def load_manifest(path: Path = MANIFEST) -> Dict:
    if not path.exists():
        return {"format_version": 1, "arch": "sm_90a", "toolchain": {}, "build_date": None, "kernels": []}
    return json.loads(path.read_text())


def write_manifest(manifest: Dict, path: Path = MANIFEST) -> None:
    manifest["kernels"] = sorted(manifest["kernels"], key=lambda e: e["key"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=0, separators=(",", ":")) + "\n")  # one key a line, no padding


def write_cubin(name: str, cubin: bytes, directory: Path = KERNEL_DIR) -> int:
    """Write ``name`` as xz (preset 9, deterministic); returns the compressed size."""
    data = lzma.compress(cubin, preset=9)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(data)
    return len(data)


def read_cubin(name: str, directory: Path = KERNEL_DIR) -> bytes:
    return lzma.decompress((directory / name).read_bytes())
