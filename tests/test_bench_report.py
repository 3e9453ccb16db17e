"""The report step: BENCHMARKS.md tables and PNG plots regenerated from JSONL fixtures (CPU, seconds)."""
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from flash_qla.bench import report  # noqa: E402
from flash_qla.bench.matrix import all_rows, load_matrix  # noqa: E402
from flash_qla.bench.roofline import floor_ms  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED_BENCH = ROOT.parent / "shared" / "bench"
FIXTURES = ROOT / "tests" / "data" / "bench"
SPEEDUP = 1.25  # the fake "ours" is the anchors' FlashQLA rows made this much faster
FAILED_KEY = "fwd|TP8|1x2048"  # written as a row that raised


def peer_files():
    """The real anchors and published table when ../shared is there, else small copies of them."""
    if (SHARED_BENCH / "anchors_h200.jsonl").exists() and (SHARED_BENCH / "published_h200.json").exists():
        return SHARED_BENCH / "anchors_h200.jsonl", SHARED_BENCH / "published_h200.json"
    return FIXTURES / "anchors_small.jsonl", FIXTURES / "published_small.json"


def write_fake_ours(anchors: Path, path: Path, drop_key: str) -> dict:
    """Our rows = the anchors' qla rows scaled; one row left out and one failed, to check 'missing'."""
    ours = {}
    with open(path, "w") as out:
        for line in open(anchors):
            r = json.loads(line)
            key = f"{r['pass_']}|{r['model']}|{r['seqs']}"
            if r["lib"] != "qla" or key in (drop_key, FAILED_KEY):
                continue
            r.update(lib="flash_qla_aot", version="0.1.0", backend="kernels", peak_mem_mb=512.0,
                     graph_ms=round(r["graph_ms"] / SPEEDUP, 4), eager_ms=round(r["eager_ms"] / SPEEDUP, 4),
                     first_in_process=not ours)
            ours[key] = r
            out.write(json.dumps(r) + "\n")
        failed = dict(lib="flash_qla_aot", version="0.1.0", device="NVIDIA H200", pass_="fwd", model="TP8",
                      hq=2, hv=8, seqs="1x2048", eager_ms=None, graph_ms=None, first_call_s=None,
                      backend="kernels", error="RuntimeError: planted failure")
        out.write(json.dumps(failed) + "\n")
    return ours


