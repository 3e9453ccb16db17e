"""The kernel manifest (``flash_qla/_kernels/<arch>/manifest.json``): parsing, validation and the expression
compiler that turns a kernel's launch rules into one Python function.

The manifest is JSON (no pickle) written by ``build_matrix``. Its launch rules (grid, scalar parameters, tensor-map
dims/strides/box) are expressions over run-time size names in a small Python subset: integer literals, names,
``+ - * // %``, unary ``-``/``+``, parentheses and the functions ``ceil_div(a, b)``, ``min``, ``max``. Float
literals are allowed only in f32 parameters. Expressions are validated against an AST whitelist when the manifest
is parsed; :func:`compile_arg_builder` then turns one kernel's whole argument list into a single Python function
(compiled once, at first use), so a launch does no parsing.

This module imports nothing heavy and never touches CUDA.
"""
from __future__ import annotations

import ast
import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .errors import ManifestError

__all__ = ["FORMAT_VERSION", "PARAM_KINDS", "Expr", "Toolchain", "Param", "LaunchRules", "KernelEntry", "Manifest",
           "parse_manifest", "load_manifest", "compile_expr", "evaluate", "compile_arg_builder", "ceil_div",
           "arch_capability"]

FORMAT_VERSION = 1
PARAM_KINDS = ("ptr", "i32", "i64", "f32", "tensormap")
SIGNATURE_CHARS = {"ptr": "p", "i32": "i", "i64": "l", "f32": "f", "tensormap": "m"}
MAX_EXPR_LEN = 512

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_ARCH = re.compile(r"^sm_(\d+)(\d)([af]?)$")
_FUNCS = ("ceil_div", "min", "max")
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def arch_capability(arch: str) -> Tuple[int, int]:
    """'sm_90a' -> (9, 0)."""
    m = _ARCH.match(arch)
    if not m:
        raise ValueError(f"not an arch token: {arch!r}")
    return int(m.group(1)), int(m.group(2))


# ---------------------------------------------------------------------------------------------------------------
# Expressions

class _Unsafe(ValueError):
    pass


def _check_node(node: ast.AST, allow_float: bool, names: set) -> None:
    if isinstance(node, ast.Expression):
        _check_node(node.body, allow_float, names)
    elif isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _Unsafe(f"literal {v!r} is not an integer")
        if isinstance(v, float) and not allow_float:
            raise _Unsafe(f"float literal {v!r} (only f32 parameters may use floats)")
    elif isinstance(node, ast.Name):
        if node.id in _FUNCS:
            raise _Unsafe(f"{node.id} used as a name")
        if node.id.startswith("_"):
            raise _Unsafe(f"name {node.id!r} (names may not start with '_')")
        names.add(node.id)
    elif isinstance(node, ast.BinOp):
        if not isinstance(node.op, _BINOPS):
            raise _Unsafe(f"operator {type(node.op).__name__} (allowed: + - * // %)")
        _check_node(node.left, allow_float, names)
        _check_node(node.right, allow_float, names)
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.USub, ast.UAdd)):
            raise _Unsafe(f"unary operator {type(node.op).__name__}")
        _check_node(node.operand, allow_float, names)
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCS:
            raise _Unsafe(f"call of {ast.unparse(node.func)!r} (allowed functions: {', '.join(_FUNCS)})")
        if node.keywords:
            raise _Unsafe("keyword arguments")
        want = 2 if node.func.id == "ceil_div" else None
        if (want is not None and len(node.args) != want) or len(node.args) < 2:
            raise _Unsafe(f"{node.func.id} takes {'2' if want else 'at least 2'} arguments")
        for a in node.args:
            if isinstance(a, ast.Starred):
                raise _Unsafe("starred argument")
            _check_node(a, allow_float, names)
    else:
        raise _Unsafe(f"{type(node).__name__} is not allowed (integer arithmetic over size names only)")


@dataclass(frozen=True)
class Expr:
    """A validated expression. ``names`` are the run-time size names it reads; ``value`` is set for constants."""
    source: str
    tree: ast.Expression = field(repr=False, compare=False)
    names: Tuple[str, ...]
    value: Optional[Any] = None

    def evaluate(self, sizes: Mapping[str, Any]) -> Any:
        return evaluate(self, sizes)


