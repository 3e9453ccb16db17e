"""`build_matrix check`: fail when a committed cubin is stale or missing (no TileLang or nvcc needed)."""
from __future__ import annotations

from typing import List

from .hashing import sha256_bytes, source_hash
from .manifest_io import load_manifest, read_cubin
from .variants import all_variants


def problems() -> List[str]:
    manifest = load_manifest()
    tool = manifest.get("toolchain", {})
    if not tool.get("tilelang") or not tool.get("nvcc"):
        return ["manifest.json has no toolchain versions: run `python -m build_matrix build`"]
    entries = {e["key"]: e for e in manifest["kernels"]}
    out = []
    for v in all_variants("full"):
        e = entries.pop(v.key, None)
        if e is None:
            out.append(f"{v.key}: missing from the manifest")
            continue
        if e.get("source_hash") != source_hash(v, tool["tilelang"], tool["nvcc"]):
            out.append(f"{v.key}: stale (aot/kernels/{v.kernel}.py, aot/compile.py or the variant changed)")
            continue
        try:
            if sha256_bytes(read_cubin(e["file"])) != e["sha256"]:
                out.append(f"{v.key}: {e['file']} does not match its sha256")
        except (OSError, ValueError) as exc:
            out.append(f"{v.key}: cannot read {e['file']}: {exc}")
    out += [f"{k}: in the manifest but no longer declared" for k in entries]
    return out


def main() -> int:
    found = problems()
    for p in found:
        print(f"build_matrix check: {p}")
    if found:
        print(f"build_matrix check: FAILED ({len(found)} problem(s)); rebuild with `python -m build_matrix build`")
        return 1
    print(f"build_matrix check: OK ({len(all_variants('full'))} variants current)")
    return 0