def table_lines(text: str, pass_: str):
    section = text.split(f"({pass_})", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ")]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Generated once for the module: plotting is the slow part."""
    tmp_path = tmp_path_factory.mktemp("report")
    anchors, published = peer_files()
    drop_key = "fwd|TP8|1x8192"
    ours = write_fake_ours(anchors, tmp_path / "ours.jsonl", drop_key)
    out, plots = tmp_path / "BENCHMARKS.md", tmp_path / "docs"
    argv = ["--ours", str(tmp_path / "ours.jsonl"), "--peers", str(anchors), "--published", str(published),
            "--out", str(out), "--plots", str(plots)]
    assert report.main(argv) == 0
    return dict(text=out.read_text(), plots=plots, ours=ours, drop_key=drop_key, argv=argv, out=out,
                published=json.loads(published.read_text())["rows"])


def test_tables_have_every_matrix_row_and_the_ratios(generated):
    text, ours = generated["text"], generated["ours"]
    matrix = load_matrix()
    for pass_ in ("fwd", "bwd"):
        lines = table_lines(text, pass_)
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        assert header[:5] == ["row", "tokens", "ours graph ms", "ours eager ms", "peak MB"]
        assert header[-5:] == ["best peer", "x best", "x qla", "floor ms", "% floor"]
        assert "qla anchor" in header and "fla anchor" in header
        rows = all_rows(matrix, (pass_,))
        assert len(lines) == 2 + len(rows)  # header, separator, one line per matrix row
        for row, line in zip(rows, lines[2:]):
            cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
            assert cells["row"] == f"{row.model} {row.label}"
            assert cells["floor ms"] == f"{floor_ms(row.pass_, row.seqlens, row.hq, row.hv, 'H200'):.3f}"
            if row.key not in ours:
                assert cells["ours graph ms"] == "missing" and cells["x best"] == "–"
                continue
            mine = ours[row.key]["graph_ms"]
            assert cells["ours graph ms"] == f"{mine:.3f}"
            assert cells["x qla"] == f"{ours[row.key]['graph_ms'] * SPEEDUP / mine:.2f}"
            peers = [float(cells[h]) for h in header[5:-5] if cells[h] != "–"]
            assert cells["x best"] == f"{min(peers) / mine:.2f}"
    assert f"| {generated['drop_key'].split('|')[1]} {generated['drop_key'].split('|')[2]} |" in text
    assert "`fwd|TP8|1x2048`: RuntimeError: planted failure" in text


def test_plots_written_linked_and_deterministic(generated):
    names = sorted(p.name for p in generated["plots"].iterdir())
    assert names == ["bench_bwd_latency.png", "bench_bwd_speedup.png", "bench_fwd_latency.png",
                     "bench_fwd_speedup.png"]
    first = {n: (generated["plots"] / n).read_bytes() for n in names}
    assert all(data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000 for data in first.values())
    for n in names:
        assert f"](docs/{n})" in generated["text"]
    assert report.main(generated["argv"]) == 0  # regenerating from the same inputs changes nothing
    assert {n: (generated["plots"] / n).read_bytes() for n in names} == first
    assert generated["out"].read_text() == generated["text"]


def test_fresh_peer_runs_are_columns_and_qla_reference(tmp_path):
    anchors, published = peer_files()
    write_fake_ours(anchors, tmp_path / "ours.jsonl", drop_key="")
    fresh = tmp_path / "qla.jsonl"
    with open(fresh, "w") as out:  # a "fresh" qla run twice as slow as the anchors
        for line in open(anchors):
            r = json.loads(line)
            if r["lib"] == "qla":
                r["graph_ms"] = r["graph_ms"] * 2
                out.write(json.dumps(r) + "\n")
    out = tmp_path / "B.md"
    assert report.main(["--ours", str(tmp_path / "ours.jsonl"), "--peers", str(anchors), "--peers-fresh",
                        str(fresh), "--out", str(out)]) == 0
    text = out.read_text()
    header = [c.strip() for c in table_lines(text, "fwd")[0].strip("|").split("|")]
    assert header[5:8] == ["qla", "qla anchor", "fla anchor"]
    assert "geomean x qla (qla) 2.50" in text  # vs the fresh run, not the anchors
    assert "![" not in text  # no --plots, no images


def test_reference_backend_and_other_gpu_are_flagged(tmp_path):
    anchors, _ = peer_files()
    ours = tmp_path / "ours.jsonl"
    ours.write_text(json.dumps(dict(lib="flash_qla_aot", version="0.1.0", device="cpu (x86_64)", pass_="fwd",
                                    model="TP8", hq=2, hv=8, seqs="1x8192", eager_ms=900.0, graph_ms=None,
                                    first_call_s=1.0, backend="reference")) + "\n")
    out = tmp_path / "B.md"
    assert report.main(["--ours", str(ours), "--peers", str(anchors), "--out", str(out)]) == 0
    text = out.read_text()
    assert "**reference** backend" in text and "not comparable" in text and "(assumed:" in text
    assert "**fwd**: 0 of 32 rows measured." in text


def test_floor_matches_compare_py():
    compare_py = SHARED_BENCH / "compare.py"
    if not compare_py.exists():
        pytest.skip("../shared/bench/compare.py is not here")
    spec = importlib.util.spec_from_file_location("shared_compare", compare_py)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    for gpu in ("H200", "H100"):
        for row in all_rows(load_matrix()):
            assert floor_ms(row.pass_, row.seqlens, row.hq, row.hv, gpu) == pytest.approx(
                compare.floor_ms(row.pass_, list(row.seqlens), row.hq, row.hv, gpu), rel=1e-12)


def test_small_fixtures_and_no_results_yet(tmp_path):
    """The fixture copies (used where ../shared is absent) render, and an empty 'ours' is all missing."""
    empty = tmp_path / "ours.jsonl"
    empty.write_text("")
    out = tmp_path / "B.md"
    assert report.main(["--ours", str(empty), "--peers", str(FIXTURES / "anchors_small.jsonl"), "--published",
                        str(FIXTURES / "published_small.json"), "--out", str(out)]) == 0
    text = out.read_text()
    assert "**no results yet**" in text and "warning" not in text
    assert "| TP8 1x32768 | 32768 | missing | – | – | 0.395 | 0.920 | 0.320 | 1.655 | 0.902 | pub flash_qla |" in text
    assert "**bwd**: 0 of 8 rows measured." in text