def compile_expr(src: Any, allow_float: bool = False) -> Expr:
    """Validate one expression (a string, or a JSON int) against the whitelist; raise ValueError if unsafe."""
    if isinstance(src, bool) or not isinstance(src, (str, int)):
        raise ValueError(f"expression must be a string, got {type(src).__name__}")
    text = str(src).strip()
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_EXPR_LEN:
        raise ValueError(f"expression longer than {MAX_EXPR_LEN} characters")
    return _compile_text(text, allow_float)


@functools.lru_cache(maxsize=None)
def _compile_text(text: str, allow_float: bool) -> Expr:
    """Cached per text: a manifest repeats the same few expressions thousands of times, and parsing it is
    part of a process's first kernel call."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"syntax error in {text!r}: {e.msg}") from None
    names: set = set()
    try:
        _check_node(tree, allow_float, names)
    except _Unsafe as e:
        raise ValueError(f"unsafe expression {text!r}: {e}") from None
    value = None
    if not names:
        if isinstance(tree.body, ast.Constant) and type(tree.body.value) is int:
            value = tree.body.value  # a literal: nothing to fold
        else:
            value = _compile_lambda([text], [tree], ())(())[0]  # constant-fold; may raise ZeroDivisionError
    return Expr(text, tree, tuple(sorted(names)), value)


class _Rename(ast.NodeTransformer):
    """Size names -> local variables ``_s_<name>``; allowed functions -> module-level helpers."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.copy_location(ast.Name(id=f"_s_{node.id}", ctx=ast.Load()), node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        args = [self.visit(a) for a in node.args]
        func = ast.Name(id=f"_f_{node.func.id}", ctx=ast.Load())
        return ast.copy_location(ast.Call(func=func, args=args, keywords=[]), node)


_HELPERS = {"_f_ceil_div": ceil_div, "_f_min": min, "_f_max": max, "__builtins__": {}}


def _code(tree: ast.Expression) -> str:
    import copy
    return ast.unparse(_Rename().visit(copy.deepcopy(tree.body)))


def _compile_lambda(texts: Sequence[str], trees: Sequence[ast.Expression], names: Sequence[str]) -> Callable:
    body = ", ".join(f"({_code(t)})" for t in trees)
    unpack = f"    ({''.join(f'_s_{n}, ' for n in names)}) = _v\n" if names else ""
    src = f"def _f(_v):\n{unpack}    return ({body},)\n"
    ns: Dict[str, Any] = dict(_HELPERS)
    exec(compile(src, "<flash_qla expr>", "exec"), ns)  # noqa: S102 - source built from whitelisted ASTs only
    return ns["_f"]


def evaluate(expr: Any, sizes: Mapping[str, Any]) -> Any:
    """Evaluate an expression (Expr or source text) against a mapping of size names. Slow path: for tests/tools."""
    if not isinstance(expr, Expr):
        expr = compile_expr(expr, allow_float=True)
    if expr.value is not None:
        return expr.value
    missing = [n for n in expr.names if n not in sizes]
    if missing:
        raise KeyError(f"expression {expr.source!r} needs size(s) {', '.join(missing)}")
    return _compile_lambda([expr.source], [expr.tree], expr.names)(tuple(sizes[n] for n in expr.names))[0]


# ---------------------------------------------------------------------------------------------------------------
# Manifest dataclasses

@dataclass(frozen=True)
class Toolchain:
    tilelang: str
    nvcc: str
    min_driver_api: int
    min_driver: str
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Param:
    name: str
    kind: str                                  # ptr | i32 | i64 | f32 | tensormap
    expr: Optional[Expr] = None                # scalars
    # tensormap fields
    dtype: int = 0
    rank: int = 0
    address: str = ""
    dims: Tuple[Expr, ...] = ()
    strides: Tuple[Expr, ...] = ()
    box: Tuple[Expr, ...] = ()
    element_strides: Tuple[Expr, ...] = ()
    interleave: int = 0
    swizzle: int = 0
    l2_promotion: int = 0
    oob_fill: int = 0


