"""The variant matrix: every kernel module under aot/kernels declares its axes in VARIANTS."""
from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
KERNEL_DIR = ROOT / "aot" / "kernels"
COMPILER = ROOT / "aot" / "compile.py"
KERNELS = ("gdn_plan", "gdn_cp_plan", "gdn_prepare", "gdn_bwd_recompute", "gdn_fwd_chain", "gdn_fwd_fused", "gdn_cp_scan", "gdn_cp_combine", "gdn_bwd_dh", "gdn_bwd_chunk", "gdn_gate_bwd", "gdn_state_pick", "gdn_l2norm")
# a few variants CI can compile in minutes to prove the toolchain path
SMOKE = {("gdn_prepare", "bf16.K128.Asolve"), ("gdn_fwd_chain", "bf16.K128.V128.BV64.modeout")}


@dataclass(frozen=True)
class Variant:
    kernel: str
    axes: tuple  # ((name, value), ...) in declaration order

    @property
    def params(self) -> Dict[str, object]:
        return dict(self.axes)

    @property
    def tag(self) -> str:
        return ".".join(f"{v}" if n == "dtype" else f"{n}{v}" for n, v in self.axes)

    @property
    def key(self) -> str:
        return f"{self.kernel}.{self.tag}"

    @property
    def source_path(self) -> Path:
        return KERNEL_DIR / f"{self.kernel}.py"


def module_constant(kernel: str, name: str):
    """A literal module-level constant of a kernel module, read without importing TileLang."""
    import ast
    tree = ast.parse((KERNEL_DIR / f"{kernel}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def declared_axes(kernel: str) -> Dict[str, list]:
    axes = module_constant(kernel, "VARIANTS")
    if axes is None:
        raise LookupError(f"aot/kernels/{kernel}.py declares no VARIANTS")
    return axes


def _allowed(rule, params: Dict[str, object]) -> bool:
    """VARIANT_RULE: an optional boolean expression over the axes (e.g. "BV <= V")."""
    return rule is None or bool(eval(compile(rule, "VARIANT_RULE", "eval"), {"__builtins__": {}}, dict(params)))


def all_variants(subset: str = "full") -> List[Variant]:
    out = []
    for kernel in KERNELS:
        axes = declared_axes(kernel)
        rule = module_constant(kernel, "VARIANT_RULE")
        for values in itertools.product(*axes.values()):
            v = Variant(kernel, tuple(zip(axes.keys(), values)))
            if not _allowed(rule, v.params):
                continue
            if subset == "full" or (kernel, v.tag) in SMOKE:
                out.append(v)
    if subset not in ("full", "smoke"):
        raise ValueError(f"unknown subset {subset!r}: choose smoke or full")
    return out


def pass_configs(v: Variant) -> Dict[str, object]:
    """A kernel module's optional PASS_CONFIGS: TileLang pass options that module's builds need."""
    return dict(module_constant(v.kernel, "PASS_CONFIGS") or {})


def build_prim_func(v: Variant):
    module = importlib.import_module(f"aot.kernels.{v.kernel}")
    return module.build(**v.params)
