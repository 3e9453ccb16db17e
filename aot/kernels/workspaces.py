"""Reduction workspaces in a canonical order, so that one kernel source always compiles to the same cubin.

TileLang 0.1.15 gives each cross-thread reduction (T.reduce_sum's AllReduce) a shared-memory workspace of its own,
but which reduction gets which of several workspaces of one size follows an order that changes from process to
process: gdn_bwd_chunk's seven reductions came out with a different permutation of its seven workspaces from one
lowering to the next, and its cubin's bytes with them, which the release workflow's rebuild comparison
(ci/compare_manifests.py) rejects. Here the uses are renamed so that, among the workspaces of one size, the one
declared first (lowest offset) serves the reduction that comes first in the code: every reduction keeps a workspace
of the size it was given, and reductions that shared one still share one. A source not in the expected shape (no
workspaces, or one whose size cannot be read off the next buffer's offset) is returned as it is. A kernel module
whose lowering needs it calls use_canonical_workspaces() in its build(), right before TileLang lowers it.
"""
from __future__ import annotations

import re

# TileLang's dynamic shared-memory buffers, one declaration a line, in offset order
DECLARATION = re.compile(r"^  void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);$", re.M)
WORKSPACE = re.compile(r"workspace(_\d+)?")
POSTPROC = "tilelang_callback_cuda_postproc"  # TileLang's hook on its generated CUDA (one function a process)
_REGISTERED: list = []  # what use_canonical_workspaces registered last


def canonical_workspaces(code: str) -> str:
    """`code` with its reductions' workspaces assigned in declaration order per size (see the module docstring)."""
    declared = sorted(((name, int(offset)) for name, offset in DECLARATION.findall(code)), key=lambda d: d[1])
    size = {name: nxt - offset for (name, offset), (_, nxt) in zip(declared, declared[1:])}
    names = [name for name, _ in declared if WORKSPACE.fullmatch(name)]
    if len(names) < 2 or any(name not in size for name in names):
        return code
    body_start = max(m.end() for m in DECLARATION.finditer(code))
    use = re.compile(r"\b(" + "|".join(names) + r")\b")
    first = {}
    for m in use.finditer(code, body_start):
        first.setdefault(m.group(1), m.start())
    rename = {}
    for bytes_ in sorted({size[name] for name in names}):
        group = [name for name in names if size[name] == bytes_]  # declaration (offset) order
        by_use = sorted((name for name in group if name in first), key=first.get)
        rename.update(zip(by_use + [name for name in group if name not in first], group))
    return code[:body_start] + use.sub(lambda m: rename[m.group(1)], code[body_start:])


def use_canonical_workspaces() -> None:
    """Have TileLang's CUDA code generation in this process apply canonical_workspaces after the post-processing
    already registered (aot/kernels/producer_warp.py's registers at a kernel module's import and replaces what was
    there, so this runs at each build)."""
    import tvm_ffi  # here: the rewrite itself needs no TileLang

    current = tvm_ffi.get_global_func(POSTPROC, allow_missing=True)
    if current is not None and _REGISTERED and current.same_as(_REGISTERED[-1]):
        return

    def postproc(code, target):
        return canonical_workspaces(current(code, target) if current is not None else code)

    tvm_ffi.register_global_func(POSTPROC, f=postproc, override=True)
    _REGISTERED.append(tvm_ffi.get_global_func(POSTPROC))
