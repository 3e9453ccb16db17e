#!/usr/bin/env python
"""Host cost of one flash_qla kernel launch with two tensor maps, in microseconds.

Run on the GPU machine:
    python scripts/launch_overhead.py [--key KEY] [--size NAME=VALUE ...] [--out launch_overhead.json]

It picks a manifest kernel with two tensor maps (the most common shape of a TileLang Hopper kernel; use --key to
choose) and times, per call, with perf_counter_ns around the Python call only:
  kernel_launch      Kernel.launch(device, stream, sizes, pointers): argument builder + tensor-map cache hit + launch
  raw_launch         _launcher.launch(...) with prebuilt args (tensor-map cache hit)
  arg_build          the precompiled argument builder alone
  launch_2_encodes   _launcher.launch where both tensor maps miss the cache (new addresses every call)
The stream is never synchronised inside a timed call; launches go in batches and the stream is synchronised
between batches (untimed) so a full launch queue never blocks a timed call. Buffers are zeroed and every size
defaults to 1 (override with --size), so each launch is a real but tiny kernel. The reference point is a Python
launcher through cuda-bindings at 20.7 us per launch with two tensor maps.

--no-gpu runs against whatever driver FLASH_QLA_LIBCUDA names without torch or real buffers (CI smoke test with
the fake libcuda from tests/fake_libcuda).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any, Dict, List

REFERENCE_CUDA_BINDINGS_US = 20.7


def _stats(ns: List[int], overhead_ns: float) -> Dict[str, float]:
    us = sorted(max(0.0, (x - overhead_ns)) / 1000.0 for x in ns)
    n = len(us)
    return {"median": round(statistics.median(us), 3), "p10": round(us[n // 10], 3), "p90": round(us[(9 * n) // 10], 3),
            "mean": round(sum(us) / n, 3), "min": round(us[0], 3), "n": n}


def _timed(fn, iters: int, batch: int, sync) -> List[int]:
    pc = time.perf_counter_ns
    out: List[int] = []
    done = 0
    while done < iters:
        m = min(batch, iters - done)
        for _ in range(m):
            t0 = pc()
            fn()
            out.append(pc() - t0)
        done += m
        sync()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=None, help="kernel directory (default: installed package data)")
    ap.add_argument("--key", default=None, help="manifest key of the kernel to time (default: first with 2 maps)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=256, help="launches between (untimed) stream syncs")
    ap.add_argument("--size", action="append", default=[], metavar="NAME=VALUE", help="run-time size value")
    ap.add_argument("--buffer-mib", type=int, default=64, help="bytes allocated per pointer name")
    ap.add_argument("--no-gpu", action="store_true", help="no torch, fake pointers (for a fake driver)")
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    a = ap.parse_args(argv)

    from flash_qla import _launcher
    from flash_qla.loader import KernelLibrary, library

    lib = KernelLibrary(a.kernels) if a.kernels else library()
    m = lib.manifest
    result: Dict[str, Any] = {"what": "host us per launch, two tensor maps", "python": platform.python_version(),
                              "reference_cuda_bindings_us": REFERENCE_CUDA_BINDINGS_US,
                              "manifest": {"tilelang": m.toolchain.tilelang, "nvcc": m.toolchain.nvcc,
                                           "kernels": len(m.kernels)}}
    if a.key:
        k = lib.kernel_by_key(a.key)
    else:
        two = [e for e in m.kernels if e.num_tensormaps == 2] or [e for e in m.kernels if e.num_tensormaps > 2]
        if not two:
            counts = sorted({e.num_tensormaps for e in m.kernels})
            msg = (f"no kernel with two tensor maps in the manifest ({len(m.kernels)} kernels; tensor-map counts "
                   f"present: {counts}); nothing measured")
            print(msg)
            result["error"] = msg
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(result, f, indent=2)
            return 0
        k = lib.kernel_by_key(two[0].key)
    e = k.entry
    result["kernel"] = {"key": e.key, "symbol": e.symbol, "num_tensormaps": e.num_tensormaps,
                        "num_params": len(e.params), "signature": e.signature.decode()}

    sizes: Dict[str, Any] = {}
    float_names = {n for p in e.params if p.kind == "f32" for n in p.expr.names}
    for n in e.size_names:
        sizes[n] = 1.0 if n in float_names else 1
    for s in a.size:
        name, _, val = s.partition("=")
        sizes[name] = float(val) if "." in val else int(val)
    result["sizes"] = sizes

    dev = a.device
    if a.no_gpu:
        torch = None
        pointers = {n: 0x10000000 * (i + 1) for i, n in enumerate(e.pointer_names)}
        stream = 0
        sync = lambda: None  # noqa: E731
        result["device"] = {"name": _launcher.device_name(dev), "mode": "no-gpu (driver: %s)" % "fake/other"}
    else:
        import torch
        if not torch.cuda.is_available():
            print("torch sees no CUDA device; use --no-gpu with a fake driver for a smoke run")
            return 2
        torch.cuda.set_device(dev)
        bufs = {n: torch.zeros(a.buffer_mib << 20, dtype=torch.uint8, device=f"cuda:{dev}")
                for n in e.pointer_names}
        pointers = {n: t.data_ptr() for n, t in bufs.items()}
        s = torch.cuda.Stream(dev)
        torch.cuda.set_stream(s)
        stream = s.cuda_stream
        sync = s.synchronize
        result["device"] = {"name": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    result["driver_api"] = _launcher.driver_version()

    # warm up: loads the module, compiles the builder, fills the tensor-map cache
    for _ in range(a.warmup):
        k.launch(dev, stream, sizes, pointers)
    sync()

    pc = time.perf_counter_ns
    empty = []
    for _ in range(20000):
        t0 = pc()
        empty.append(pc() - t0)
    overhead = statistics.median(empty)
    result["timer_overhead_ns"] = overhead

    fn = k.load(dev)
    grid, args = k.build_args(sizes, pointers)
    raw = _launcher.launch
    block, smem, sig, builder = k.block, k.smem, k.signature, k.builder

    r: Dict[str, Any] = {}
    r["kernel_launch_us"] = _stats(_timed(lambda: k.launch(dev, stream, sizes, pointers), a.iters, a.batch, sync),
                                   overhead)
    r["raw_launch_us"] = _stats(_timed(lambda: raw(fn, grid, block, smem, stream, sig, args), a.iters, a.batch, sync),
                                overhead)
    r["arg_build_us"] = _stats(_timed(lambda: builder(sizes, pointers), a.iters, a.batch, lambda: None), overhead)

    # both maps miss the cache: shift every pointer by a different 256-byte step each call
    n_distinct = 8192
    variants = []
    for i in range(n_distinct):
        _, av = k.build_args(sizes, {n: p + 256 * i for n, p in pointers.items()})
        variants.append(av)
    it = iter(range(10 ** 12))

    def miss():
        raw(fn, grid, block, smem, stream, sig, variants[next(it) % n_distinct])
    _launcher.clear_tensormap_cache()
    r["launch_2_encodes_us"] = _stats(_timed(miss, min(a.iters, n_distinct), a.batch, sync), overhead)
    result.update(r)
    result["tensormap_cache"] = dict(zip(("hits", "misses", "entries"), _launcher.tensormap_cache_info()))

    if torch is not None:
        try:
            torch.cuda.synchronize(dev)
            result["kernels_executed_ok"] = True
        except Exception as ex:  # noqa: BLE001
            result["kernels_executed_ok"] = False
            result["execution_error"] = f"{type(ex).__name__}: {ex} (host timings above are still valid)"

    print(json.dumps(result, indent=2))
    print(f"\n{e.key}: Kernel.launch {r['kernel_launch_us']['median']:.2f} us, raw launch "
          f"{r['raw_launch_us']['median']:.2f} us, arg build {r['arg_build_us']['median']:.2f} us, launch with 2 "
          f"encodes {r['launch_2_encodes_us']['median']:.2f} us (median; cuda-bindings reference "
          f"{REFERENCE_CUDA_BINDINGS_US} us)", file=sys.stderr)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