class LaunchRules:
    """A kernel's grid and parameter rules, validated when first read. The runtime loader parses each kernel's
    rules at its first launch: a process's first call then validates the few kernels it runs, not all of them
    (the whole manifest's ~6000 parameters took ~170 ms of that call). A malformed rule raises the same
    ManifestError, naming the same field, as an up-front parse (``Manifest.validate``)."""

    __slots__ = ("_raw", "_parsed")

    def __init__(self, raw: Any, parsed: Optional[Tuple[Tuple[Expr, ...], Tuple["Param", ...]]] = None):
        self._raw = raw          # (validator, kernel object, field path), until parsed
        self._parsed = parsed

    def _get(self) -> Tuple[Tuple[Expr, ...], Tuple["Param", ...]]:
        parsed = self._parsed
        if parsed is None:
            # two threads may both parse (the same result, assigned whole). _raw is dropped only after _parsed is
            # set, so a thread that read _raw as None finds _parsed set when it looks again
            raw = self._raw
            parsed = self._parsed
            if parsed is None:
                parsed = self._parsed = _parse_rules(*raw)
                self._raw = None
        return parsed

    @property
    def grid(self) -> Tuple[Expr, ...]:
        return self._get()[0]

    @property
    def params(self) -> Tuple["Param", ...]:
        return self._get()[1]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LaunchRules) and self._get() == other._get()

    def __hash__(self) -> int:
        return hash(self._get())

    def __repr__(self) -> str:
        return "LaunchRules(unparsed)" if self._parsed is None else f"LaunchRules{self._parsed!r}"


@dataclass(frozen=True)
class KernelEntry:
    key: str
    kernel: str
    variant: Dict[str, Any]
    file: str
    sha256: str
    source_hash: str
    symbol: str
    block: Tuple[int, int, int]
    smem: int
    rules: LaunchRules = field(repr=False)
    registers: Optional[int] = None
    spills: Optional[int] = None
    cubin_bytes: Optional[int] = None
    compile_seconds: Optional[float] = None
    shared_carveout: Optional[int] = None  # percent of the SM's L1 / shared memory as shared (None: the driver's)

    @property
    def grid(self) -> Tuple[Expr, ...]:
        return self.rules.grid

    @property
    def params(self) -> Tuple[Param, ...]:
        return self.rules.params

    @property
    def signature(self) -> bytes:
        return "".join(SIGNATURE_CHARS[p.kind] for p in self.params).encode()

    @property
    def size_names(self) -> Tuple[str, ...]:
        """Every run-time size name any launch rule of this kernel reads."""
        names = set()
        for e in self.grid:
            names.update(e.names)
        for p in self.params:
            for e in (p.expr, *p.dims, *p.strides, *p.box, *p.element_strides):
                if e is not None:
                    names.update(e.names)
        return tuple(sorted(names))

    @property
    def pointer_names(self) -> Tuple[str, ...]:
        """Every pointer name the kernel needs (ptr params and tensor-map addresses), in first-use order."""
        out: List[str] = []
        for p in self.params:
            n = p.name if p.kind == "ptr" else p.address if p.kind == "tensormap" else None
            if n is not None and n not in out:
                out.append(n)
        return tuple(out)

    @property
    def num_tensormaps(self) -> int:
        return sum(p.kind == "tensormap" for p in self.params)


@dataclass(frozen=True)
class Manifest:
    format_version: int
    arch: str
    toolchain: Toolchain
    build_date: str
    kernels: Tuple[KernelEntry, ...]
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_key", {k.key: k for k in self.kernels})

    @property
    def capability(self) -> Tuple[int, int]:
        return arch_capability(self.arch)

    def by_key(self, key: str) -> KernelEntry:
        return self._by_key[key]  # type: ignore[attr-defined]

    @property
    def families(self) -> Dict[str, List[KernelEntry]]:
        out: Dict[str, List[KernelEntry]] = {}
        for k in self.kernels:
            out.setdefault(k.kernel, []).append(k)
        return out

    @property
    def total_cubin_bytes(self) -> int:
        return sum(k.cubin_bytes or 0 for k in self.kernels)

    def validate(self) -> "Manifest":
        """Parse every kernel's launch rules now (a manifest read with lazy=True defers them to first use)."""
        for k in self.kernels:
            k.rules.params
        return self


# ---------------------------------------------------------------------------------------------------------------
# Parsing / validation

