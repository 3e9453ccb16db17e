"""``python -m flash_qla info``: versions, the kernel manifest, the GPU and driver, and whether every cubin loads.

The GPU is queried through flash_qla's own launcher (libcuda via dlopen), not torch, so this reports exactly what
the kernels would see. On a machine without a GPU or driver it says why and exits 0. Exit status 1 means the
installation is broken: a malformed manifest or a cubin that fails to load on a supported GPU.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any, Dict, List, Optional

from .errors import FlashQLAError, format_driver_api


def _versions() -> Dict[str, Any]:
    out: Dict[str, Any] = {"python": f"{platform.python_implementation()} {platform.python_version()}"}
    try:
        from . import __version__ as v
        out["flash_qla"] = v
    except Exception:  # noqa: BLE001
        out["flash_qla"] = "unknown"
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # noqa: F811
        except Exception as e:  # noqa: BLE001
            torch = None
            out["torch"] = f"not importable ({type(e).__name__}: {e})"
    if torch is not None:
        out["torch"] = getattr(torch, "__version__", "unknown")
        out["torch_cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    try:
        from . import _launcher
        out["launcher"] = getattr(_launcher, "__file__", "?")
    except ImportError as e:
        out["launcher"] = f"not built ({e})"
    return out


def _manifest_summary(lib) -> Dict[str, Any]:
    m = lib.manifest.validate()  # every kernel's launch rules, which a launch alone checks only for its kernel
    families = {}
    for fam, entries in sorted(m.families.items()):
        axes: Dict[str, List[Any]] = {}
        for e in entries:
            for ax, val in e.variant.items():
                if val not in axes.setdefault(ax, []):
                    axes[ax].append(val)
        families[fam] = {"variants": len(entries), "axes": axes,
                         "cubin_bytes": sum(e.cubin_bytes or 0 for e in entries)}
    tc = m.toolchain
    return {"path": str(lib.directory), "format_version": m.format_version, "arch": m.arch,
            "build_date": m.build_date,
            "toolchain": {"tilelang": tc.tilelang, "nvcc": tc.nvcc, "min_driver_api": tc.min_driver_api,
                          "min_driver": tc.min_driver, **tc.extra},
            "kernels": len(m.kernels), "families": families, "total_cubin_bytes": m.total_cubin_bytes}


def _gpu() -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    try:
        from . import _launcher as L
    except ImportError as e:
        return {"available": False, "reason": f"flash_qla._launcher not built ({e})"}
    try:
        v = L.driver_version()
        out["driver_api"] = v
        out["driver_api_str"] = format_driver_api(v)
        out["libcuda"] = L.libcuda_path()
        n = L.device_count()
        out["devices"] = []
        for i in range(n):
            cap = tuple(L.device_capability(i))
            out["devices"].append({"ordinal": i, "name": L.device_name(i), "capability": list(cap),
                                   "arch": f"sm_{cap[0]}{cap[1]}"})
        out["available"] = n > 0
        if n == 0:
            out["reason"] = "the driver reports no CUDA devices"
    except Exception as e:  # noqa: BLE001 - report any failure as the reason
        out["available"] = False
        out["reason"] = str(e) if isinstance(e, FlashQLAError) else f"{type(e).__name__}: {e}"
    return out


def _identity() -> Dict[str, Any]:
    """Which distribution provides ``import flash_qla`` (flash_qla/identity.py): FlashQLA's flash-qla uses the same
    import name."""
    try:
        from .identity import package_identity
        return package_identity()
    except Exception as e:  # noqa: BLE001 - metadata trouble is reported, never fatal to info
        return {"error": f"{type(e).__name__}: {e}"}


def collect(device: Optional[int] = None, load: bool = True, kernel_dir: Any = None) -> Dict[str, Any]:
    """Everything ``info`` reports, as a JSON-able dict (``ok`` False means a broken installation)."""
    from .loader import KernelLibrary, library

    report: Dict[str, Any] = {"versions": _versions(), "ok": True}
    report["identity"] = _identity()
    if report["identity"].get("ok") is False:
        report["ok"] = False  # FlashQLA's flash-qla shares the package folder: the kernel path cannot load
    lib = KernelLibrary(kernel_dir) if kernel_dir is not None else library()
    manifest_ok = False
    try:
        report["manifest"] = _manifest_summary(lib)
        manifest_ok = True
    except FlashQLAError as e:
        missing = "manifest.json not found" in str(e)
        report["manifest"] = {"error": str(e), "missing": missing}
        if not missing:
            report["ok"] = False
    gpu = _gpu()
    report["gpu"] = gpu
    if load and manifest_ok and gpu.get("available"):
        devices = [d["ordinal"] for d in gpu["devices"]]
        if device is not None:
            devices = [device]
        loads: Dict[str, Any] = {}
        for dev in devices:
            res: Dict[str, Any] = {}
            try:
                lib.check_device(dev)
            except FlashQLAError as e:
                loads[str(dev)] = {"skipped": str(e)}
                continue
            for k in lib.kernels():
                try:
                    k.load(dev)
                    res[k.key] = "ok"
                except Exception as e:  # noqa: BLE001
                    res[k.key] = f"failed: {e}"
                    report["ok"] = False
            loads[str(dev)] = res
            if device is None:
                break  # one supported device is enough unless asked
        report["cubin_loads"] = loads
    jit = [m for m in ("tilelang", "aot", "build_matrix", "tvm", "nvrtc") if m in sys.modules]
    report["jit_modules_imported"] = jit
    return report


def render(r: Dict[str, Any]) -> str:
    v = r["versions"]
    lines = [f"flash_qla {v.get('flash_qla')}   python {v.get('python')}   torch {v.get('torch')}"
             + (f" (CUDA {v['torch_cuda']})" if v.get("torch_cuda") else ""),
             f"launcher   {v.get('launcher')}"]
    ident = r.get("identity") or {}
    if "error" in ident:
        lines.append(f"package    could not read the installed distributions: {ident['error']}")
    elif ident:
        from .identity import describe
        lines += describe(ident)
    m = r.get("manifest", {})
    if "error" in m:
        lines.append(f"kernels    {'none installed' if m.get('missing') else 'BROKEN'}: {m['error']}")
    else:
        tc = m["toolchain"]
        lines.append(f"kernels    {m['path']}")
        lines.append(f"  manifest v{m['format_version']}, arch {m['arch']}, built {m['build_date'] or '?'}")
        lines.append(f"  toolchain tilelang {tc['tilelang']}, nvcc {tc['nvcc']}; needs driver API >= "
                     f"{format_driver_api(tc['min_driver_api'])} (R{tc['min_driver']}+)")
        lines.append(f"  {m['kernels']} kernels in {len(m['families'])} families, "
                     f"{m['total_cubin_bytes'] / 1e6:.2f} MB of cubins ({m['total_cubin_bytes']} bytes)")
        for fam, f in m["families"].items():
            axes = ", ".join(f"{a} in {{{', '.join(map(str, vals))}}}" for a, vals in f["axes"].items())
            lines.append(f"    {fam:<28} {f['variants']:>3} variants   {axes}")
    g = r["gpu"]
    if g.get("available"):
        lines.append(f"driver     CUDA API {g['driver_api_str']} ({g['driver_api']}) from {g['libcuda']}")
        for d in g["devices"]:
            lines.append(f"  device {d['ordinal']}: {d['name']}, {d['arch']}"
                         + ("" if tuple(d["capability"]) == (9, 0) else "  (not supported: kernels need sm_90)"))
    else:
        extra = f" (driver API {g['driver_api_str']})" if g.get("driver_api") else ""
        lines.append(f"no GPU: {g.get('reason')}{extra}")
    for dev, res in r.get("cubin_loads", {}).items():
        if "skipped" in res:
            lines.append(f"cubins on device {dev}: not loaded: {res['skipped']}")
            continue
        ok = sum(1 for s in res.values() if s == "ok")
        lines.append(f"cubins on device {dev}: {ok}/{len(res)} load")
        for key, s in res.items():
            lines.append(f"  {'ok    ' if s == 'ok' else 'FAILED'} {key}" + ("" if s == "ok" else f": {s[8:]}"))
    jit = r.get("jit_modules_imported") or []
    lines.append("JIT        " + ("none reachable (no compiler modules imported)" if not jit
                                  else f"WARNING: imported {', '.join(jit)}"))

    if not r["ok"]:
        lines.append("STATUS     broken installation (see above)")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flash_qla info", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--device", type=int, default=None, help="load the cubins on this device (default: first)")
    ap.add_argument("--no-load", action="store_true", help="do not load the cubins on the GPU")
    ap.add_argument("--kernels", default=None, help="kernel directory (default: the installed package data)")
    a = ap.parse_args(argv)
    r = collect(device=a.device, load=not a.no_load, kernel_dir=a.kernels)
    print(json.dumps(r, indent=2, default=str) if a.json else render(r))
    return 0 if r["ok"] else 1
