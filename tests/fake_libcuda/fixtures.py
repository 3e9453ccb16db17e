"""Test helpers: build the fake libcuda, write a fixture kernel directory (manifest.json + fake *.cubin.xz)."""
from __future__ import annotations

import copy
import ctypes
import hashlib
import json
import lzma
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fake_libcuda.c"


def build_fake_libcuda(out_dir: Path, old: bool = False) -> Path:
    """Compile fake_libcuda.c into ``out_dir`` (``old``: without cuTensorMapEncodeTiled, like a pre-12.0 driver)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) to build the fake libcuda")
    out = Path(out_dir) / ("libfakecuda_old.so" if old else "libfakecuda.so")
    cmd = [cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(SOURCE)]
    if old:
        cmd.insert(1, "-DFAKE_NO_TENSORMAP")
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


class Fake:
    """ctypes view of the fake driver's recorded state (same instance as the one _launcher dlopen()ed)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lib = ctypes.CDLL(str(path))
        self.lib.fake_stat.restype = ctypes.c_long
        self.lib.fake_stat.argtypes = [ctypes.c_char_p]
        self.lib.fake_last_attr.restype = ctypes.c_int
        self.lib.fake_current_context.restype = ctypes.c_void_p

    def stat(self, name: str) -> int:
        v = self.lib.fake_stat(name.encode())
        assert v >= 0, name
        return v

    def reset(self) -> None:
        self.lib.fake_reset()

    def last_attr(self):
        kind = ctypes.c_int()
        value = self.lib.fake_last_attr(ctypes.byref(kind))
        return kind.value, value

    def current_context(self) -> Optional[int]:
        return self.lib.fake_current_context()

    def last_launch(self) -> Dict[str, Any]:
        grid = (ctypes.c_uint * 3)()
        block = (ctypes.c_uint * 3)()
        smem = ctypes.c_uint()
        stream = ctypes.c_uint64()
        sym = ctypes.create_string_buffer(128)
        params = (ctypes.c_ubyte * 4096)()
        n = self.lib.fake_last_launch(grid, block, ctypes.byref(smem), ctypes.byref(stream), sym, params, 4096)
        return {"grid": tuple(grid), "block": tuple(block), "smem": smem.value, "stream": stream.value,
                "symbol": sym.value.decode(), "params": bytes(params[:n])}


def decode_fake_map(b: bytes) -> Dict[str, Any]:
    """Decode the 128 bytes the fake cuTensorMapEncodeTiled wrote (see FakeMap in fake_libcuda.c)."""
    import struct
    assert len(b) == 128
    magic, dtype, rank, interleave, swizzle, l2, oob, _pad = struct.unpack_from("<8I", b, 0)
    assert magic == 0x544D4150, hex(magic)
    (addr,) = struct.unpack_from("<Q", b, 32)
    dims = struct.unpack_from("<5I", b, 40)
    strides = struct.unpack_from("<4I", b, 60)
    box = struct.unpack_from("<5I", b, 76)
    estr = struct.unpack_from("<5I", b, 96)
    return {"dtype": dtype, "rank": rank, "address": addr, "dims": dims[:rank], "strides": strides[:rank - 1],
            "box": box[:rank], "element_strides": estr[:rank], "interleave": interleave, "swizzle": swizzle,
            "l2_promotion": l2, "oob_fill": oob}


SIG = {"ptr": "p", "i32": "i", "i64": "l", "f32": "f", "tensormap": "m"}


