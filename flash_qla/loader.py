"""The zero-JIT kernel loader: manifest look-up, lazy cubin loading per (device, kernel), device checks, launch.

    from flash_qla.loader import library
    k = library().kernel("kkt_solve", dtype="bf16", K=128)     # VariantNotBuiltError if not built
    k.launch(device, stream, sizes={"NT": 16, "H": 8}, pointers={"k": t.data_ptr(), ...})

Nothing here touches CUDA at import: the manifest is read when the library is first used, ``libcuda.so.1`` is
dlopen()ed by ``flash_qla._launcher`` at the first device query or module load, and each cubin is decompressed,
hash-checked and loaded the first time its kernel is launched on a device. The driver version is checked once per
process and the compute capability once per device. A launch then costs one dict look-up, the kernel's
precompiled argument builder and one C call.

``FLASH_QLA_KERNELS_DIR`` overrides the kernel directory (default: package data ``flash_qla/_kernels/sm90a``).
"""
from __future__ import annotations

import hashlib
import lzma
import os
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from . import manifest as _manifest
from .errors import (CubinIntegrityError, CudaDriverError, DriverTooOldError, ManifestError,
                     UnsupportedDeviceError, VariantNotBuiltError)
from .manifest import KernelEntry, Manifest

__all__ = ["Kernel", "KernelLibrary", "library", "default_kernel_dir", "native"]

DEFAULT_SUBDIR = "sm90a"
_native_mod = None


def native():
    """The C launcher module (imported on first use, so a source tree without the built extension still imports)."""
    global _native_mod
    if _native_mod is None:
        try:
            from . import _launcher
        except ImportError as e:  # pragma: no cover - only without a build
            raise ImportError(f"flash_qla._launcher (the C launcher) is not built: {e}; "
                              f"reinstall flash-qla-aot (pip install .)") from e
        _native_mod = _launcher
    return _native_mod


def default_kernel_dir():
    """The kernel directory: $FLASH_QLA_KERNELS_DIR, else package data flash_qla/_kernels/sm90a (a Traversable)."""
    env = os.environ.get("FLASH_QLA_KERNELS_DIR")
    if env:
        return _PathDir(env)
    from importlib.resources import files
    return files("flash_qla") / "_kernels" / DEFAULT_SUBDIR


