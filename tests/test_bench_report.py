"""benchmarks.report: BENCHMARKS.md and its figures regenerated from per-card result folders (CPU, seconds)."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.cards import CardError, load_card
from benchmarks.roofline import floor_ms
from flash_qla.bench.matrix import all_rows, load_matrix

ROOT = Path(__file__).resolve().parents[1]
SHARED_COMPARE = ROOT.parent / "shared" / "bench" / "compare.py"
PEER_ROWS = ROOT / "tests" / "data" / "bench" / "anchors_small.jsonl"   # qla and fla rows of an H200
SPEEDUP = 1.25          # the fake "ours" is FlashQLA's rows made this much faster
FAILED_KEY = "fwd|TP8|1x8192"


def key(r):
    return f"{r['pass_']}|{r['model']}|{r['seqs']}"


def make_card(folder: Path, device="NVIDIA H200", backend="kernels", peers=("qla", "fla"), logs=True) -> dict:
    """A result folder: ours = qla's rows / SPEEDUP except one failed row; qla.jsonl, fla.jsonl from the fixture."""
    folder.mkdir(parents=True)
    rows = [json.loads(line) for line in PEER_ROWS.read_text().splitlines()]
    ours = {}
    with open(folder / "ours.jsonl", "w") as out:
        for r in rows:
            if r["lib"] != "qla":
                continue
            mine = dict(r, lib="flash_qla_aot", version="0.1.0", device=device, backend=backend, torch="2.13.0",
                        peak_mem_mb=512.0, graph_ms=round(r["graph_ms"] / SPEEDUP, 4),
                        eager_ms=round(r["eager_ms"] / SPEEDUP, 4), first_in_process=not ours)
            if key(r) == FAILED_KEY:
                mine.update(graph_ms=None, eager_ms=None, error="RuntimeError: planted failure")
            ours[key(r)] = mine
            out.write(json.dumps(mine) + "\n")
    for lib in peers:
        (folder / f"{lib}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["lib"] == lib))
    (folder / "host_overhead.json").write_text(json.dumps({
        "device": device, "launch": {"raw_us": 5.2},
        "rows": [{"shape": "TP8|1x2048", "fwd_host_us": 31.5, "fwd_bwd_host_us": 120.25},
                 {"shape": "TP8|1x64", "fwd_host_us": 29.0}]}))
    if logs:
        (folder / "gpu_tests.log").write_text("....\n293 passed in 27.53s\n")
        (folder / "memcheck.log").write_text("sanitize case ok\n========= ERROR SUMMARY: 0 errors\n")
    return ours


def table_lines(text: str, card: str, pass_: str):
    section = text.split(f"### {card} ", 1)[1].split(f"({pass_})", 1)[1].split("\n### ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ")]


