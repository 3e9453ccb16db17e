"""Versions of the build toolchain and the driver they imply."""
from __future__ import annotations

import re
import subprocess


def nvcc_version() -> str:
    out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+\.\d+), V(\d+\.\d+\.\d+)", out)
    if not m:
        raise RuntimeError(f"cannot parse nvcc --version:\n{out}")
    return m.group(2)


def tilelang_version() -> str:
    import tilelang
    return tilelang.__version__


def minimum_driver(nvcc: str) -> tuple[int, str]:
    """(cuDriverGetVersion value, NVIDIA driver branch) a cubin built by this nvcc needs.

    Cubins (SASS) for sm_90a carry the toolkit's ELF ABI; CUDA 13.x builds need an R580+ driver and
    CUDA 12.x builds R525+ (12.0) and later branches per minor (NVIDIA's CUDA compatibility table).
    """
    major, minor = (int(x) for x in nvcc.split(".")[:2])
    api = major * 1000 + minor * 10
    branch = {13: "580"}.get(major) or {(12, m): b for m, b in
                                        [(0, "525"), (1, "530"), (2, "535"), (3, "545"), (4, "550"), (5, "555"),
                                         (6, "560"), (8, "570"), (9, "575")]}.get((major, minor), "unknown")
    return api, branch
