"""Loader logic that needs no driver: variant look-up, cubin integrity, laziness, error messages."""
import lzma
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fake_libcuda"))
import fixtures  # noqa: E402

from flash_qla import errors  # noqa: E402
from flash_qla.errors import (CubinIntegrityError, DriverNotFoundError, DriverTooOldError,  # noqa: E402
                              ManifestError, UnsupportedDeviceError, VariantNotBuiltError)
from flash_qla.loader import KernelLibrary, library  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def kdir(tmp_path):
    return fixtures.write_kernel_dir(tmp_path / "k")


def test_library_lookup(kdir):
    lib = KernelLibrary(kdir)
    assert lib.kernel_names() == ["kkt_solve", "scale"]
    assert lib.variants("kkt_solve") == [{"dtype": "bf16", "K": 128}, {"dtype": "fp16", "K": 128},
                                         {"dtype": "bf16", "K": 64}]
    assert lib.variants("nope") == []
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    assert k.key == "kkt_solve.bf16.K128" and k.name == "kkt_solve" and k.signature == b"pppilfmm"
    assert k.block == (128, 1, 1) and k.smem == 16384
    assert lib.kernel("kkt_solve", K=128, dtype="bf16") is k          # order-free, cached
    assert lib.kernel_by_key("scale.bf16").name == "scale"
    assert len(lib.kernels()) == 4
    assert not k.is_loaded(0)


def test_variant_not_built_lists_available(kdir):
    lib = KernelLibrary(kdir)
    with pytest.raises(VariantNotBuiltError) as ei:
        lib.kernel("kkt_solve", dtype="fp32", K=128)
    msg = str(ei.value)
    assert isinstance(ei.value, LookupError)
    assert "kkt_solve" in msg and "dtype=fp32, K=128" in msg
    assert "Available variants: dtype=bf16, K=128; dtype=fp16, K=128; dtype=bf16, K=64" in msg
    assert ei.value.available == lib.variants("kkt_solve")
    with pytest.raises(VariantNotBuiltError, match="dtype=bf16, K=128"):
        lib.kernel("kkt_solve", dtype="bf16")                        # a missing axis is a different variant
    with pytest.raises(VariantNotBuiltError, match="no such kernel family.*kkt_solve, scale"):
        lib.kernel("chunk_fwd", dtype="bf16")
    with pytest.raises(VariantNotBuiltError, match="kkt_solve.bf16.K128"):
        lib.kernel_by_key("nope")


def test_cubin_integrity(kdir):
    lib = KernelLibrary(kdir)
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    assert k.cubin().startswith(b"FAKECUBIN\n")
    # sha256 mismatch: a different (valid xz) cubin
    (kdir / k.entry.file).write_bytes(lzma.compress(b"FAKECUBIN\ntampered pim\n"))
    with pytest.raises(CubinIntegrityError) as ei:
        k.cubin()
    assert k.entry.file in str(ei.value) and k.entry.sha256 in str(ei.value) and "sha256" in str(ei.value)
    assert ei.value.expected == k.entry.sha256
    # not xz at all
    (kdir / k.entry.file).write_bytes(b"garbage")
    with pytest.raises(CubinIntegrityError, match="not valid xz"):
        k.cubin()
    # missing
    (kdir / k.entry.file).unlink()
    with pytest.raises(CubinIntegrityError, match="cannot be read"):
        k.cubin()


def test_missing_and_malformed_manifest(tmp_path):
    with pytest.raises(ManifestError, match="manifest.json not found"):
        KernelLibrary(tmp_path).manifest
    bad = fixtures.write_kernel_dir(tmp_path / "bad", mutate=lambda m: m["kernels"][0].pop("symbol"))
    with pytest.raises(ManifestError) as ei:
        KernelLibrary(bad).kernel("kkt_solve", dtype="bf16", K=128)
    assert ei.value.field == "kernels[0].symbol"


