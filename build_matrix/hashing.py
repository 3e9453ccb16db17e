"""Content hashes that decide whether a committed cubin is still current.

The hash covers the kernel's source, the compiler driver, the variant and the toolchain versions, so
`check` can recompute it on a machine without TileLang or nvcc (versions come from the manifest).
"""
from __future__ import annotations

import hashlib
import json
import re

from .variants import COMPILER, Variant


def source_hash(v: Variant, tilelang_version: str, nvcc_version: str) -> str:
    h = hashlib.sha256()
    source = v.source_path.read_bytes()
    for part in (source, *shared_sources(v.source_path, source), COMPILER.read_bytes(),
                 json.dumps(v.params, sort_keys=True).encode(), tilelang_version.encode(), nvcc_version.encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()


def shared_sources(kernel_path, source: bytes) -> list:
    """The bytes of the sibling helper modules a kernel imports (`from .name import ...`), so that changing a
    shared helper makes exactly its importers stale."""
    names = re.findall(rb"^from \.(\w+) import", source, flags=re.M)
    return [(kernel_path.parent / f"{n.decode()}.py").read_bytes() for n in sorted(set(names))]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
