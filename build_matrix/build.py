"""`build_matrix build`: compile every stale variant in parallel, write cubins and the manifest."""
from __future__ import annotations

import datetime
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Dict, List, Sequence

from .hashing import sha256_bytes, source_hash
from .manifest_io import KERNEL_DIR, load_manifest, read_cubin, write_cubin, write_manifest
from .toolchain import minimum_driver, nvcc_version, tilelang_version
from .variants import ROOT, Variant, module_constant, all_variants, build_prim_func, pass_configs


def _compile_one(v: Variant) -> Dict:
    """Worker: compile one variant (runs in a child process; imports TileLang there)."""
    sys.path.insert(0, str(ROOT))
    from aot.compile import compile_kernel
    ck = compile_kernel(build_prim_func(v), pass_configs(v))
    return {"cubin": ck.cubin, "symbol": ck.symbol, "block": ck.block, "grid": ck.grid, "smem": ck.smem,
            "params": ck.params, "registers": ck.registers, "spills": ck.spills,
            "compile_seconds": round(ck.compile_seconds, 2)}


def _with_carveout(entry: Dict) -> Dict:
    """The entry with its kernel module's SHARED_CARVEOUT (percent), if the module declares one."""
    entry = {k: v for k, v in entry.items() if k != "shared_carveout"}
    carveout = module_constant(entry["kernel"], "SHARED_CARVEOUT")
    if carveout is not None:
        entry["shared_carveout"] = int(carveout)
    return entry


def _is_current(entry: Dict, want_hash: str) -> bool:
    if entry is None or entry.get("source_hash") != want_hash:
        return False
    try:
        return sha256_bytes(read_cubin(entry["file"])) == entry["sha256"]
    except (OSError, ValueError):
        return False


def build(subset: str = "full", jobs: int = 0, force: bool = False, only: Sequence[str] = ()) -> List[Dict]:
    from tqdm import tqdm
    tl_ver, nv_ver = tilelang_version(), nvcc_version()
    api, branch = minimum_driver(nv_ver)
    manifest = load_manifest()
    old = {e["key"]: e for e in manifest["kernels"]}
    variants = all_variants(subset)
    todo, rows = [], []
    for v in variants:
        h = source_hash(v, tl_ver, nv_ver)
        if not force and _is_current(old.get(v.key), h):
            rows.append(dict(old[v.key], cached=True))
        elif only and not any(part in v.key for part in only):
            if v.key in old:
                rows.append(dict(old[v.key], cached=True))
        else:
            todo.append((v, h))
    jobs = jobs or os.cpu_count() or 1
    if todo:
        with ProcessPoolExecutor(max_workers=min(jobs, len(todo))) as pool:
            futures = {pool.submit(_compile_one, v): (v, h) for v, h in todo}
            for fut in tqdm(as_completed(futures), total=len(futures), desc="compiling sm_90a variants", unit="kernel"):
                v, h = futures[fut]
                res = fut.result()
                cubin = res.pop("cubin")
                fname = f"{v.key}.cubin.xz"
                xz_bytes = write_cubin(fname, cubin)
                entry = {"key": v.key, "kernel": v.kernel, "variant": v.params, "file": fname,
                         "sha256": sha256_bytes(cubin), "source_hash": h, **res,
                         "cubin_bytes": len(cubin), "xz_bytes": xz_bytes}
                old[v.key] = entry
                rows.append(dict(entry, cached=False))
    keep = {v.key for v in all_variants("full")}
    manifest["kernels"] = [_with_carveout(e) for k, e in old.items() if k in keep]
    manifest["toolchain"] = {"tilelang": tl_ver, "nvcc": nv_ver, "min_driver_api": api, "min_driver": branch}
    if todo or not manifest.get("build_date"):
        manifest["build_date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    write_manifest(manifest)
    for stray in KERNEL_DIR.glob("*.cubin.xz"):  # cubins of variants no longer declared
        if stray.name not in {e["file"] for e in manifest["kernels"]}:
            stray.unlink()
    return sorted(rows, key=lambda r: r["key"])


def print_summary(rows: List[Dict], seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"sm_90a kernel variants ({len(rows)}; {seconds:.1f} s)")
    for col in ("variant", "cubin B", "xz B", "regs", "spills", "smem B", "compile s", "cached"):
        table.add_column(col, justify="left" if col == "variant" else "right", no_wrap=(col == "variant"))
    for r in rows:
        table.add_row(r["key"], str(r["cubin_bytes"]), str(r["xz_bytes"]), str(r["registers"]), str(r["spills"]),
                      str(r["smem"]), f"{r['compile_seconds']:.1f}", "yes" if r["cached"] else "")
    Console().print(table)


def main(subset: str, jobs: int, force: bool, only: Sequence[str] = ()) -> int:
    start = time.perf_counter()
    rows = build(subset, jobs, force, only)
    print_summary(rows, time.perf_counter() - start)
    return 0