def cells(header_line: str, line: str) -> dict:
    split = lambda s: [c.strip() for c in s.strip().strip("|").split("|")]  # noqa: E731
    return dict(zip(split(header_line), split(line)))


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Generated once for the module: plotting is the slow part."""
    pytest.importorskip("matplotlib")
    tmp = tmp_path_factory.mktemp("report")
    ours = make_card(tmp / "results" / "h200")
    out, figures = tmp / "BENCHMARKS.md", tmp / "docs" / "figures"
    argv = [str(tmp / "results" / "h200"), "--out", str(out), "--plots", str(figures)]
    assert report.main(argv) == 0
    return dict(text=out.read_text(), figures=figures, ours=ours, argv=argv, out=out)


def test_every_matrix_row_with_its_ratios(generated):
    text, ours = generated["text"], generated["ours"]
    peers = {(r["lib"], key(r)): r for r in map(json.loads, PEER_ROWS.read_text().splitlines())}
    for pass_ in ("fwd", "bwd"):
        lines = table_lines(text, "H200", pass_)
        rows = all_rows(load_matrix(), (pass_,))
        assert len(lines) == 2 + len(rows)  # header, separator, one line per matrix row
        assert lines[0].startswith("| row | tokens | ours ms | qla ms | fla ms | x best | x qla |")
        for row, line in zip(rows, lines[2:]):
            c = cells(lines[0], line)
            assert c["row"] == f"{row.model} {row.label}"
            assert c["floor ms"] == f"{floor_ms(row.pass_, row.seqlens, row.hq, row.hv, 'H200'):.3f}"
            mine = ours.get(row.key, {}).get("graph_ms")
            if mine is None:
                assert c["ours ms"] == "missing" and c["x best"] == "–" and c["% floor"] == "–"
                continue
            qla, fla = peers[("qla", row.key)]["graph_ms"], peers[("fla", row.key)]["graph_ms"]
            assert c["x qla"] == f"{qla / mine:.2f}"
            assert c["x best"] == f"{min(qla, fla) / mine:.2f}"
            eager = ours[row.key]["eager_ms"]
            best_eager = min(peers[(lib, row.key)]["eager_ms"] for lib in ("qla", "fla"))
            assert c["x best eager"] == f"{best_eager / eager:.2f}"
    assert f"`{FAILED_KEY}`: RuntimeError: planted failure" in text
    assert "- rows measured: 2 of 32" in text  # the fixture times 3 forward rows, one of them failed


def test_summary_host_cost_and_logs(generated):
    text = generated["text"]
    assert "- graph: x best peer geomean 1.25x" in text and "x qla geomean 1.25x" in text
    assert "| `device` | NVIDIA H200 |" in text and "| `launch.raw_us` | 5.2 |" in text
    assert "| shape | fwd_host_us | fwd_bwd_host_us |" in text
    assert "| TP8\\|1x2048 | 31.5 | 120.25 |" in text and "| TP8\\|1x64 | 29.0 | – |" in text
    assert "`h200/gpu_tests.log`: `293 passed in 27.53s`" in text
    assert "`h200/memcheck.log`: `========= ERROR SUMMARY: 0 errors`" in text
    assert "warning" not in text


def test_figures_written_linked_and_deterministic(generated):
    names = sorted(p.name for p in generated["figures"].iterdir())
    assert names == ["h200_bwd_latency.png", "h200_bwd_speedup.png", "h200_fwd_latency.png",
                     "h200_fwd_speedup.png"]
    first = {n: (generated["figures"] / n).read_bytes() for n in names}
    assert all(data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000 for data in first.values())
    for n in names:
        assert f"](docs/figures/{n})" in generated["text"]
    assert report.main(generated["argv"]) == 0  # regenerating from the same inputs changes nothing
    assert {n: (generated["figures"] / n).read_bytes() for n in names} == first
    assert generated["out"].read_text() == generated["text"]


def test_two_cards_and_a_forward_only_peer(tmp_path):
    make_card(tmp_path / "h100", device="NVIDIA H100 80GB HBM3", peers=("qla",), logs=False)
    make_card(tmp_path / "h200")
    fi = [json.loads(line) for line in (tmp_path / "h200" / "qla.jsonl").read_text().splitlines()]
    (tmp_path / "h200" / "fi.jsonl").write_text("".join(
        json.dumps(dict(r, lib="flashinfer", graph_ms=r["graph_ms"] / 2)) + "\n" for r in fi if r["pass_"] == "fwd"))
    out = tmp_path / "B.md"
    assert report.main([str(tmp_path / "h100"), str(tmp_path / "h200"), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert text.index("## H100") < text.index("## H200") and "![" not in text
    h100 = table_lines(text, "H100", "fwd")
    assert h100[0].startswith("| row | tokens | ours ms | qla ms | x best |")
    h100_row = cells(h100[0], h100[2])
    assert h100_row["floor ms"] == f"{floor_ms('fwd', [32768], 2, 8, 'H100'):.3f}"
    fwd = table_lines(text, "H200", "fwd")
    c = cells(fwd[0], fwd[2])  # TP8 1x32768: FlashInfer at half FlashQLA's time is the best peer
    assert c["x best"] == f"{0.395 / 2 / round(0.395 / 1.25, 4):.2f}" and c["fi ms"] == "0.198"
    bwd = table_lines(text, "H200", "bwd")
    assert "fi ms" in bwd[0] and all(cells(bwd[0], line)["fi ms"] == "–" for line in bwd[2:])


def test_wrong_card_backend_and_bad_folders_are_named(tmp_path):
    make_card(tmp_path / "h100", device="NVIDIA H100 80GB HBM3", backend="reference")
    out = tmp_path / "B.md"
    assert report.main([str(tmp_path / "h100"), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert "reference backend" in text
    assert "`qla` ran on another kind of card than ours" in text
    assert report.main([str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    (tmp_path / "empty").mkdir()
    with pytest.raises(CardError, match="no ours.jsonl"):
        load_card(str(tmp_path / "empty"))
    (tmp_path / "empty" / "ours.jsonl").write_text('{"lib": "flash_qla_aot"}\n')
    with pytest.raises(CardError, match=r"ours.jsonl:1: missing device"):
        load_card(str(tmp_path / "empty"))
    shutil.copytree(tmp_path / "h100", tmp_path / "again" / "h100")
    assert report.main([str(tmp_path / "h100"), str(tmp_path / "again" / "h100"), "--out", str(out)]) == 2


def test_short_batch_section(tmp_path):
    """short_batches.jsonl's compare rows become one table row per (model, batch), a cell per length."""
    make_card(tmp_path / "h200", logs=False)
    cmp = lambda model, seqs, t, ours, peer, lib: dict(  # noqa: E731
        lib="compare", model=model, hq=2, hv=8, seqs=seqs, tokens_per_seq=t, ours_ms=ours, best_peer=lib,
        best_peer_ms=peer, ratio=round(peer / ours, 4))
    rows = [cmp("TP8", 16, 8, 0.0100, 0.0120, "fi"), cmp("TP8", 16, 64, 0.0200, 0.0190, "fi"),
            cmp("TP8", 64, 8, 0.0400, 0.0400, "qla"),
            dict(lib="ours", model="TP8", seqs=16, tokens_per_seq=8, ms=0.0100)]  # a timing row: not tabulated
    (tmp_path / "h200" / "short_batches.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "B.md"
    assert report.main([str(tmp_path / "h200"), "--out", str(out), "--no-plots"]) == 0
    section = out.read_text().split("### Batches of short sequences", 1)[1].split("\n### ", 1)[0]
    geomean = (1.2 * (0.019 / 0.02) * 1.0) ** (1 / 3)
    assert f"geomean {geomean:.3f}x (min 0.950x: TP8 16 x 64); 1/3 rows ahead, 1 level" in section
    table = [line for line in section.splitlines() if line.startswith("| ")]
    assert table[0] == "| model | sequences | 8 tokens | 64 tokens |"
    assert table[2] == "| TP8 | 16 | 0.0100 (1.20x fi) | 0.0200 (0.95x fi) |"
    assert table[3] == "| TP8 | 64 | 0.0400 (1.00x qla) | – |"
    assert len(table) == 4


def test_committed_results_render(tmp_path):
    """The committed folders are valid input (what BENCHMARKS.md is generated from)."""
    folders = sorted(p for p in (ROOT / "bench" / "results").iterdir() if (p / "ours.jsonl").is_file())
    assert folders, "no result folder with an ours.jsonl under bench/results"
    out = tmp_path / "B.md"
    assert report.main([*map(str, folders), "--out", str(out), "--no-plots"]) == 0
    assert "- rows measured:" in out.read_text()


def test_floor_matches_compare_py():
    if not SHARED_COMPARE.exists():
        pytest.skip("../shared/bench/compare.py is not here")
    spec = importlib.util.spec_from_file_location("shared_compare", SHARED_COMPARE)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    for gpu in ("H200", "H100"):
        for row in all_rows(load_matrix()):
            assert floor_ms(row.pass_, row.seqlens, row.hq, row.hv, gpu) == pytest.approx(
                compare.floor_ms(row.pass_, list(row.seqlens), row.hq, row.hv, gpu), rel=1e-12)