class _P:
    """Validation helpers bound to a manifest source, raising ManifestError(field, problem)."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, problem: str) -> None:
        raise ManifestError(path, problem, self.source)

    def get(self, obj: Mapping, key: str, path: str, required: bool = True) -> Any:
        if key not in obj:
            if required:
                self.fail(f"{path}.{key}" if path else key, "missing")
            return None
        return obj[key]

    def str_(self, obj: Mapping, key: str, path: str, required: bool = True, pattern=None, what="") -> Optional[str]:
        v = self.get(obj, key, path, required)
        f = f"{path}.{key}" if path else key
        if v is None and not required:
            return None
        if not isinstance(v, str) or not v:
            self.fail(f, f"must be a non-empty string, got {v!r}")
        if pattern is not None and not pattern.match(v):
            self.fail(f, f"{v!r} is not {what}")
        return v

    def int_(self, obj: Mapping, key: str, path: str, required: bool = True, lo: Optional[int] = None,
             hi: Optional[int] = None) -> Optional[int]:
        v = self.get(obj, key, path, required)
        f = f"{path}.{key}" if path else key
        if v is None and not required:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(f, f"must be an integer, got {v!r}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            self.fail(f, f"{v} out of range [{lo}, {hi}]")
        return v

    def expr(self, v: Any, f: str, allow_float: bool = False) -> Expr:
        try:
            return compile_expr(v, allow_float=allow_float)
        except (ValueError, ZeroDivisionError) as e:
            self.fail(f, str(e))
            raise  # unreachable

    def expr_list(self, obj: Mapping, key: str, path: str, n: int) -> Tuple[Expr, ...]:
        v = self.get(obj, key, path)
        f = f"{path}.{key}"
        if not isinstance(v, list):
            self.fail(f, f"must be a list of {n} expressions, got {v!r}")
        if len(v) != n:
            self.fail(f, f"has {len(v)} entries, expected {n}")
        return tuple(self.expr(x, f"{f}[{i}]") for i, x in enumerate(v))


def _parse_param(p: _P, obj: Any, path: str) -> Param:
    if not isinstance(obj, dict):
        p.fail(path, f"must be an object, got {obj!r}")
    name = p.str_(obj, "name", path, pattern=_IDENT, what="an identifier")
    kind = p.str_(obj, "kind", path)
    if kind not in PARAM_KINDS:
        p.fail(f"{path}.kind", f"{kind!r} is not one of {', '.join(PARAM_KINDS)}")
    if kind == "ptr":
        return Param(name, kind)
    if kind in ("i32", "i64", "f32"):
        return Param(name, kind, expr=p.expr(p.get(obj, "expr", path), f"{path}.expr", allow_float=kind == "f32"))
    # tensormap
    rank = p.int_(obj, "rank", path, lo=1, hi=5)
    address = p.str_(obj, "address", path, pattern=_IDENT, what="a pointer name")
    return Param(
        name, kind,
        dtype=p.int_(obj, "dtype", path, lo=0, hi=31), rank=rank, address=address,
        dims=p.expr_list(obj, "dims", path, rank), strides=p.expr_list(obj, "strides", path, rank - 1),
        box=p.expr_list(obj, "box", path, rank), element_strides=p.expr_list(obj, "element_strides", path, rank),
        interleave=p.int_(obj, "interleave", path, lo=0, hi=15), swizzle=p.int_(obj, "swizzle", path, lo=0, hi=15),
        l2_promotion=p.int_(obj, "l2_promotion", path, lo=0, hi=15),
        oob_fill=p.int_(obj, "oob_fill", path, lo=0, hi=15))


def _parse_kernel(p: _P, obj: Any, path: str, lazy: bool = False) -> KernelEntry:
    if not isinstance(obj, dict):
        p.fail(path, f"must be an object, got {type(obj).__name__}")
    key = p.str_(obj, "key", path)
    kernel = p.str_(obj, "kernel", path, pattern=_IDENT, what="an identifier")
    variant = p.get(obj, "variant", path)
    if not isinstance(variant, dict):
        p.fail(f"{path}.variant", f"must be an object of variant axes, got {variant!r}")
    for ax, val in variant.items():
        if not _IDENT.match(ax):
            p.fail(f"{path}.variant", f"axis {ax!r} is not an identifier")
        if not isinstance(val, (str, int, float, bool)) or val is None:
            p.fail(f"{path}.variant.{ax}", f"must be a JSON scalar, got {val!r}")
    file = p.str_(obj, "file", path)
    if "/" in file or "\\" in file or file.startswith(".") or not file.endswith(".cubin.xz"):
        p.fail(f"{path}.file", f"{file!r} must be a plain '*.cubin.xz' file name next to manifest.json")
    sha = p.str_(obj, "sha256", path)
    if not _HEX64.match(sha.lower()):
        p.fail(f"{path}.sha256", f"{sha!r} is not a hex sha256")
    source_hash = p.str_(obj, "source_hash", path)
    symbol = p.str_(obj, "symbol", path, pattern=_IDENT, what="a symbol name")
    block = p.get(obj, "block", path)
    if (not isinstance(block, list) or len(block) != 3
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block)):
        p.fail(f"{path}.block", f"must be 3 positive integers, got {block!r}")
    if block[0] * block[1] * block[2] > 1024:
        p.fail(f"{path}.block", f"{block} has more than 1024 threads")
    smem = p.int_(obj, "smem", path, lo=0, hi=1 << 30)
    rules = LaunchRules((p, obj, path)) if lazy else LaunchRules(None, _parse_rules(p, obj, path))
    registers = p.int_(obj, "registers", path, required=False, lo=0)
    spills = p.int_(obj, "spills", path, required=False, lo=0)
    cubin_bytes = p.int_(obj, "cubin_bytes", path, required=False, lo=0)
    cs = obj.get("compile_seconds")
    if cs is not None and (isinstance(cs, bool) or not isinstance(cs, (int, float))):
        p.fail(f"{path}.compile_seconds", f"must be a number, got {cs!r}")
    carveout = p.int_(obj, "shared_carveout", path, required=False, lo=0, hi=100)
    return KernelEntry(key, kernel, dict(variant), file, sha.lower(), source_hash, symbol, tuple(block), smem,
                       rules, registers, spills, cubin_bytes, cs, carveout)  # type: ignore[arg-type]


def _parse_rules(p: _P, obj: Mapping, path: str) -> Tuple[Tuple[Expr, ...], Tuple[Param, ...]]:
    """A kernel object's grid and params."""
    grid = p.expr_list(obj, "grid", path, 3)
    params_raw = p.get(obj, "params", path)
    if not isinstance(params_raw, list):
        p.fail(f"{path}.params", "must be a list")
    params = tuple(_parse_param(p, x, f"{path}.params[{i}]") for i, x in enumerate(params_raw))
    seen = set()
    for i, prm in enumerate(params):
        if prm.name in seen:
            p.fail(f"{path}.params[{i}].name", f"duplicate parameter name {prm.name!r}")
        seen.add(prm.name)
    return grid, params


