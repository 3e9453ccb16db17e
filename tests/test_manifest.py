"""Manifest parsing/validation and the expression compiler (CPU only, no driver)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fake_libcuda"))
import fixtures  # noqa: E402

from flash_qla.errors import ManifestError  # noqa: E402
from flash_qla.manifest import (ceil_div, compile_arg_builder, compile_expr, evaluate, load_manifest,  # noqa: E402
                                parse_manifest)


def good():
    return fixtures.base_manifest(fixtures.default_entries())


def test_good_manifest_parses():
    m = parse_manifest(good())
    assert m.format_version == 1 and m.arch == "sm_90a" and m.capability == (9, 0)
    assert m.toolchain.tilelang == "0.1.15" and m.toolchain.min_driver_api == 13000 and m.toolchain.min_driver == "580"
    assert [k.key for k in m.kernels] == ["kkt_solve.bf16.K128", "kkt_solve.fp16.K128", "kkt_solve.bf16.K64.bigsmem",
                                          "scale.bf16"]
    k = m.by_key("kkt_solve.bf16.K128")
    assert k.kernel == "kkt_solve" and k.variant == {"dtype": "bf16", "K": 128}
    assert k.block == (128, 1, 1) and k.smem == 16384 and k.symbol == "kkt_solve_kernel"
    assert k.signature == b"pppilfmm"
    assert k.num_tensormaps == 2
    assert k.size_names == ("H", "NT", "scale")
    assert k.pointer_names == ("k", "v", "o")
    assert sorted(m.families) == ["kkt_solve", "scale"] and len(m.families["kkt_solve"]) == 3
    tm = k.params[6]
    assert (tm.kind, tm.dtype, tm.rank, tm.address, tm.swizzle, tm.l2_promotion) == ("tensormap", 10, 3, "k", 3, 2)
    assert [e.source for e in tm.dims] == ["128", "H", "NT * 64"]


def test_manifest_from_json_text_and_file(tmp_path):
    text = json.dumps(good())
    assert len(parse_manifest(text).kernels) == 4
    p = tmp_path / "manifest.json"
    p.write_text(text)
    assert len(load_manifest(p).kernels) == 4
    with pytest.raises(ManifestError, match="cannot read"):
        load_manifest(tmp_path / "missing.json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        parse_manifest("{not json")


def _set(path, value):
    def mutate(m):
        obj = m
        parts = path.split("/")
        for p in parts[:-1]:
            obj = obj[int(p)] if p.isdigit() else obj[p]
        last = parts[-1]
        if value is _DEL:
            del obj[int(last) if last.isdigit() else last]
        else:
            obj[int(last) if last.isdigit() else last] = value
    return mutate


_DEL = object()

MALFORMED = [
    ("format_version", 2, "format_version"),
    ("format_version", "1", "format_version"),
    ("format_version", _DEL, "format_version"),
    ("arch", "hopper", "arch"),
    ("arch", _DEL, "arch"),
    ("toolchain", "13.0", "toolchain"),
    ("toolchain/tilelang", _DEL, "toolchain.tilelang"),
    ("toolchain/nvcc", 13, "toolchain.nvcc"),
    ("toolchain/min_driver_api", "13000", "toolchain.min_driver_api"),
    ("toolchain/min_driver", None, "toolchain.min_driver"),
    ("build_date", 5, "build_date"),
    ("kernels", {}, "kernels"),
    ("kernels/0", "x", "kernels[0]"),
    ("kernels/0/key", _DEL, "kernels[0].key"),
    ("kernels/1/key", "kkt_solve.bf16.K128", "kernels[1].key"),          # duplicate key
    ("kernels/0/kernel", "kkt-solve", "kernels[0].kernel"),
    ("kernels/0/variant", ["bf16"], "kernels[0].variant"),
    ("kernels/0/variant", {"dtype": [1]}, "kernels[0].variant.dtype"),
    ("kernels/1/variant", {"dtype": "bf16", "K": 128}, "kernels[1].variant"),  # duplicate variant
    ("kernels/0/file", "../evil.cubin.xz", "kernels[0].file"),
    ("kernels/0/file", "x.cubin", "kernels[0].file"),
    ("kernels/0/sha256", "abc", "kernels[0].sha256"),
    ("kernels/0/source_hash", _DEL, "kernels[0].source_hash"),
    ("kernels/0/symbol", "bad symbol", "kernels[0].symbol"),
    ("kernels/0/block", [128, 1], "kernels[0].block"),
    ("kernels/0/block", [2048, 1, 1], "kernels[0].block"),
    ("kernels/0/block", [0, 1, 1], "kernels[0].block"),
    ("kernels/0/smem", -1, "kernels[0].smem"),
    ("kernels/0/smem", 1.5, "kernels[0].smem"),
    ("kernels/0/grid", ["NT", "H"], "kernels[0].grid"),
    ("kernels/0/grid/1", "H.bit_length()", "kernels[0].grid[1]"),
    ("kernels/0/grid/0", "NT / 2", "kernels[0].grid[0]"),
    ("kernels/0/grid/2", "1 // 0", "kernels[0].grid[2]"),
    ("kernels/0/params", {}, "kernels[0].params"),
    ("kernels/0/params/0", "k", "kernels[0].params[0]"),
    ("kernels/0/params/0/kind", "pointer", "kernels[0].params[0].kind"),
    ("kernels/0/params/0/name", "1k", "kernels[0].params[0].name"),
    ("kernels/0/params/1/name", "k", "kernels[0].params[1].name"),     # duplicate name
    ("kernels/0/params/3/expr", _DEL, "kernels[0].params[3].expr"),
    ("kernels/0/params/3/expr", "__import__('os')", "kernels[0].params[3].expr"),
    ("kernels/0/params/3/expr", "1.5", "kernels[0].params[3].expr"),   # float in an i32
    ("kernels/0/params/6/rank", 6, "kernels[0].params[6].rank"),
    ("kernels/0/params/6/dtype", "bf16", "kernels[0].params[6].dtype"),
    ("kernels/0/params/6/address", _DEL, "kernels[0].params[6].address"),
    ("kernels/0/params/6/dims", ["128", "H"], "kernels[0].params[6].dims"),
    ("kernels/0/params/6/dims/1", "H[0]", "kernels[0].params[6].dims[1]"),
    ("kernels/0/params/6/strides", ["256", "H * 256", "1"], "kernels[0].params[6].strides"),
    ("kernels/0/params/6/box", "64", "kernels[0].params[6].box"),
    ("kernels/0/params/6/element_strides", _DEL, "kernels[0].params[6].element_strides"),
    ("kernels/0/params/6/swizzle", _DEL, "kernels[0].params[6].swizzle"),
    ("kernels/0/params/6/interleave", True, "kernels[0].params[6].interleave"),
    ("kernels/0/params/6/l2_promotion", 99, "kernels[0].params[6].l2_promotion"),
    ("kernels/0/params/6/oob_fill", "0", "kernels[0].params[6].oob_fill"),
    ("kernels/0/registers", "90", "kernels[0].registers"),
    ("kernels/0/compile_seconds", "3s", "kernels[0].compile_seconds"),
    ("kernels/0/shared_carveout", 101, "kernels[0].shared_carveout"),
    ("kernels/0/shared_carveout", "max", "kernels[0].shared_carveout"),
]


@pytest.mark.parametrize("path,value,field", MALFORMED, ids=[f"{p}={v!r}"[:60] for p, v, _ in MALFORMED])
def test_malformed_field_names_it(path, value, field):
    m = good()
    _set(path, value)(m)
    with pytest.raises(ManifestError) as ei:
        parse_manifest(m, source="test.json")
    assert ei.value.field == field, str(ei.value)
    assert repr(field) in str(ei.value) and "test.json" in str(ei.value)


@pytest.mark.parametrize("path,value,field", MALFORMED, ids=[f"{p}={v!r}"[:60] for p, v, _ in MALFORMED])
def test_malformed_field_named_by_a_lazy_parse_too(path, value, field):
    """lazy=True (the loader's read) defers each kernel's grid and params to first use; validate() reads them all
    and names the same field as the up-front parse."""
    m = good()
    _set(path, value)(m)
    with pytest.raises(ManifestError) as ei:
        parse_manifest(m, source="test.json", lazy=True).validate()
    assert ei.value.field == field, str(ei.value)


def test_lazy_parse_defers_only_the_launch_rules():
    m = good()
    _set("kernels/0/params/3/expr", "__import__('os')")(m)
    lazy = parse_manifest(m, lazy=True)  # the broken rule is not read yet
    other = lazy.by_key("kkt_solve.fp16.K128")
    assert other.signature == b"pppilfmm" and other.size_names == ("H", "NT", "scale")
    broken = lazy.by_key("kkt_solve.bf16.K128")
    assert broken.block == (128, 1, 1) and broken.symbol == "kkt_solve_kernel"  # the header was validated
    for read in (lambda: broken.params, lambda: broken.grid, lazy.validate):
        with pytest.raises(ManifestError) as ei:
            read()
        assert ei.value.field == "kernels[0].params[3].expr"
    fine = good()
    assert parse_manifest(fine, lazy=True).validate().kernels == parse_manifest(fine).kernels


def test_shipped_manifest_same_read_lazily():
    shipped = Path(__file__).resolve().parents[1] / "flash_qla" / "_kernels" / "sm90a" / "manifest.json"
    if not shipped.is_file():
        pytest.skip("no shipped manifest in this checkout")
    eager, lazy = load_manifest(shipped), load_manifest(shipped, lazy=True)
    assert lazy.kernels == eager.kernels
    assert [compile_arg_builder(k).__doc__ for k in lazy.kernels] == [compile_arg_builder(k).__doc__
                                                                      for k in eager.kernels]


def test_not_an_object():
    with pytest.raises(ManifestError, match="<document>"):
        parse_manifest([1, 2])


def test_optional_fields_and_int_min_driver():
    m = good()
    for k in m["kernels"]:
        for f in ("registers", "spills", "cubin_bytes", "compile_seconds"):
            k.pop(f, None)
    m["toolchain"]["min_driver"] = 580
    m["toolchain"]["tilelang_commit"] = "abc"
    p = parse_manifest(m)
    assert p.toolchain.min_driver == "580" and p.toolchain.extra == {"tilelang_commit": "abc"}
    assert p.kernels[0].registers is None and p.total_cubin_bytes == 0
    assert p.kernels[0].shared_carveout is None  # the driver's split
    m["kernels"][0]["shared_carveout"] = 100
    assert parse_manifest(m).kernels[0].shared_carveout == 100


def test_empty_kernel_list_is_valid():
    assert parse_manifest(fixtures.base_manifest([])).kernels == ()


# ---- expressions ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("src,sizes,want", [
    ("NT", {"NT": 7}, 7),
    ("42", {}, 42),
    ("NT * 64 + 3", {"NT": 2}, 131),
    ("(a + b) // 2 % 5", {"a": 9, "b": 4}, 1),
    ("-a + +b", {"a": 3, "b": 5}, 2),
    ("ceil_div(T, 64)", {"T": 129}, 3),
    ("ceil_div(T, 64)", {"T": 128}, 2),
    ("min(a, 3)", {"a": 9}, 3),
    ("max(a, b, 10)", {"a": 9, "b": 4}, 10),
    ("ceil_div(max(T, 1), min(C, 64)) * H", {"T": 1000, "C": 64, "H": 8}, 128),
])
def test_expression_evaluation(src, sizes, want):
    assert evaluate(src, sizes) == want
    assert compile_expr(src).evaluate(sizes) == want


def test_expression_names_and_constants():
    e = compile_expr("ceil_div(T, C) * H")
    assert e.names == ("C", "H", "T") and e.value is None
    assert compile_expr("2 * 64 + 1").value == 129
    assert compile_expr(128).value == 128
    assert ceil_div(0, 64) == 0 and ceil_div(1, 64) == 1
    with pytest.raises(KeyError, match="T"):
        evaluate("T + 1", {})


@pytest.mark.parametrize("src", [
    "x.y", "x.__class__", "__import__('os')", "open('f')", "eval('1')", "exec('1')", "getattr(x, 'y')",
    "f(x)", "x()", "a / b", "a ** 2", "a << 1", "a & b", "a if b else c", "a < b", "a and b", "not a",
    "[1]", "(1, 2)", "{1: 2}", "x[0]", "lambda: 1", "'s'", "True", "None", "_x", "__builtins__",
    "min", "ceil_div(1)", "ceil_div(1, 2, 3)", "min(1)", "max(*a)", "min(a=1, b=2)", "(a := 1)",
    "f'{a}'", "1.5", "", "a b", "ceil_div.__name__", "[x for x in y]",
])
def test_unsafe_expressions_rejected(src):
    with pytest.raises(ValueError):
        compile_expr(src)


def test_float_literals_only_when_allowed():
    assert compile_expr("1.4426950408889634", allow_float=True).value == pytest.approx(1.4427, rel=1e-4)
    with pytest.raises(ValueError, match="float"):
        compile_expr("1.5")


def test_overlong_expression_rejected():
    with pytest.raises(ValueError, match="longer"):
        compile_expr("+".join(["a"] * 400))


# ---- argument builder -----------------------------------------------------------------------------------------

def test_arg_builder_matches_rules():
    m = parse_manifest(good())
    build = compile_arg_builder(m.by_key("kkt_solve.bf16.K128"))
    grid, args = build({"NT": 3, "H": 4, "scale": 0.125}, {"k": 0x1000, "v": 0x2000, "o": 0x3000})
    assert grid == (3, 4, 1)
    assert args[:6] == (0x1000, 0x2000, 0x3000, 4, 192, 0.125)
    assert args[6] == (10, 3, 0x1000, (128, 4, 192), (256, 1024), (64, 1, 64), (1, 1, 1), 0, 3, 2, 0)
    assert args[7] == (10, 2, 0x2000, (128, 192), (256,), (64, 128), (1, 1), 0, 2, 1, 0)
    # the builder is plain Python over pre-validated rules: no parsing at call time
    assert "ast" not in build.__code__.co_names and "compile" not in build.__code__.co_names


def test_arg_builder_missing_names():
    m = parse_manifest(good())
    build = compile_arg_builder(m.by_key("kkt_solve.bf16.K128"))
    with pytest.raises(KeyError, match="missing size 'scale'.*sizes \\['H', 'NT', 'scale'\\]"):
        build({"NT": 3, "H": 4}, {"k": 1, "v": 2, "o": 3})
    with pytest.raises(KeyError, match="missing pointer 'o'"):
        build({"NT": 3, "H": 4, "scale": 1.0}, {"k": 1, "v": 2})


def test_builder_namespace_has_no_builtins():
    m = parse_manifest(good())
    build = compile_arg_builder(m.by_key("scale.bf16"))
    assert build.__globals__["__builtins__"] == {}
    assert build({"N": 1000}, {"x": 5}) == ((4, 1, 1), (5, 1000))