def kkt_entry(key: str = "kkt_solve.bf16.K128", dtype: str = "bf16", K: int = 128, smem: int = 16384,
              symbol: str = "kkt_solve_kernel") -> Dict[str, Any]:
    """A kernel entry with every parameter kind and two tensor maps."""
    return {
        "key": key, "kernel": "kkt_solve", "variant": {"dtype": dtype, "K": K},
        "file": f"{key}.cubin.xz", "sha256": "0" * 64, "source_hash": "ab" * 8,
        "symbol": symbol, "block": [128, 1, 1], "smem": smem,
        "grid": ["NT", "H", "1"],
        "params": [
            {"name": "k", "kind": "ptr"},
            {"name": "v", "kind": "ptr"},
            {"name": "o", "kind": "ptr"},
            {"name": "H", "kind": "i32", "expr": "H"},
            {"name": "T", "kind": "i64", "expr": "NT * 64"},
            {"name": "scale", "kind": "f32", "expr": "scale"},
            {"name": "k_desc", "kind": "tensormap", "dtype": 10, "rank": 3, "address": "k",
             "dims": [str(K), "H", "NT * 64"], "strides": [str(2 * K), f"H * {2 * K}"],
             "box": ["64", "1", "64"], "element_strides": ["1", "1", "1"],
             "interleave": 0, "swizzle": 3, "l2_promotion": 2, "oob_fill": 0},
            {"name": "v_desc", "kind": "tensormap", "dtype": 10, "rank": 2, "address": "v",
             "dims": ["128", "ceil_div(NT * 64, 64) * 64"], "strides": ["256"],
             "box": ["64", "min(NT * 64, 128)"], "element_strides": ["1", "1"],
             "interleave": 0, "swizzle": 2, "l2_promotion": 1, "oob_fill": 0},
        ],
        "registers": 90, "spills": 0, "cubin_bytes": 0, "compile_seconds": 3.2,
    }


def simple_entry(key: str, kernel: str, variant: Dict[str, Any], symbol: str = "simple_kernel") -> Dict[str, Any]:
    return {"key": key, "kernel": kernel, "variant": variant, "file": f"{key}.cubin.xz", "sha256": "0" * 64,
            "source_hash": "cd" * 8, "symbol": symbol, "block": [256, 1, 1], "smem": 0,
            "grid": ["ceil_div(N, 256)", "1", "1"],
            "params": [{"name": "x", "kind": "ptr"}, {"name": "N", "kind": "i32", "expr": "N"}]}


def base_manifest(kernels: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {"format_version": 1, "arch": "sm_90a",
            "toolchain": {"tilelang": "0.1.15", "nvcc": "13.0.88", "min_driver_api": 13000, "min_driver": "580"},
            "build_date": "2025-01-01T00:00:00Z", "kernels": copy.deepcopy(kernels)}


def default_entries() -> List[Dict[str, Any]]:
    return [kkt_entry(),
            kkt_entry("kkt_solve.fp16.K128", dtype="fp16", symbol="kkt_solve_kernel_fp16"),
            kkt_entry("kkt_solve.bf16.K64.bigsmem", K=64, smem=100 * 1024, symbol="kkt_big"),
            simple_entry("scale.bf16", "scale", {"dtype": "bf16"})]


def fake_cubin(entry: Dict[str, Any]) -> bytes:
    sig = "".join(SIG[p["kind"]] for p in entry["params"]) or "-"
    return f"FAKECUBIN\n{entry['symbol']} {sig}\n".encode()


def write_kernel_dir(root: Path, entries: Optional[List[Dict[str, Any]]] = None,
                     mutate=None) -> Path:
    """Write manifest.json + one fake cubin per entry (sha256 and cubin_bytes filled in) under ``root``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    entries = copy.deepcopy(default_entries() if entries is None else entries)
    for e in entries:
        image = fake_cubin(e)
        e["sha256"] = hashlib.sha256(image).hexdigest()
        e["cubin_bytes"] = len(image)
        (root / e["file"]).write_bytes(lzma.compress(image))
    m = base_manifest(entries)
    if mutate is not None:
        mutate(m)
    (root / "manifest.json").write_text(json.dumps(m, indent=1))
    return root


def subprocess_env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("FAKE_CUDA_") or k in ("FLASH_QLA_LIBCUDA", "FLASH_QLA_KERNELS_DIR"):
            del env[k]
    env.update(extra)
    return env
