"""Compile one TileLang kernel variant into an sm_90a cubin plus the launch metadata a loader needs.

Build-time only (imports TileLang). The steps mirror TileLang's own CUDA JIT, minus the host library:
1. lower the PrimFunc under an explicit ``sm_90a`` target (without an arch TileLang silently targets
   sm_50 on a GPU-less machine),
2. run nvcc on the generated CUDA source with TileLang's flags to get a cubin and ptxas's register and
   spill counts,
3. read the launch metadata out of the lowered modules: entry symbol, block, dynamic shared memory,
   grid expressions, and the ordered kernel parameters, where each TMA descriptor becomes the
   ``cuTensorMapEncodeTiled`` arguments as expressions of run-time sizes.
Expressions are Python-syntax strings over the kernel's dynamic size names (see flash_qla/manifest.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List

import tilelang
from tilelang import tvm
from tilelang.jit.adapter.utils import pythonic_expr

TARGET = {"kind": "cuda", "arch": "sm_90a"}
# TileLang's CUDA flags (tilelang/cuda/backend.py) plus ptxas statistics for the summary table.
NVCC = os.environ.get("FLASH_QLA_NVCC", "nvcc")
DEFAULT_PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
}


@dataclass
class CompiledKernel:
    cubin: bytes
    symbol: str
    block: List[int]
    grid: List[str]
    smem: int
    params: List[Dict[str, Any]]
    registers: int
    spills: int
    compile_seconds: float
    source: str = field(repr=False, default="")


def _expr(e) -> str:
    """A TIR expression as Python integer arithmetic ("//" for floor division, casts dropped)."""
    if isinstance(e, int):
        return str(e)
    text = pythonic_expr(e, ignore_cast=True, floor_div_op="//")
    return text.replace("T.int32(", "(").replace("T.int64(", "(")


def _int(e) -> int:
    return int(_expr(e))


def lower(prim_func, pass_configs=None):
    """Lower under the explicit sm_90a target; returns TileLang's CompiledArtifact (no device compile)."""
    configs = dict(DEFAULT_PASS_CONFIGS)
    configs.update(pass_configs or {})
    target = tvm.target.Target(TARGET)
    with tvm.transform.PassContext(opt_level=3, config=configs), target:
        return tilelang.lower(prim_func, target=target)


def nvcc_cubin(source: str, fast_math: bool = True) -> tuple[bytes, str]:
    """nvcc -cubin with TileLang's include paths; returns (cubin bytes, ptxas -v text)."""
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH
    with tempfile.TemporaryDirectory(prefix="flash_qla_aot_") as tmp:
        src, out = os.path.join(tmp, "kernel.cu"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(source)
        cmd = [NVCC, "--cubin", "-O3", "-arch=sm_90a", "-std=c++20", "-w",
               "-I" + TILELANG_TEMPLATE_PATH, "-I" + CUTLASS_INCLUDE_DIR, "--ptxas-options=--verbose",
               "-o", out, src]
        if fast_math:
            cmd.insert(1, "--use_fast_math")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stdout}\n{proc.stderr}")
        with open(out, "rb") as f:
            return f.read(), proc.stdout + proc.stderr


def wgmma_serialization(log: str) -> str:
    """ptxas's advisory (seen as C7512, C7514 and C7518) when it serialises wgmma.mma_async (an accumulator read
    while a later wgmma runs, a wait in a divergent path, too few registers): the kernel still runs, correct and
    about 2x slower.
    Empty when the log has none."""
    found = [line.split("Potential Performance Loss:")[-1].strip() for line in log.splitlines()
             if "wgmma.mma_async instructions are serialized" in line]
    return "; ".join(found)


def _ptxas_stats(log: str) -> tuple[int, int]:
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return (int(regs[-1]) if regs else -1), (int(spills[-1]) if spills else 0)


def _tensormap(desc_args) -> Dict[str, Any]:
    """cuTensorMapEncodeTiled arguments from TileLang's tma_descriptor_args record."""
    create, _, dtype, rank, address, *rest = desc_args
    if str(create.value) != "__tvm_tensormap_create_tiled":
        raise NotImplementedError(f"only tiled TMA descriptors are supported, got {create.value}")
    rank = _int(rank)
    dims, strides = rest[:rank], rest[rank:2 * rank]
    box, elem = rest[2 * rank:3 * rank], rest[3 * rank:4 * rank]
    interleave, swizzle, l2, oob = rest[4 * rank:4 * rank + 4]
    return {
        "kind": "tensormap", "dtype": _int(dtype), "rank": rank, "address": _expr(address),
        "dims": [_expr(d) for d in dims],
        # TileLang records rank strides with the innermost (unused) first; the driver takes the other rank-1
        "strides": [_expr(s) for s in strides[1:]],
        "box": [_expr(b) for b in box], "element_strides": [_expr(e) for e in elem],
        "interleave": _int(interleave), "swizzle": _int(swizzle), "l2_promotion": _int(l2), "oob_fill": _int(oob),
    }


_SCALARS = {"int32": "i32", "int64": "i64", "float32": "f32"}


def launch_metadata(artifact) -> Dict[str, Any]:
    """Entry symbol, block, grid, smem and ordered params of the single device kernel."""
    kernels = list(artifact.device_mod.functions.items())
    if len(kernels) != 1:
        raise NotImplementedError(f"one device kernel per variant expected, got {[g.name_hint for g, _ in kernels]}")
    gvar, func = kernels[0]
    attrs = func.attrs
    block, grid = [1, 1, 1], ["1", "1", "1"]
    for tag, extent in attrs["thread_extent"].items():
        axis = "xyz".index(str(tag)[-1])
        if "threadIdx" in str(tag):
            block[axis] = _int(extent)
        else:
            grid[axis] = _expr(extent)
    if "cluster_dims" in attrs:
        raise NotImplementedError("cluster launches are not supported by the loader")
    smem = int(attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in attrs else 0

    tma_args = {}
    for _, host_func in artifact.host_mod.functions.items():
        if "tma_descriptor_args" in host_func.attrs:
            tma_args = {var.name: args for var, args in host_func.attrs["tma_descriptor_args"].items()}
    params = []
    for p in func.params:
        name = p.name
        if name in tma_args:
            params.append({"name": name, **_tensormap(tma_args[name])})
        elif str(p.dtype) == "handle":
            params.append({"name": name, "kind": "ptr"})
        elif str(p.dtype) in _SCALARS:
            params.append({"name": name, "kind": _SCALARS[str(p.dtype)], "expr": name})
        else:
            raise NotImplementedError(f"kernel parameter {name} has unsupported dtype {p.dtype}")
    return {"symbol": str(attrs["global_symbol"]) if "global_symbol" in attrs else gvar.name_hint,
            "block": block, "grid": grid, "smem": smem, "params": params}


def compile_kernel(prim_func, pass_configs=None) -> CompiledKernel:
    """Lower, compile and describe one kernel variant."""
    start = time.perf_counter()
    artifact = lower(prim_func, pass_configs)
    meta = launch_metadata(artifact)
    cubin, log = nvcc_cubin(artifact.kernel_source)
    regs, spills = _ptxas_stats(log)
    serialized = wgmma_serialization(log)
    if serialized:  # a silent 2x: every wgmma waits for the previous one (measured on gdn_fwd_chain drafts)
        raise RuntimeError(f"{meta['symbol']}: ptxas serialised the asynchronous wgmmas: {serialized}")
    return CompiledKernel(cubin=cubin, registers=regs, spills=spills,
                          compile_seconds=time.perf_counter() - start, source=artifact.kernel_source, **meta)
