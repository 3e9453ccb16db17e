"""Every loader/launcher path reachable without a GPU, against a fake libcuda.so built here with gcc.

flash_qla._launcher dlopens the driver once per process, so the in-process tests share one fake (behaviour set by
FAKE_CUDA_* environment variables, read by the fake at every call) and the paths that need a fresh process (no
driver, a driver missing symbols, cuInit failing, import laziness) run in one subprocess scenario.
"""
import os
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fake_libcuda"))
import fixtures  # noqa: E402

from flash_qla import _launcher  # noqa: E402
from flash_qla.errors import (CubinIntegrityError, CudaDriverError, DriverTooOldError,  # noqa: E402
                              UnsupportedDeviceError)
from flash_qla.loader import KernelLibrary  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIZES = {"NT": 3, "H": 4, "scale": 0.125}
PTRS = {"k": 0x10000, "v": 0x20000, "o": 0x30000}


@pytest.fixture(scope="module")
def fake_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("fakecuda")
    return fixtures.build_fake_libcuda(d), fixtures.build_fake_libcuda(d, old=True)


def _must_run_in_subprocess() -> bool:
    """Never load the fake into a process that has (or may later use) the real driver: on a GPU machine the
    GPU tests in this process need libcuda.so.1, and the launcher keeps the first driver it loads."""
    if os.environ.get("FLASH_QLA_FAKE_SUBRUN"):
        return False
    loaded = _launcher.libcuda_path()
    if loaded is not None:
        return "fakecuda" not in loaded
    import ctypes.util
    return ctypes.util.find_library("cuda") is not None or Path("/dev/nvidiactl").exists()


@pytest.fixture(scope="module")
def fake(fake_paths):
    path = str(fake_paths[0])
    if _must_run_in_subprocess():
        pytest.skip("a real driver is (or may be) used by this process: test_fake_suite_in_fresh_process runs "
                    "this file in a fresh process instead")
    old = os.environ.get("FLASH_QLA_LIBCUDA")
    os.environ["FLASH_QLA_LIBCUDA"] = path
    f = fixtures.Fake(path)
    _launcher.driver_version()                      # loads the fake (symbols through cuGetProcAddress_v2)
    f.proc_lookups_at_load = f.stat("proc_lookups")
    yield f
    if old is None:
        os.environ.pop("FLASH_QLA_LIBCUDA", None)
    else:
        os.environ["FLASH_QLA_LIBCUDA"] = old


@pytest.fixture
def env(monkeypatch, fake):
    """Per-test fake behaviour: FAKE_CUDA_* cleared, counters reset, tensor-map cache emptied."""
    for k in list(os.environ):
        if k.startswith("FAKE_CUDA_"):
            monkeypatch.delenv(k)
    fake.reset()
    _launcher.clear_tensormap_cache()
    return monkeypatch


@pytest.fixture
def lib(tmp_path):
    return KernelLibrary(fixtures.write_kernel_dir(tmp_path / "k"))


def _unpack_kkt(params: bytes):
    k, v, o, H, T, scale = struct.unpack_from("<QQQiqf", params, 0)  # no padding in the fake's concatenation
    off = 8 * 3 + 4 + 8 + 4
    return (k, v, o, H, T, scale), fixtures.decode_fake_map(params[off:off + 128]), \
        fixtures.decode_fake_map(params[off + 128:off + 256])


def test_driver_too_old(env, fake, lib):
    env.setenv("FAKE_CUDA_DRIVER_VERSION", "12080")
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    with pytest.raises(DriverTooOldError) as ei:
        k.launch(0, 0, SIZES, PTRS)
    msg = str(ei.value)
    assert "13.0" in msg and "12.8" in msg and "R580" in msg and "CUDA 13" in msg
    assert (ei.value.needed, ei.value.found) == (13000, 12080)
    assert fake.stat("module_loads") == 0 and not k.is_loaded(0)