class _PathDir:
    """Minimal Traversable-like wrapper over a file-system directory."""

    def __init__(self, path: Any):
        self.path = os.fspath(path)

    def __truediv__(self, name: str) -> "_PathDir":
        return _PathDir(os.path.join(self.path, name))

    def read_bytes(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def read_text(self, encoding: str = "utf-8") -> str:
        with open(self.path, encoding=encoding) as f:
            return f.read()

    def is_file(self) -> bool:
        return os.path.isfile(self.path)

    def __str__(self) -> str:
        return self.path

    __fspath__ = __str__


class Kernel:
    """One prebuilt kernel variant. Thread-safe; loads lazily per device.

    Attributes: ``key``, ``name`` (kernel family), ``variant`` (dict), ``entry`` (the manifest entry),
    ``signature`` (bytes, one char per parameter), ``block``, ``smem``.
    """

    __slots__ = ("library", "entry", "key", "name", "variant", "block", "smem", "_signature", "_functions",
                 "_builder", "_launch")

    def __init__(self, library: "KernelLibrary", entry: KernelEntry):
        self.library = library
        self.entry = entry
        self.key = entry.key
        self.name = entry.kernel
        self.variant = dict(entry.variant)
        self._signature: Optional[bytes] = None  # from the launch rules, read (and validated) at first use
        self.block = tuple(entry.block)
        self.smem = entry.smem
        self._functions: Dict[int, int] = {}
        self._builder: Optional[Callable] = None
        self._launch: Optional[Callable] = None

    def __repr__(self) -> str:
        return f"Kernel({self.key!r}, symbol={self.entry.symbol!r}, loaded_on={sorted(self._functions)})"

    @property
    def signature(self) -> bytes:
        sig = self._signature
        if sig is None:
            sig = self._signature = self.entry.signature
        return sig

    # -- arguments -----------------------------------------------------------------------------------------
    @property
    def builder(self) -> Callable[[Mapping[str, Any], Mapping[str, int]], Tuple[tuple, tuple]]:
        """``build(sizes, pointers) -> (grid, args)``, compiled once from the manifest's rules."""
        b = self._builder
        if b is None:
            b = self._builder = _manifest.compile_arg_builder(self.entry)
        return b

    def build_args(self, sizes: Mapping[str, Any], pointers: Mapping[str, int]) -> Tuple[tuple, tuple]:
        """The (grid, args) a launch with these sizes and pointers would pass to ``_launcher.launch``."""
        return self.builder(sizes, pointers)

    @property
    def size_names(self) -> Tuple[str, ...]:
        return self.entry.size_names

    @property
    def pointer_names(self) -> Tuple[str, ...]:
        return self.entry.pointer_names

    # -- loading -------------------------------------------------------------------------------------------
    def cubin(self) -> bytes:
        """The decompressed cubin, verified against the manifest's sha256 (CubinIntegrityError otherwise)."""
        return self.library.read_cubin(self.entry)

    def load(self, device: int) -> int:
        """Load the cubin on ``device`` (once) and return the CUfunction handle."""
        fn = self._functions.get(device)
        if fn is not None:
            return fn
        lib = self.library
        with lib._lock:
            fn = self._functions.get(device)
            if fn is not None:
                return fn
            lib.check_device(device)
            image = self.cubin()
            nat = native()
            try:
                module = nat.load_module(device, image)
                carveout = self.entry.shared_carveout
                fn = nat.get_function(module, self.entry.symbol, self.smem, -1 if carveout is None else carveout)
            except CudaDriverError as e:
                raise CudaDriverError(f"kernel {self.key} on device {device}: {e.what}", e.code, e.name,
                                      e.description) from None
            if self._builder is None:
                self._builder = _manifest.compile_arg_builder(self.entry)
            self._launch = nat.launch
            self._functions[device] = fn
            return fn

    def is_loaded(self, device: int) -> bool:
        return device in self._functions

    # -- launching -----------------------------------------------------------------------------------------
    def launch(self, device: int, stream: int, sizes: Mapping[str, Any], pointers: Mapping[str, int]
               ) -> Tuple[tuple, tuple]:
        """Launch on ``stream`` (a CUstream handle as int, e.g. ``torch.cuda.current_stream().cuda_stream``) and
        return the (grid, args) it passed (a plan's recording keeps them: flash_qla/plans.py).

        ``sizes`` maps run-time size names to ints (f32 params may name floats); ``pointers`` maps pointer names
        (ptr params and tensor-map addresses) to device addresses. No synchronisation, no allocation:
        CUDA-graph capturable once the kernel is loaded on the device.
        """
        fn = self._functions.get(device)
        if fn is None:
            fn = self.load(device)
        grid, args = self._builder(sizes, pointers)  # type: ignore[misc]
        try:
            self._launch(fn, grid, self.block, self.smem, stream, self.signature, args)  # type: ignore[misc]
        except CudaDriverError as e:
            raise CudaDriverError(f"kernel {self.key} on device {device}: {e.what}", e.code, e.name,
                                  e.description) from None
        return grid, args


class KernelLibrary:
    """The set of prebuilt kernels described by one manifest.

    ``KernelLibrary(path=None)``: ``path`` is a directory holding manifest.json and the ``*.cubin.xz`` files
    (a str/PathLike or an importlib.resources Traversable); None means :func:`default_kernel_dir`.
    """

    def __init__(self, path: Any = None):
        if path is not None and not hasattr(path, "joinpath") and not isinstance(path, _PathDir):
            path = _PathDir(path)
        self._dir = path
        self._lock = threading.RLock()
        self._manifest: Optional[Manifest] = None
        self._kernels: Dict[Tuple[str, Tuple], Kernel] = {}
        self._by_key: Dict[str, Kernel] = {}
        self._checked_devices: Dict[int, Tuple[int, int]] = {}
        self._driver_checked = False

    # -- manifest ------------------------------------------------------------------------------------------
    @property
    def directory(self):
        if self._dir is None:
            self._dir = default_kernel_dir()
        return self._dir

    @property
    def manifest(self) -> Manifest:
        m = self._manifest
        if m is None:
            with self._lock:
                if self._manifest is None:
                    path = self.directory / "manifest.json"
                    if not path.is_file():
                        raise ManifestError("<document>", "manifest.json not found: this installation has no "
                                            "prebuilt kernels (the package data is missing)", str(path))
                    # each kernel's launch rules are validated at its first launch (info validates them all)
                    self._manifest = _manifest.load_manifest(path, lazy=True)
                    for e in self._manifest.kernels:
                        k = Kernel(self, e)
                        self._by_key[e.key] = k
                        self._kernels[(e.kernel, _manifest.variant_key(e.variant))] = k
                m = self._manifest
        return m  # type: ignore[return-value]

    def kernel_names(self) -> List[str]:
        """The kernel families in the manifest, sorted."""
        return sorted(self.manifest.families)

    def variants(self, name: str) -> List[Dict[str, Any]]:
        """The variant dicts built for kernel family ``name`` (empty if the family is unknown)."""
        return [dict(e.variant) for e in self.manifest.kernels if e.kernel == name]

    def kernel(self, name: str, **variant: Any) -> Kernel:
        """The kernel ``name`` built for exactly ``variant``; VariantNotBuiltError (listing what exists) if none."""
        try:
            return self._kernels[(name, tuple(sorted(variant.items())))]
        except KeyError:
            pass
        except TypeError:  # unhashable variant value
            pass
        m = self.manifest
        k = self._kernels.get((name, _manifest.variant_key(variant)))
        if k is not None:
            return k
        raise VariantNotBuiltError(name, variant, self.variants(name), families=m.families, arch=m.arch)

    def kernel_by_key(self, key: str) -> Kernel:
        self.manifest
        try:
            return self._by_key[key]
        except KeyError:
            raise VariantNotBuiltError(key.split(".")[0], {"key": key}, [{"key": k} for k in self._by_key],
                                       arch=self.manifest.arch) from None

    def kernels(self) -> List[Kernel]:
        self.manifest
        return list(self._by_key.values())

    # -- files ---------------------------------------------------------------------------------------------
    def read_cubin(self, entry: KernelEntry) -> bytes:
        path = self.directory / entry.file
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise CubinIntegrityError(str(path), reason=f"cannot be read ({e.strerror or e}); reinstall "
                                      f"flash-qla-aot") from None
        try:
            image = lzma.decompress(raw)
        except lzma.LZMAError as e:
            raise CubinIntegrityError(str(path), reason=f"is not valid xz data ({e}); reinstall flash-qla-aot") \
                from None
        digest = hashlib.sha256(image).hexdigest()
        if digest != entry.sha256:
            raise CubinIntegrityError(str(path), expected=entry.sha256, found=digest)
        return image

    # -- device checks -------------------------------------------------------------------------------------
    def check_device(self, device: int) -> Tuple[int, int]:
        """Check the driver (once) and ``device``'s compute capability (once per device); return the capability."""
        cap = self._checked_devices.get(device)
        if cap is not None:
            return cap
        with self._lock:
            nat = native()
            m = self.manifest
            if not self._driver_checked:
                found = nat.driver_version()
                if found < m.toolchain.min_driver_api:
                    raise DriverTooOldError(m.toolchain.min_driver_api, found, min_driver=m.toolchain.min_driver)
                self._driver_checked = True
            cap = tuple(nat.device_capability(device))
            if cap != m.capability:
                try:
                    name = nat.device_name(device)
                except Exception:  # noqa: BLE001 - the name is decoration only
                    name = ""
                raise UnsupportedDeviceError(m.arch, cap, device, name)
            self._checked_devices[device] = cap  # type: ignore[assignment]
            return cap  # type: ignore[return-value]


_library: Optional[KernelLibrary] = None
_library_lock = threading.Lock()


def library() -> KernelLibrary:
    """The process-wide KernelLibrary over the installed kernels (created on first call; reads nothing yet)."""
    global _library
    lib = _library
    if lib is None:
        with _library_lock:
            if _library is None:
                _library = KernelLibrary()
            lib = _library
    return lib
