#!/usr/bin/env python3
"""Compare a committed kernel manifest with one rebuilt from source; exit 1 if any cubin differs.

    python ci/compare_manifests.py COMMITTED.json REBUILT.json [--kernel-dir DIR]

The release workflow runs ``python -m build_matrix build --force`` on a clean checkout and compares the result
with the manifest that was committed (``git show HEAD:flash_qla/_kernels/sm90a/manifest.json``). The verdict is
per kernel key:

* the sha256 of the (decompressed) cubin must be identical: it is what the wheel ships and the loader verifies;
* the launch metadata the loader reads (file, symbol, block, smem, grid, params, registers, spills,
  shared_carveout) must match;
* a key present on one side only is a failure (a variant was added or dropped without rebuilding), except
  that ``--subset`` (a partial rebuild, e.g. ``build_matrix build --subset smoke``) skips committed keys that
  were not rebuilt;
* the toolchain (TileLang and nvcc versions) must match, since cubins are only comparable under one toolchain.

Ignored: the top-level ``build_date`` and per-kernel ``compile_seconds`` (they change on every build), and any
other field not listed above. With ``--kernel-dir`` the rebuilt ``*.cubin.xz`` files are also hashed and checked
against the rebuilt manifest, so a manifest that does not describe its own files cannot pass.

Exit status: 0 identical, 1 differences (each printed, naming the key), 2 unreadable input or bad usage.
Standard library only: runs before anything is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

IGNORED_TOP = ("build_date",)
IGNORED_KERNEL = ("compile_seconds",)
COMPARED_KERNEL = ("file", "symbol", "block", "smem", "grid", "params", "registers", "spills", "shared_carveout")
COMPARED_TOOLCHAIN = ("tilelang", "nvcc")
COMPARED_TOP = ("format_version", "arch")


class InputError(Exception):
    """An input manifest is missing, not JSON, or not shaped like a manifest."""


def load(path: str) -> Dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("kernels"), list):
        raise InputError(f"{path}: not a kernel manifest (no 'kernels' list)")
    return data


def _by_key(manifest: Mapping[str, Any], label: str) -> Dict[str, Mapping[str, Any]]:
    out: Dict[str, Mapping[str, Any]] = {}
    for i, entry in enumerate(manifest["kernels"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
            raise InputError(f"{label}: kernels[{i}] has no string 'key'")
        if entry["key"] in out:
            raise InputError(f"{label}: duplicate key {entry['key']!r}")
        out[entry["key"]] = entry
    return out


def _short(sha: Any) -> str:
    return str(sha)[:12] if sha else "none"


def compare(committed: Mapping[str, Any], rebuilt: Mapping[str, Any], subset: bool = False) -> List[str]:
    """Every difference that matters, one line each, each naming the key (or field) it concerns.

    ``subset``: REBUILT holds only some variants (``build_matrix build --subset smoke``); committed keys it lacks
    are not reported, every key it has must still match."""
    problems: List[str] = []
    for field in COMPARED_TOP:
        if committed.get(field) != rebuilt.get(field):
            problems.append(f"{field}: committed {committed.get(field)!r}, rebuilt {rebuilt.get(field)!r}")
    tc_a, tc_b = committed.get("toolchain") or {}, rebuilt.get("toolchain") or {}
    for field in COMPARED_TOOLCHAIN:
        if tc_a.get(field) != tc_b.get(field):
            problems.append(f"toolchain.{field}: committed {tc_a.get(field)!r}, rebuilt {tc_b.get(field)!r} "
                            f"(rebuild with the toolchain the committed manifest names)")
    a, b = _by_key(committed, "committed"), _by_key(rebuilt, "rebuilt")
    for key in sorted(a.keys() - b.keys() if not subset else ()):
        problems.append(f"{key}: in the committed manifest but not rebuilt")
    for key in sorted(b.keys() - a.keys()):
        problems.append(f"{key}: rebuilt but not in the committed manifest")
    for key in sorted(a.keys() & b.keys()):
        ea, eb = a[key], b[key]
        if ea.get("sha256") != eb.get("sha256"):
            problems.append(f"{key}: sha256 differs (committed {_short(ea.get('sha256'))}, "
                            f"rebuilt {_short(eb.get('sha256'))})")
        for field in COMPARED_KERNEL:
            if ea.get(field) != eb.get(field):
                problems.append(f"{key}: {field} differs (committed {ea.get(field)!r}, rebuilt {eb.get(field)!r})")
    return problems


def check_files(manifest: Mapping[str, Any], kernel_dir: str) -> List[str]:
    """Hash every cubin a manifest names (xz-decompressed) and compare with its sha256."""
    problems: List[str] = []
    for key, entry in sorted(_by_key(manifest, "rebuilt").items()):
        path = Path(kernel_dir) / str(entry.get("file", ""))
        try:
            data = path.read_bytes()
            image = lzma.decompress(data) if path.name.endswith(".xz") else data
        except (OSError, lzma.LZMAError) as e:
            problems.append(f"{key}: cannot read {path} ({e})")
            continue
        digest = hashlib.sha256(image).hexdigest()
        if digest != entry.get("sha256"):
            problems.append(f"{key}: {path.name} hashes to {_short(digest)}, its manifest says "
                            f"{_short(entry.get('sha256'))}")
    return problems


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="compare_manifests", description=__doc__.split("\n\n")[0])
    ap.add_argument("committed", help="the manifest.json in the release commit")
    ap.add_argument("rebuilt", help="the manifest.json the clean rebuild wrote")
    ap.add_argument("--kernel-dir", help="directory of the rebuilt *.cubin.xz files, checked against REBUILT")
    ap.add_argument("--subset", action="store_true",
                    help="REBUILT is a partial rebuild (e.g. --subset smoke): compare only the keys it has")
    args = ap.parse_args(argv)
    try:
        committed, rebuilt = load(args.committed), load(args.rebuilt)
        problems = compare(committed, rebuilt, subset=args.subset)
        if args.kernel_dir:
            problems += check_files(rebuilt, args.kernel_dir)
    except InputError as e:
        print(f"compare_manifests: error: {e}", file=sys.stderr)
        return 2
    for line in problems:
        print(f"compare_manifests: {line}")
    n = len(rebuilt["kernels"]) if args.subset else len(committed["kernels"])
    if problems:
        print(f"compare_manifests: FAILED: {len(problems)} difference(s) between the committed and rebuilt "
              f"manifests ({n} committed kernels)")
        return 1
    tc = committed.get("toolchain") or {}
    print(f"compare_manifests: OK: {n} kernels identical (sha256 and launch metadata; build_date ignored), "
          f"tilelang {tc.get('tilelang')}, nvcc {tc.get('nvcc')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
