"""Content hashes that decide whether a committed cubin is still current.

The hash covers the kernel's source, the compiler driver, the variant and the toolchain versions, so
`check` can recompute it on a machine without TileLang or nvcc (versions come from the manifest).
"""
from __future__ import annotations

import hashlib
import json

from .variants import COMPILER, Variant


def source_hash(v: Variant, tilelang_version: str, nvcc_version: str) -> str:
    h = hashlib.sha256()
    for part in (v.source_path.read_bytes(), COMPILER.read_bytes(),
                 json.dumps(v.params, sort_keys=True).encode(), tilelang_version.encode(), nvcc_version.encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
