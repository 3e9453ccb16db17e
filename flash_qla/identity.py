"""Which distribution the importable ``flash_qla`` package comes from.

Two PyPI distributions install the import name ``flash_qla``: this one (``flash-qla-aot``) and FlashQLA's
(``flash-qla``, TileLang JIT kernels). pip does not stop the second from writing into the first's folder, so with
both installed into one environment the folder holds a mix: ``flash_qla/__init__.py`` is whichever was installed
last, and FlashQLA's packages (``flash_qla/ops/``, ``flash_qla/utils/``) would shadow any module of this package with
their names (Python prefers a package to a module of the same name): this package names none so, and the check
below reports any that does.
``import flash_qla`` -- what FLA's dispatch and every other caller run -- gets that mix. Installed into different
folders, the one earlier on ``sys.path`` hides the other completely.

:func:`package_identity` reads both distributions' metadata (importlib.metadata, the RECORD of installed files and
their hashes) and the package folder, and says which case holds.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

OURS = "flash-qla-aot"
THEIRS = "flash-qla"  # FlashQLA (QwenLM), the same import name
PACKAGE = "flash_qla"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name or "").lower()


def _find(name: str, path: Optional[Sequence[str]]) -> List[md.Distribution]:
    dists = md.distributions(path=list(path)) if path is not None else md.distributions()
    return [d for d in dists if _normalise(d.metadata["Name"]) == name]


def _record_hash(entry) -> Optional[str]:
    h = getattr(entry, "hash", None)
    return f"{h.mode}={h.value}" if h is not None else None


def _file_hash(path: Path) -> Optional[str]:
    try:
        digest = hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return None
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _package_files(dist: md.Distribution) -> List[Any]:
    return [f for f in (dist.files or []) if f.parts and f.parts[0] == PACKAGE]


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def shadowed_modules(package_dir: Path) -> List[str]:
    """Modules of the folder (name.py) that a package of the same name (name/__init__.py) hides from import."""
    return sorted(p.stem for p in package_dir.glob("*.py") if (package_dir / p.stem / "__init__.py").is_file())


def package_identity(package_dir: Optional[Path] = None, path: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """The flash_qla distributions installed and how they share the package folder.

    package_dir: the folder ``import flash_qla`` loads (default: this package's); path: where to look for
    distributions (default: sys.path). Keys: package_dir, ours / theirs ({"version", "location"} or None),
    theirs_files_here (FlashQLA's files found in package_dir), init_owner (the distribution whose __init__.py is the
    one in package_dir: OURS, THEIRS or "unknown"), shadowed (modules of package_dir hidden by a package of the same
    name), state ("alone" | "hidden" | "mixed") and ok (False when the folder is mixed)."""
    package_dir = Path(package_dir) if package_dir is not None else Path(__file__).resolve().parent
    report: Dict[str, Any] = {"package_dir": str(package_dir)}
    found = {name: _find(name, path) for name in (OURS, THEIRS)}
    for key, name in (("ours", OURS), ("theirs", THEIRS)):
        d = found[name][0] if found[name] else None
        report[key] = None if d is None else {"version": d.version, "location": str(d.locate_file(""))}
    here: List[str] = []
    for d in found[THEIRS]:
        here += [str(f) for f in _package_files(d) if _inside(Path(d.locate_file(f)), package_dir)
                 and Path(d.locate_file(f)).exists()]
    report["theirs_files_here"] = sorted(set(here))
    init_hash = _file_hash(package_dir / "__init__.py")
    owner = "unknown"
    for name in (THEIRS, OURS):
        for d in found[name]:
            if any(str(f) == f"{PACKAGE}/__init__.py" and _record_hash(f) == init_hash for f in _package_files(d)):
                owner = name
    if owner == "unknown" and found[OURS] and not here:
        owner = OURS  # an editable install records no hash of its source files
    report["init_owner"] = owner
    report["shadowed"] = shadowed_modules(package_dir)
    if here or owner == THEIRS:
        report["state"] = "mixed"
    elif found[THEIRS]:
        report["state"] = "hidden"
    else:
        report["state"] = "alone"
    report["ok"] = report["state"] != "mixed"
    return report


def describe(r: Dict[str, Any]) -> List[str]:
    """Human-readable lines for ``python -m flash_qla info``."""
    ours = f"{OURS} {r['ours']['version']}" if r.get("ours") else f"{OURS} (no distribution metadata)"
    theirs = r.get("theirs")
    if r["state"] == "alone":
        return [f"package    {ours} at {r['package_dir']}; FlashQLA's {THEIRS} is not installed"]
    if r["state"] == "hidden":
        return [f"package    {ours} at {r['package_dir']}",
                f"NOTE       FlashQLA's {THEIRS} {theirs['version']} is installed too, at {theirs['location']}, "
                f"outside this folder: `import flash_qla` (and so FLA's dispatch) loads the folder above, which "
                f"comes first on sys.path; the other is hidden. Keep one installed to avoid surprises"]
    files = r["theirs_files_here"]
    shown = ", ".join(files[:4]) + (f", ... ({len(files)} files)" if len(files) > 4 else "")
    lines = [f"package    {ours} at {r['package_dir']}",
             f"WARNING    FlashQLA's {THEIRS} {theirs['version'] if theirs else '?'} is installed into the same "
             f"folder: its files {shown} are under {r['package_dir']}",
             "           `import flash_qla` (what FLA's dispatch calls) runs "
             + (f"the __init__.py of {r['init_owner']} (the one installed last)" if r["init_owner"] != "unknown"
                else "an __init__.py that neither distribution's record matches")]
    if r["shadowed"]:
        lines.append(f"           {', '.join(m + '/' for m in r['shadowed'])} of {THEIRS} shadow this package's "
                     f"{', '.join(m + '.py' for m in r['shadowed'])}: its kernel path cannot load")
    lines.append(f"           fix: pip uninstall -y {THEIRS} {OURS} && pip install {OURS} (or the one you want)")
    return lines


__all__ = ["OURS", "THEIRS", "package_identity", "describe", "shadowed_modules"]
