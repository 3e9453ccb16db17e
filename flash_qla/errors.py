"""Exceptions raised by flash_qla's kernel loader and launcher.

Every class derives from :class:`FlashQLAError` and from the builtin that fits (RuntimeError for environment
problems, LookupError for a variant that was not built), so callers can catch either. The messages say what was
found, what was needed and what to do about it. ``flash_qla._launcher`` (C) raises DriverNotFoundError,
DriverTooOldError and CudaDriverError from here.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

__all__ = ["FlashQLAError", "DriverNotFoundError", "DriverTooOldError", "UnsupportedDeviceError",
           "VariantNotBuiltError", "CubinIntegrityError", "ManifestError", "CudaDriverError",
           "format_driver_api"]


class FlashQLAError(Exception):
    """Base class of every flash_qla loader/launcher error."""


def format_driver_api(version: Optional[int]) -> str:
    """13000 -> '13.0'; unknown -> 'unknown'."""
    if not version:
        return "unknown"
    return f"{version // 1000}.{(version % 1000) // 10}"


class DriverNotFoundError(FlashQLAError, RuntimeError):
    """libcuda.so.1 (the NVIDIA driver) could not be loaded."""

    def __init__(self, path: str = "libcuda.so.1", reason: str = ""):
        self.path = path
        self.reason = reason
        super().__init__(f"no NVIDIA driver: {path} could not be loaded ({reason or 'unknown reason'}); "
                         f"flash_qla's kernels need an NVIDIA driver and an sm_90 GPU "
                         f"(use backend='reference' to run the pure-PyTorch path)")


class DriverTooOldError(FlashQLAError, RuntimeError):
    """The driver's CUDA API version is below what the cubins were built for."""

    def __init__(self, needed: int, found: int, detail: str = "", min_driver: Optional[str] = None):
        self.needed = int(needed)
        self.found = int(found or 0)
        self.detail = detail
        if min_driver is None:
            min_driver = "580" if self.needed >= 13000 else "525"
        self.min_driver = str(min_driver)
        msg = (f"NVIDIA driver too old: flash_qla's kernels need CUDA driver API >= {format_driver_api(self.needed)} "
               f"(an R{self.min_driver}+ driver), found {format_driver_api(self.found)}")
        if detail:
            msg += f" ({detail})"
        if self.needed >= 13000:
            msg += "; cubins built with CUDA 13 need an R580 or newer driver: upgrade the NVIDIA driver"
        else:
            msg += f"; upgrade the NVIDIA driver to R{self.min_driver} or newer"
        super().__init__(msg)


class UnsupportedDeviceError(FlashQLAError, RuntimeError):
    """The GPU's compute capability does not match the cubins' architecture."""

    def __init__(self, arch: str, capability: Sequence[int], device: int, name: str = ""):
        self.arch = arch
        self.capability = tuple(capability)
        self.device = device
        self.name = name
        found = f"sm_{self.capability[0]}{self.capability[1]}"
        where = f"device {device}" + (f" ({name})" if name else "")
        super().__init__(f"built for {arch}, found {found} on {where}: flash_qla's kernels run only on compute "
                         f"capability 9.0 GPUs (H100, H200, H20, GH200); use backend='reference' elsewhere")


def _fmt_variant(variant: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in variant.items()) or "(no variant axes)"


class VariantNotBuiltError(FlashQLAError, LookupError):
    """The requested kernel variant is not in the manifest: there is no JIT to fall back on."""

    def __init__(self, kernel: str, variant: Mapping[str, Any], available: Iterable[Mapping[str, Any]],
                 families: Optional[Iterable[str]] = None, arch: str = "sm_90a"):
        self.kernel = kernel
        self.variant = dict(variant)
        self.available = [dict(v) for v in available]
        self.families = sorted(families) if families is not None else None
        if self.families is not None and kernel not in self.families:
            msg = (f"no prebuilt kernel {kernel!r} for {arch} (the build has no such kernel family); "
                   f"available kernels: {', '.join(self.families) or 'none'}")
        else:
            avail = "; ".join(_fmt_variant(v) for v in self.available) or "none"
            msg = (f"no prebuilt variant of kernel {kernel!r} for {_fmt_variant(self.variant)} ({arch}); "
                   f"flash_qla never compiles at run time. Available variants: {avail}")
        super().__init__(msg)

    def __str__(self) -> str:  # LookupError would repr() a single argument like KeyError does; keep plain text
        return self.args[0]


class CubinIntegrityError(FlashQLAError, RuntimeError):
    """A cubin file is missing, unreadable, or its sha256 does not match the manifest."""

    def __init__(self, file: str, expected: str = "", found: str = "", reason: str = ""):
        self.file = file
        self.expected = expected
        self.found = found
        if reason:
            msg = f"cubin {file}: {reason}"
        else:
            msg = (f"cubin {file} is corrupt or stale: sha256 of the decompressed cubin is {found}, the manifest "
                   f"says {expected}; reinstall flash-qla-aot")
        super().__init__(msg)


class ManifestError(FlashQLAError, RuntimeError):
    """The kernel manifest is malformed; `field` names the offending field (e.g. 'kernels[3].params[2].dims')."""

    def __init__(self, field: str, problem: str, source: str = ""):
        self.field = field
        self.problem = problem
        self.source = source
        where = f" in {source}" if source else ""
        super().__init__(f"malformed kernel manifest{where}: field {field!r}: {problem}")


class CudaDriverError(FlashQLAError, RuntimeError):
    """A CUDA driver call failed; carries the CUresult code and its name."""

    def __init__(self, what: str, code: int = -1, name: str = "", description: str = ""):
        self.what = what
        self.code = code
        self.name = name
        self.description = description
        super().__init__(f"{what}: {name} ({description}) [CUresult {code}]" if name else what)