def parse_manifest(data: Any, source: str = "", lazy: bool = False) -> Manifest:
    """Validate a manifest (dict, or JSON text/bytes) into a :class:`Manifest`; ManifestError names the field.
    lazy: each kernel's launch rules (grid, params) are validated when first read (LaunchRules), the rest now."""
    p = _P(source)
    if isinstance(data, (str, bytes, bytearray)):
        try:
            data = json.loads(data)
        except ValueError as e:
            p.fail("<document>", f"not valid JSON: {e}")
    if not isinstance(data, dict):
        p.fail("<document>", f"must be a JSON object, got {type(data).__name__}")
    fv = p.int_(data, "format_version", "")
    if fv != FORMAT_VERSION:
        p.fail("format_version", f"unsupported version {fv} (this flash_qla reads version {FORMAT_VERSION})")
    arch = p.str_(data, "arch", "", pattern=_ARCH, what="an arch token like 'sm_90a'")
    tc = p.get(data, "toolchain", "")
    if not isinstance(tc, dict):
        p.fail("toolchain", f"must be an object, got {tc!r}")
    md = tc.get("min_driver")
    if isinstance(md, int) and not isinstance(md, bool):
        md = str(md)
    if not isinstance(md, str) or not md:
        p.fail("toolchain.min_driver", f"must be a driver version string like '580', got {md!r}")
    toolchain = Toolchain(
        tilelang=p.str_(tc, "tilelang", "toolchain"), nvcc=p.str_(tc, "nvcc", "toolchain"),
        min_driver_api=p.int_(tc, "min_driver_api", "toolchain", lo=1000), min_driver=md,
        extra={k: v for k, v in tc.items() if k not in ("tilelang", "nvcc", "min_driver_api", "min_driver")})
    build_date = data.get("build_date", "")
    if not isinstance(build_date, str):
        p.fail("build_date", f"must be a string, got {build_date!r}")
    kernels_raw = p.get(data, "kernels", "")
    if not isinstance(kernels_raw, list):
        p.fail("kernels", f"must be a list, got {type(kernels_raw).__name__}")
    kernels = tuple(_parse_kernel(p, k, f"kernels[{i}]", lazy) for i, k in enumerate(kernels_raw))
    seen: Dict[str, int] = {}
    seen_variant: Dict[Tuple, int] = {}
    for i, k in enumerate(kernels):
        if k.key in seen:
            p.fail(f"kernels[{i}].key", f"duplicate key {k.key!r} (also kernels[{seen[k.key]}])")
        seen[k.key] = i
        vk = (k.kernel, variant_key(k.variant))
        if vk in seen_variant:
            p.fail(f"kernels[{i}].variant", f"duplicate variant of {k.kernel!r} (also kernels[{seen_variant[vk]}])")
        seen_variant[vk] = i
    return Manifest(fv, arch, toolchain, build_date, kernels, source)


