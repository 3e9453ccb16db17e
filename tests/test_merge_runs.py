"""benchmarks.merge_runs: a row's median over separate bench runs."""
import json
import sys

from benchmarks.merge_runs import main, merge


def _row(seqs, graph, eager, lib="flash_qla_aot"):
    return {"lib": lib, "pass_": "bwd", "model": "hk16_hv32", "seqs": seqs, "graph_ms": graph, "eager_ms": eager}


def test_each_row_takes_its_median_over_the_runs_in_the_first_runs_order():
    runs = [[_row("32k_8seq", 2.98, 2.99), _row("8k_1seq", 0.75, None)],
            [_row("8k_1seq", 0.76, 0.80), _row("32k_8seq", 2.88, 2.90)],
            [_row("32k_8seq", 2.91, 2.95), _row("8k_1seq", 0.74, 0.78)]]
    merged = merge(runs)
    assert [r["seqs"] for r in merged] == ["32k_8seq", "8k_1seq"]
    assert merged[0]["graph_ms"] == 2.91 and merged[0]["graph_ms_runs"] == [2.98, 2.88, 2.91]
    assert merged[0]["eager_ms"] == 2.95 and merged[0]["runs"] == 3
    # a run without the field does not count towards its median
    assert merged[1]["eager_ms"] == 0.79 and merged[1]["eager_ms_runs"] == [0.80, 0.78]


def test_libraries_are_kept_apart(tmp_path, monkeypatch):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(_row("8k_1seq", 0.75, 0.8)) + "\n" + json.dumps(_row("8k_1seq", 0.87, 0.9, "qla")) + "\n")
    b.write_text(json.dumps(_row("8k_1seq", 0.77, 0.8)) + "\n")
    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(sys, "argv", ["merge_runs", str(out), str(a), str(b)])
    main()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["lib"], r["graph_ms"], r["runs"]) for r in rows] == [("flash_qla_aot", 0.76, 2), ("qla", 0.87, 1)]


def test_missing_arguments_are_a_usage_error(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["merge_runs", "out.jsonl"])
    try:
        main()
    except SystemExit as exc:
        assert "usage:" in str(exc.code)
    else:
        raise AssertionError("merge_runs ran without any input run")
