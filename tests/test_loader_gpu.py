"""The launcher against the real driver on an sm_90 GPU: a TMA kernel with two tensor maps, built here with nvcc,
loaded through a fixture manifest and checked against torch; CUDA-graph capture; every shipped cubin loads."""
import hashlib
import json
import lzma
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from flash_qla import _launcher  # noqa: E402
from flash_qla.loader import KernelLibrary  # noqa: E402

TMA_SRC = r"""
#include <cuda.h>
#include <stdint.h>
// out += sum(A[tile] * B[tile]) for the 32x32 fp32 tile (blockIdx.x, blockIdx.y), both tiles loaded by TMA.
extern "C" __global__ void __launch_bounds__(128) tma_dot2(const __grid_constant__ CUtensorMap ma,
                                                            const __grid_constant__ CUtensorMap mb,
                                                            float* out, int scale) {
  __shared__ alignas(128) float sa[32 * 32];
  __shared__ alignas(128) float sb[32 * 32];
  __shared__ alignas(8) uint64_t bar;
  uint32_t b = (uint32_t)__cvta_generic_to_shared(&bar);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(b));
    asm volatile("fence.proxy.async.shared::cta;");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(2 * 32 * 32 * 4));
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"((uint32_t)__cvta_generic_to_shared(sa)), "l"(&ma), "r"((int)blockIdx.x * 32),
                    "r"((int)blockIdx.y * 32), "r"(b) : "memory");
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"((uint32_t)__cvta_generic_to_shared(sb)), "l"(&mb), "r"((int)blockIdx.x * 32),
                    "r"((int)blockIdx.y * 32), "r"(b) : "memory");
  }
  __syncthreads();
  asm volatile("{\n .reg .pred p;\n W_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n @!p bra W_%=;\n}"
               :: "r"(b) : "memory");
  float s = 0.f;
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) s += sa[i] * sb[i];
  atomicAdd(out, s * (float)scale);
}
"""


def _tm(name, address):
    return {"name": name, "kind": "tensormap", "dtype": 7, "rank": 2, "address": address,
            "dims": ["N", "M"], "strides": ["N * 4"], "box": ["32", "32"], "element_strides": ["1", "1"],
            "interleave": 0, "swizzle": 0, "l2_promotion": 2, "oob_fill": 0}


@pytest.fixture(scope="module")
def tma_dir(tmp_path_factory):
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("no nvcc to build the test cubin")
    d = tmp_path_factory.mktemp("tma")
    (d / "tma.cu").write_text(TMA_SRC)
    subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-O2", "-o", str(d / "tma.cubin"), str(d / "tma.cu")],
                   check=True, capture_output=True, text=True)
    image = (d / "tma.cubin").read_bytes()
    kd = d / "kernels"
    kd.mkdir()
    (kd / "tma_dot2.f32.cubin.xz").write_bytes(lzma.compress(image))
    entry = {"key": "tma_dot2.f32", "kernel": "tma_dot2", "variant": {"dtype": "f32"},
             "file": "tma_dot2.f32.cubin.xz", "sha256": hashlib.sha256(image).hexdigest(), "source_hash": "00",
             "symbol": "tma_dot2", "block": [128, 1, 1], "smem": 0, "grid": ["N // 32", "M // 32", "1"],
             "params": [_tm("ma", "a"), _tm("mb", "b"), {"name": "out", "kind": "ptr"},
                        {"name": "scale", "kind": "i32", "expr": "S"}], "cubin_bytes": len(image)}
    m = {"format_version": 1, "arch": "sm_90a",
         "toolchain": {"tilelang": "none", "nvcc": "local", "min_driver_api": 12000, "min_driver": "525"},
         "build_date": "", "kernels": [entry]}
    (kd / "manifest.json").write_text(json.dumps(m))
    return kd


def _run(k, a, b, out, S=1, stream=None):
    stream = torch.cuda.current_stream().cuda_stream if stream is None else stream
    M, N = a.shape
    k.launch(a.device.index, stream, {"M": M, "N": N, "S": S},
             {"a": a.data_ptr(), "b": b.data_ptr(), "out": out.data_ptr()})


def test_real_driver_basics():
    assert _launcher.driver_version() >= 12000
    assert _launcher.device_capability(0) == (9, 0)
    assert "H100" in _launcher.device_name(0) or "H200" in _launcher.device_name(0) or _launcher.device_name(0)
    assert _launcher.device_count() == torch.cuda.device_count()


def test_tma_kernel_matches_torch(tma_dir):
    k = KernelLibrary(tma_dir).kernel("tma_dot2", dtype="f32")
    a = torch.randn(256, 128, device="cuda")
    b = torch.randn(256, 128, device="cuda")
    out = torch.zeros(1, device="cuda")
    _run(k, a, b, out, S=2)
    torch.cuda.synchronize()
    want = 2 * (a.double() * b.double()).sum().item()
    assert abs(out.item() - want) <= 1e-3 * max(1.0, abs(want)), (out.item(), want)
    hits0 = _launcher.tensormap_cache_info()[0]
    out.zero_()
    _run(k, a, b, out)                                     # same tensors: both maps from the cache
    torch.cuda.synchronize()
    assert _launcher.tensormap_cache_info()[0] == hits0 + 2
    assert abs(out.item() - want / 2) <= 1e-3 * max(1.0, abs(want))


def test_side_stream_and_graph_capture(tma_dir):
    k = KernelLibrary(tma_dir).kernel("tma_dot2", dtype="f32")
    a = torch.randn(128, 64, device="cuda")
    b = torch.randn(128, 64, device="cuda")
    out = torch.zeros(1, device="cuda")
    want = (a.double() * b.double()).sum().item()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        _run(k, a, b, out)                                 # warm: loads, fills the cache
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _run(k, a, b, out)
    out.zero_()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert abs(out.item() - 3 * want) <= 1e-3 * max(1.0, abs(3 * want)), (out.item(), want)


def test_launch_from_new_thread(tma_dir):
    k = KernelLibrary(tma_dir).kernel("tma_dot2", dtype="f32")
    a = torch.randn(64, 64, device="cuda")
    b = torch.randn(64, 64, device="cuda")
    out = torch.zeros(1, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    errs = []

    def worker():
        try:
            _run(k, a, b, out, stream=stream)
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errs, errs
    torch.cuda.synchronize()
    want = (a.double() * b.double()).sum().item()
    assert abs(out.item() - want) <= 1e-3 * max(1.0, abs(want))


def test_shipped_cubins_load():
    lib = KernelLibrary()
    try:
        kernels = lib.kernels()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no shipped kernels: {e}")
    failed = {}
    for k in kernels:
        try:
            k.load(0)
        except Exception as e:  # noqa: BLE001
            failed[k.key] = str(e)
    assert not failed, failed