def test_wrong_compute_capability(env, fake, lib):
    env.setenv("FAKE_CUDA_CC", "8.0")
    env.setenv("FAKE_CUDA_NAME", "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UnsupportedDeviceError) as ei:
        lib.kernel("kkt_solve", dtype="bf16", K=128).launch(0, 0, SIZES, PTRS)
    assert str(ei.value).startswith("built for sm_90a, found sm_80 on device 0 (NVIDIA A100-SXM4-80GB)")
    env.setenv("FAKE_CUDA_CC", "10.0")
    with pytest.raises(UnsupportedDeviceError, match="found sm_100"):
        lib.check_device(0)
    assert fake.stat("module_loads") == 0


def test_invalid_device_ordinal(env, fake, lib):
    with pytest.raises(CudaDriverError, match=r"cuDeviceGet\(3\) failed: CUDA_ERROR_INVALID_DEVICE"):
        lib.kernel("scale", dtype="bf16").launch(3, 0, {"N": 10}, {"x": 16})


def test_launch_success_records_everything(env, fake, lib):
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    k.load(0)
    assert fake.current_context() is None                  # the load restored this thread's (absent) context
    k.launch(0, 0xABC0, SIZES, PTRS)
    assert k.is_loaded(0)
    assert fake.stat("module_loads") == 1 and fake.stat("get_function") == 1
    assert fake.stat("set_attr") == 0                       # 16 KiB smem, no carveout: no attribute needed
    assert fake.proc_lookups_at_load >= 17                  # symbols came through cuGetProcAddress
    rec = fake.last_launch()
    assert rec["symbol"] == "kkt_solve_kernel"
    assert rec["grid"] == (3, 4, 1) and rec["block"] == (128, 1, 1) and rec["smem"] == 16384
    assert rec["stream"] == 0xABC0
    assert len(rec["params"]) == 3 * 8 + 4 + 8 + 4 + 2 * 128
    scalars, kmap, vmap = _unpack_kkt(rec["params"])
    assert scalars == (0x10000, 0x20000, 0x30000, 4, 192, 0.125)
    assert kmap == {"dtype": 10, "rank": 3, "address": 0x10000, "dims": (128, 4, 192), "strides": (256, 1024),
                    "box": (64, 1, 64), "element_strides": (1, 1, 1), "interleave": 0, "swizzle": 3,
                    "l2_promotion": 2, "oob_fill": 0}
    assert vmap == {"dtype": 10, "rank": 2, "address": 0x20000, "dims": (128, 192), "strides": (256,),
                    "box": (64, 128), "element_strides": (1, 1), "interleave": 0, "swizzle": 2,
                    "l2_promotion": 1, "oob_fill": 0}
    assert fake.stat("encodes") == 2 and _launcher.tensormap_cache_info() == (0, 2, 2)
    # the thread had no context: the encoder's CUDA_ERROR_INVALID_CONTEXT made the launcher bind the kernel's
    assert fake.current_context() is not None


def test_tensormap_cache(env, fake, lib):
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    k.launch(0, 0, SIZES, PTRS)
    assert fake.stat("encodes") == 2
    for _ in range(5):
        k.launch(0, 0, SIZES, PTRS)                       # identical tuples: no re-encode
    assert fake.stat("encodes") == 2 and fake.stat("launches") == 6
    hits, misses, entries = _launcher.tensormap_cache_info()
    assert (hits, misses) == (10, 2)
    k.launch(0, 0, SIZES, dict(PTRS, k=0x40000))          # new k pointer: only k_desc re-encoded
    assert fake.stat("encodes") == 3
    k.launch(0, 0, dict(SIZES, NT=5), PTRS)               # new shape: both maps
    assert fake.stat("encodes") == 5
    _, kmap, vmap = _unpack_kkt(fake.last_launch()["params"])
    assert kmap["dims"] == (128, 4, 320) and vmap["dims"] == (128, 320) and vmap["box"] == (64, 128)
    k.launch(0, 0, SIZES, PTRS)                           # the first set is still cached
    assert fake.stat("encodes") == 5


def test_raw_launcher_api(env, fake):
    mod = _launcher.load_module(0, b"FAKECUBIN\nraw pilfm\n")
    fn = _launcher.get_function(mod, "raw", 0)
    tm = (9, 1, 4096, (1024,), (), (128,), (1,), 0, 0, 0, 0)
    _launcher.launch(fn, (2, 1, 1), (32, 1, 1), 0, None, "pilfm", [None, -5, 2 ** 40, 1.5, tm])
    rec = fake.last_launch()
    p, i, l, f = struct.unpack_from("<Qiqf", rec["params"], 0)
    assert (p, i, l, f) == (0, -5, 2 ** 40, 1.5) and rec["stream"] == 0
    assert fixtures.decode_fake_map(rec["params"][24:])["dims"] == (1024,)
    assert _launcher.driver_version() == 13000 and _launcher.device_count() == 1
    assert _launcher.device_capability(0) == (9, 0) and _launcher.device_name(0) == "Fake NVIDIA H100"
    # argument checking
    with pytest.raises(ValueError, match="signature has 2 parameters but 1"):
        _launcher.launch(fn, (1, 1, 1), (32, 1, 1), 0, 0, "pi", (1,))
    with pytest.raises(ValueError, match="bad signature character 'x'"):
        _launcher.launch(fn, (1, 1, 1), (32, 1, 1), 0, 0, "x", (1,))
    with pytest.raises(OverflowError, match="int32"):
        _launcher.launch(fn, (1, 1, 1), (32, 1, 1), 0, 0, "i", (2 ** 31,))
    with pytest.raises(TypeError, match="non-negative int"):
        _launcher.launch(fn, (1, 1, 1), (32, 1, 1), 0, 0, "p", (-1,))
    with pytest.raises(TypeError, match="11-tuple"):
        _launcher.launch(fn, (1, 1, 1), (32, 1, 1), 0, 0, "m", ((1, 2),))
    with pytest.raises(ValueError, match="dims has 2 entries, rank needs 1"):
        _launcher.launch(fn, (1, 1, 1), (32, 1, 1), 0, 0, "m", ((9, 1, 0, (1, 2), (), (1,), (1,), 0, 0, 0, 0),))
    with pytest.raises(ValueError, match="rank must be 1..5"):
        _launcher.launch(fn, (1, 1, 1), (32, 1, 1), 0, 0, "m", ((9, 6, 0, (), (), (), (), 0, 0, 0, 0),))
    with pytest.raises(TypeError, match="3-tuple"):
        _launcher.launch(fn, (1, 1), (32, 1, 1), 0, 0, "", ())
    with pytest.raises(TypeError, match="takes 7 arguments"):
        _launcher.launch(fn, (1, 1, 1), (32, 1, 1), 0, 0, "")
    with pytest.raises(ValueError, match="unknown module handle"):
        _launcher.get_function(12345, "raw", 0)
    with pytest.raises(CudaDriverError, match=r"cuModuleGetFunction\(\"nope\"\) failed: CUDA_ERROR_NOT_FOUND"):
        _launcher.get_function(mod, "nope", 0)


def test_empty_grid_launches_nothing(env, fake, lib):
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    k.launch(0, 0, SIZES, PTRS)
    n = fake.stat("launches")
    k.launch(0, 0, dict(SIZES, H=0), PTRS)
    assert fake.stat("launches") == n


def test_large_smem_sets_attribute_once(env, fake, lib):
    k = lib.kernel("kkt_solve", dtype="bf16", K=64)
    assert k.smem == 100 * 1024
    for _ in range(3):
        k.launch(0, 0, SIZES, PTRS)
    assert fake.stat("set_attr") == 1 and fake.last_attr() == (8, 100 * 1024)
    assert fake.last_launch()["smem"] == 100 * 1024 and fake.stat("launches") == 3


def test_manifest_carveout_sets_attribute_once(env, fake, tmp_path):
    entries = fixtures.default_entries()
    for e in entries:
        e["shared_carveout"] = 100
    k = KernelLibrary(fixtures.write_kernel_dir(tmp_path / "c", entries)).kernel("kkt_solve", dtype="bf16", K=128)
    for _ in range(3):
        k.launch(0, 0, SIZES, PTRS)
    assert fake.stat("set_attr") == 1 and fake.last_attr() == (9, 100)


def test_checks_run_once(env, fake, lib):
    k1 = lib.kernel("kkt_solve", dtype="bf16", K=128)
    k2 = lib.kernel("scale", dtype="bf16")
    for _ in range(3):
        k1.launch(0, 0, SIZES, PTRS)
        k2.launch(0, 0, {"N": 1000}, {"x": 0x100})
    assert fake.stat("driver_version") == 1                 # driver checked once per library
    assert fake.stat("module_loads") == 2                   # one module per (device, kernel)
    assert fake.last_launch()["grid"] == (4, 1, 1)


def test_module_load_failure(env, fake, lib):
    env.setenv("FAKE_CUDA_FAIL", "cuModuleLoadData=209")
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    with pytest.raises(CudaDriverError) as ei:
        k.launch(0, 0, SIZES, PTRS)
    msg = str(ei.value)
    assert "kernel kkt_solve.bf16.K128 on device 0" in msg and "cuModuleLoadData" in msg
    assert "CUDA_ERROR_NO_BINARY_FOR_GPU" in msg and "no kernel image is available" in msg
    assert ei.value.code == 209 and not k.is_loaded(0)
    env.delenv("FAKE_CUDA_FAIL")
    k.launch(0, 0, SIZES, PTRS)                             # recovers once the cause is gone
    assert k.is_loaded(0)


def test_invalid_cubin_image(env, fake, tmp_path):
    entries = [fixtures.simple_entry("scale.bf16", "scale", {"dtype": "bf16"})]
    kdir = fixtures.write_kernel_dir(tmp_path / "k", entries)
    import hashlib
    import json
    import lzma
    image = b"\x7fELF not really a cubin"
    (kdir / "scale.bf16.cubin.xz").write_bytes(lzma.compress(image))
    m = json.loads((kdir / "manifest.json").read_text())
    m["kernels"][0]["sha256"] = hashlib.sha256(image).hexdigest()
    (kdir / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CudaDriverError, match="CUDA_ERROR_INVALID_IMAGE"):
        KernelLibrary(kdir).kernel("scale", dtype="bf16").launch(0, 0, {"N": 1}, {"x": 16})


def test_missing_symbol_in_cubin(env, fake, tmp_path):
    e = fixtures.simple_entry("scale.bf16", "scale", {"dtype": "bf16"}, symbol="real_name")
    kdir = fixtures.write_kernel_dir(tmp_path / "k", [e])
    import json
    m = json.loads((kdir / "manifest.json").read_text())
    m["kernels"][0]["symbol"] = "wrong_name"
    (kdir / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CudaDriverError, match=r"scale.bf16.*cuModuleGetFunction\(\"wrong_name\"\).*NOT_FOUND"):
        KernelLibrary(kdir).kernel("scale", dtype="bf16").launch(0, 0, {"N": 1}, {"x": 16})


def test_sha_mismatch_blocks_load(env, fake, lib):
    import lzma
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    Path(str(lib.directory / k.entry.file)).write_bytes(lzma.compress(b"FAKECUBIN\nkkt_solve_kernel pppilfmm\n#"))
    with pytest.raises(CubinIntegrityError, match="sha256"):
        k.launch(0, 0, SIZES, PTRS)
    assert fake.stat("module_loads") == 0


def test_launch_failure(env, fake, lib):
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    k.launch(0, 0, SIZES, PTRS)
    env.setenv("FAKE_CUDA_FAIL", "cuLaunchKernel=701")
    with pytest.raises(CudaDriverError) as ei:
        k.launch(0, 0, SIZES, PTRS)
    msg = str(ei.value)
    assert "kernel kkt_solve.bf16.K128 on device 0" in msg and "cuLaunchKernel(grid (3, 4, 1), block (128, 1, 1)" in msg
    assert "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES" in msg


def test_tensormap_encode_failure(env, fake, lib):
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    with pytest.raises(CudaDriverError) as ei:
        k.launch(0, 0, SIZES, dict(PTRS, v=0x20008))        # TMA needs 16-byte aligned addresses
    msg = str(ei.value)
    assert "cuTensorMapEncodeTiled(argument 7: dtype 10, rank 2, address 0x20008, dims [128,192], box [64,128]" in msg
    assert "CUDA_ERROR_INVALID_VALUE" in msg
    assert fake.stat("launches") == 0


def test_missing_size_or_pointer(env, fake, lib):
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    with pytest.raises(KeyError, match="missing size 'NT'"):
        k.launch(0, 0, {"H": 1, "scale": 1.0}, PTRS)
    with pytest.raises(KeyError, match="missing pointer 'v'"):
        k.launch(0, 0, SIZES, {"k": 16, "o": 16})


def test_launch_from_thread_without_context(env, fake, lib):
    """A thread with no current context: the launcher binds the function's context and retries."""
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    k.launch(0, 0, SIZES, PTRS)                             # load on this thread
    errors = []

    def worker():
        try:
            assert fake.current_context() is None
            k.launch(0, 0, SIZES, dict(PTRS, k=0x50000))   # new pointer: the encoder needs the context too
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errors, errors
    assert fake.stat("launches") == 2 and fake.stat("encodes") == 3


def test_concurrent_first_launch_loads_once(env, fake, lib):
    k = lib.kernel("kkt_solve", dtype="fp16", K=128)
    barrier = threading.Barrier(8)
    errors = []

    def worker(i):
        try:
            barrier.wait()
            for _ in range(20):
                k.launch(0, 0, dict(SIZES, NT=1 + i), PTRS)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert fake.stat("module_loads") == 1 and fake.stat("launches") == 160


def test_info_with_fake_gpu(env, fake, tmp_path, capsys):
    from flash_qla.info import main as info_main
    kdir = str(fixtures.write_kernel_dir(tmp_path / "k"))
    assert info_main(["--kernels", kdir]) == 0
    out = capsys.readouterr().out
    assert "device 0: Fake NVIDIA H100, sm_90" in out and "cubins on device 0: 4/4 load" in out, out
    assert "driver     CUDA API 13.0 (13000)" in out
    # a cubin that fails to load makes info exit 1 and name it
    env.setenv("FAKE_CUDA_FAIL", "cuModuleGetFunction=500")
    assert info_main(["--kernels", kdir]) == 1
    out = capsys.readouterr().out
    assert "FAILED kkt_solve.bf16.K128" in out and "NOT_FOUND" in out, out
    # wrong GPU: reported, nothing loaded, exit 0 (the installation is not broken)
    env.delenv("FAKE_CUDA_FAIL")
    env.setenv("FAKE_CUDA_CC", "8.6")
    assert info_main(["--kernels", kdir]) == 0
    out = capsys.readouterr().out
    assert "not loaded: built for sm_90a, found sm_86" in out and "not supported" in out, out


def test_fresh_process_paths(fake_paths, tmp_path):
    """Paths that need a process whose launcher has not loaded a driver yet."""
    kdir = fixtures.write_kernel_dir(tmp_path / "k")
    good, old = map(str, fake_paths)
    code = textwrap.dedent(f"""
        import os, sys
        import flash_qla
        from flash_qla import _launcher
        from flash_qla.loader import KernelLibrary
        from flash_qla.errors import DriverNotFoundError, DriverTooOldError, CudaDriverError
        assert _launcher.libcuda_path() is None            # import touched no driver
        lib = KernelLibrary({str(kdir)!r})
        k = lib.kernel("scale", dtype="bf16")
        assert _launcher.libcuda_path() is None            # neither did reading the manifest
        # 1. no driver at all
        os.environ["FLASH_QLA_LIBCUDA"] = "/nonexistent/libcuda.so.1"
        try:
            k.launch(0, 0, {{"N": 1}}, {{"x": 16}}); raise SystemExit("no error")
        except DriverNotFoundError as e:
            assert str(e).startswith("no NVIDIA driver: /nonexistent/libcuda.so.1 could not be loaded ("), e
            assert isinstance(e, RuntimeError)
        # 2. a driver without cuTensorMapEncodeTiled (pre-CUDA 12)
        os.environ["FLASH_QLA_LIBCUDA"] = {old!r}
        try:
            _launcher.driver_version(); raise SystemExit("no error")
        except DriverTooOldError as e:
            assert "does not provide cuTensorMapEncodeTiled" in str(e), e
        # 3. cuInit fails (no device); the library is kept, init is retried
        os.environ["FLASH_QLA_LIBCUDA"] = {good!r}
        os.environ["FAKE_CUDA_DEVICE_COUNT"] = "0"
        os.environ["FAKE_CUDA_NO_PROC_ADDRESS"] = "1"     # and resolve everything through dlsym
        assert _launcher.driver_version() == 13000
        try:
            k.launch(0, 0, {{"N": 1}}, {{"x": 16}}); raise SystemExit("no error")
        except CudaDriverError as e:
            assert "cuInit(0) failed" in str(e) and "CUDA_ERROR_NO_DEVICE" in str(e), e
        # 4. the device appears: works, symbols resolved by dlsym
        os.environ["FAKE_CUDA_DEVICE_COUNT"] = "1"
        k.launch(0, 0, {{"N": 1}}, {{"x": 16}})
        assert _launcher.libcuda_path() == {good!r}
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=fixtures.subprocess_env(), timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr


def test_fake_suite_in_fresh_process():
    """On a machine with a real driver, run this file in a fresh process (the fake must not replace libcuda here)."""
    if not _must_run_in_subprocess():
        pytest.skip("the in-process tests above ran against the fake driver")
    env = fixtures.subprocess_env(FLASH_QLA_FAKE_SUBRUN="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def _program_ops(k, fn, grid, pointer_template):
    """kkt_solve's launch as a program op, each pointer (and tensor-map address) replaced by pointer_template(p)."""
    _, args = k.build_args(SIZES, PTRS)
    sig = k.signature.decode()
    templ = tuple(pointer_template(a) if c == "p" else
                  (a[:2] + (pointer_template(a[2]),) + a[3:] if c == "m" else a) for c, a in zip(sig, args))
    return ("launch", fn, grid, k.block, k.smem, 0, k.signature, templ)


def test_program_fills_pointers_per_call_and_joins_streams(env, fake, lib):
    """A program fixes a launch ahead of its calls; each run supplies the streams and the slots' base addresses
    (here inputs at 0x10000 / 0x20000 / 0x30000 become slot 0 + offsets, slot 1, slot 2)."""
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    fn = k.load(0)
    slots = {0x10000: (0, 0), 0x20000: (1, 0), 0x30000: (2, 0x40)}
    launch = _program_ops(k, fn, (3, 4, 1), lambda p: slots[p])
    before = fake.current_context()
    prog = _launcher.program_new([("join", 1, 0), launch, ("join", 0, 1)], 3, 2)
    # the events were made in the kernels' context, and this thread's own is current again
    assert fake.stat("events") == 2 and fake.current_context() == before
    _launcher.program_run(prog, (0xABC0, 0xDEF0), (0x50000, 0x60000, 0x70000))
    rec = fake.last_launch()
    assert rec["stream"] == 0xABC0 and rec["grid"] == (3, 4, 1)
    scalars, kmap, vmap = _unpack_kkt(rec["params"])
    assert scalars == (0x50000, 0x60000, 0x70040, 4, 192, 0.125)
    assert kmap["address"] == 0x50000 and vmap["address"] == 0x60000 and kmap["dims"] == (128, 4, 192)
    assert fake.stat("event_records") == 2 and fake.stat("stream_waits") == 2
    _launcher.program_run(prog, (0xABC0, 0xDEF0), (0x80000, 0x60000, 0x70000))  # a new address: a new map
    assert _unpack_kkt(fake.last_launch()["params"])[1]["address"] == 0x80000
    assert fake.stat("launches") == 2


def test_program_rejects_bad_templates_and_calls(env, fake, lib):
    k = lib.kernel("kkt_solve", dtype="bf16", K=128)
    fn = k.load(0)
    with pytest.raises(ValueError, match="pointer slot 5 outside 0..2"):
        _launcher.program_new([_program_ops(k, fn, (1, 1, 1), lambda p: (5, 0))], 3, 1)
    with pytest.raises(ValueError, match="stream index 0 outside|join streams"):
        _launcher.program_new([("join", 0, 0)], 0, 1)
    with pytest.raises(TypeError, match="expected"):
        _launcher.program_new([("sync",)], 0, 1)
    prog = _launcher.program_new([_program_ops(k, fn, (1, 1, 1), lambda p: p)], 0, 1)  # absolute addresses
    with pytest.raises(TypeError, match="pointers must be a tuple of 0 ints"):
        _launcher.program_run(prog, (0,), (1,))
    _launcher.program_run(prog, (0x10,), ())
    assert _unpack_kkt(fake.last_launch()["params"])[0][:3] == (0x10000, 0x20000, 0x30000)
    env.setenv("FAKE_CUDA_FAIL", "cuLaunchKernel=1")
    with pytest.raises(CudaDriverError, match="program op 0: cuLaunchKernel"):
        _launcher.program_run(prog, (0x10,), ())