def load_manifest(path: Any, lazy: bool = False) -> Manifest:
    """Read and validate a manifest file (a path or an importlib.resources Traversable); lazy as parse_manifest."""
    try:
        text = path.read_text(encoding="utf-8") if hasattr(path, "read_text") else open(path, encoding="utf-8").read()
    except OSError as e:
        raise ManifestError("<document>", f"cannot read: {e}", str(path)) from None
    return parse_manifest(text, source=str(path), lazy=lazy)


def variant_key(variant: Mapping[str, Any]) -> Tuple:
    """Canonical hashable form of a variant dict (order-free)."""
    return tuple(sorted(variant.items()))


# ---------------------------------------------------------------------------------------------------------------
# Argument builder

def compile_arg_builder(entry: KernelEntry) -> Callable[[Mapping[str, Any], Mapping[str, int]], Tuple[tuple, tuple]]:
    """Compile ``entry``'s grid and parameter rules into ``build(sizes, pointers) -> (grid, args)``.

    ``grid`` is a 3-tuple of ints and ``args`` the tuple that ``_launcher.launch`` takes with ``entry.signature``:
    pointers as ints, scalars as numbers, each tensor map as (dtype, rank, address, dims, strides, box,
    element_strides, interleave, swizzle, l2_promotion, oob_fill). A missing size or pointer raises KeyError
    naming it and everything the kernel needs.
    """
    sizes_needed = entry.size_names
    ptrs_needed = entry.pointer_names
    lines = ["def build(sizes, pointers):", "    try:"]
    for n in sizes_needed:
        lines.append(f"        _s_{n} = sizes[{n!r}]")
    for i, n in enumerate(ptrs_needed):
        lines.append(f"        _p{i} = pointers[{n!r}]")
    lines.append("    except KeyError as e:")
    lines.append("        raise _missing(e.args[0]) from None")

    def ex(e: Expr) -> str:
        if e.value is not None:
            return repr(e.value)
        return f"({_code(e.tree)})"

    def tup(es: Sequence[Expr]) -> str:
        return "(" + "".join(ex(e) + ", " for e in es) + ")"

    pidx = {n: i for i, n in enumerate(ptrs_needed)}
    args = []
    for prm in entry.params:
        if prm.kind == "ptr":
            args.append(f"_p{pidx[prm.name]}")
        elif prm.kind == "tensormap":
            args.append(f"({prm.dtype}, {prm.rank}, _p{pidx[prm.address]}, {tup(prm.dims)}, {tup(prm.strides)}, "
                        f"{tup(prm.box)}, {tup(prm.element_strides)}, {prm.interleave}, {prm.swizzle}, "
                        f"{prm.l2_promotion}, {prm.oob_fill})")
        else:
            args.append(ex(prm.expr))  # type: ignore[arg-type]
    lines.append(f"    return {tup(entry.grid)}, ({''.join(a + ', ' for a in args)})")
    src = "\n".join(lines) + "\n"

    def _missing(name: str) -> KeyError:
        kind = "size" if name in sizes_needed else "pointer"
        return KeyError(f"kernel {entry.key}: missing {kind} {name!r}; it needs sizes {list(sizes_needed)} and "
                        f"pointers {list(ptrs_needed)}")

    ns: Dict[str, Any] = dict(_HELPERS)
    ns["_missing"] = _missing
    ns["KeyError"] = KeyError
    exec(compile(src, f"<flash_qla args {entry.key}>", "exec"), ns)  # noqa: S102 - whitelisted ASTs only
    build = ns["build"]
    build.__doc__ = src
    return build