def test_library_validates_a_kernels_launch_rules_at_its_first_use(tmp_path):
    """The loader reads the manifest lazily: a broken rule of one kernel fails that kernel's use, naming the field,
    and leaves the others usable; info validates every kernel."""
    bad = fixtures.write_kernel_dir(tmp_path / "bad", mutate=lambda m: m["kernels"][0]["grid"].pop())
    lib = KernelLibrary(bad)
    k = lib.kernel("scale", dtype="bf16")
    assert k.build_args({"N": 513}, {"x": 64}) == ((3, 1, 1), (64, 513))
    with pytest.raises(ManifestError) as ei:
        lib.kernel("kkt_solve", dtype="bf16", K=128).size_names
    assert ei.value.field == "kernels[0].grid"
    env = fixtures.subprocess_env(FLASH_QLA_LIBCUDA="/nonexistent/libcuda.so.1", FLASH_QLA_KERNELS_DIR=str(bad))
    r = subprocess.run([sys.executable, "-m", "flash_qla", "info", "--json"], capture_output=True, text=True,
                       cwd=REPO, env=env, timeout=120)
    import json
    rep = json.loads(r.stdout)
    assert r.returncode != 0 and "kernels[0].grid" in rep["manifest"]["error"], r.stdout + r.stderr


def test_library_is_lazy(tmp_path):
    lib = KernelLibrary(tmp_path / "does-not-exist")  # constructing reads nothing
    assert lib._manifest is None
    assert library() is library()


def test_builder_via_kernel(kdir):
    k = KernelLibrary(kdir).kernel("scale", dtype="bf16")
    assert k.build_args({"N": 513}, {"x": 64}) == ((3, 1, 1), (64, 513))
    assert k.size_names == ("N",) and k.pointer_names == ("x",)


def test_error_messages():
    e = DriverNotFoundError("libcuda.so.1", "libcuda.so.1: cannot open shared object file")
    assert str(e).startswith("no NVIDIA driver: libcuda.so.1 could not be loaded (libcuda.so.1: cannot open")
    e = DriverTooOldError(13000, 12040)
    assert "13.0" in str(e) and "12.4" in str(e) and "R580" in str(e) and "CUDA 13" in str(e)
    e = UnsupportedDeviceError("sm_90a", (8, 0), 1, "NVIDIA A100-SXM4-80GB")
    assert str(e).startswith("built for sm_90a, found sm_80 on device 1 (NVIDIA A100-SXM4-80GB)")
    assert isinstance(e, RuntimeError) and isinstance(e, errors.FlashQLAError)
    e = errors.CudaDriverError("cuLaunchKernel failed", 701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many")
    assert "cuLaunchKernel failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (too many)" in str(e) and e.code == 701


def test_import_is_cuda_free_and_jit_free():
    """Importing flash_qla (and the loader) touches no driver and imports no compiler/build modules."""
    code = textwrap.dedent("""
        import sys, flash_qla, flash_qla.loader, flash_qla.manifest, flash_qla.errors
        from flash_qla import _launcher
        bad = [m for m in ("tilelang", "aot", "build_matrix", "tvm") if m in sys.modules]
        assert not bad, bad
        assert _launcher.libcuda_path() is None, _launcher.libcuda_path()
        lib = flash_qla.loader.library()
        assert lib._manifest is None
        print("OK", _launcher.LIMITED_API)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=fixtures.subprocess_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"OK {0x030A0000}"


def test_launcher_is_abi3_and_links_no_cuda():
    from flash_qla import _launcher
    path = Path(_launcher.__file__)
    assert path.name.endswith(".abi3.so"), path.name
    r = subprocess.run(["ldd", str(path)], capture_output=True, text=True)
    if r.returncode == 0:
        assert "libcuda" not in r.stdout and "libcudart" not in r.stdout and "torch" not in r.stdout, r.stdout


def test_info_runs_without_gpu(kdir):
    """`python -m flash_qla info` exits 0 and says why there is no GPU."""
    env = fixtures.subprocess_env(FLASH_QLA_LIBCUDA="/nonexistent/libcuda.so.1", FLASH_QLA_KERNELS_DIR=str(kdir))
    r = subprocess.run([sys.executable, "-m", "flash_qla", "info"], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "no GPU: no NVIDIA driver: /nonexistent/libcuda.so.1 could not be loaded" in out
    assert "4 kernels in 2 families" in out and "tilelang 0.1.15" in out and "R580+" in out
    assert "kkt_solve" in out and "3 variants" in out
    assert "JIT        none reachable" in out
    # JSON form; and a missing kernel directory is reported but is not an error
    env["FLASH_QLA_KERNELS_DIR"] = str(kdir / "nothing-here")
    r = subprocess.run([sys.executable, "-m", "flash_qla", "info", "--json"], capture_output=True, text=True,
                       cwd=REPO, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    rep = json.loads(r.stdout)
    assert rep["gpu"]["available"] is False and rep["manifest"]["missing"] is True
