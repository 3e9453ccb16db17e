"""scripts/cp_bench.py's dry run on the CPU (gloo, the reference): the rows it writes and what they mean."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_rows_carry_the_slowest_rank_and_each_ranks_median(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))    # mp.spawn's children import the worker by module name
    sys.modules.pop("cp_bench", None)
    import cp_bench
    cp_bench.main(["--lib", "ours", "--out-dir", str(tmp_path), "--worlds", "1,2", "--tokens", "256",
                   "--heads", "2/4", "--passes", "fwd,bwd", "--iters", "3", "--warmup", "1", "--device", "cpu",
                   "--commit", "abc1234"])
    rows = [json.loads(line) for line in (tmp_path / "cpu.jsonl").read_text().splitlines()]
    assert [(r["world_size"], r["pass_"]) for r in rows] == [(1, "fwd"), (1, "bwd"), (2, "fwd"), (2, "bwd")]
    for r in rows:
        assert r["commit"] == "abc1234" and "error" not in r and r["ms"] > 0
        if r["world_size"] == 1:
            assert "rank_ms" not in r and "local_ms" not in r
            continue
        assert len(r["rank_ms"]) == 2 and len(r["rank_local_ms"]) == 2 and r["exact_fallbacks"] == 0
        assert min(r["rank_ms"]) > 0 and min(r["rank_local_ms"]) > 0
        # ms is the median of each call's slowest rank, so no rank's own median exceeds it (rank_ms: 4 decimals)
        assert max(r["rank_ms"]) <= r["ms"] + 1e-4 and max(r["rank_local_ms"]) <= r["local_ms"] + 1e-4


def test_events_timing_is_recorded(tmp_path, monkeypatch):
    """--timing events: the row says so (on the CPU the host's time of calls back to back, the same quantities)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    sys.modules.pop("cp_bench", None)
    import cp_bench
    cp_bench.main(["--lib", "ours", "--out-dir", str(tmp_path), "--worlds", "2", "--tokens", "256", "--heads", "2/4",
                   "--passes", "fwd", "--iters", "3", "--warmup", "1", "--device", "cpu", "--timing", "events"])
    rows = [json.loads(line) for line in (tmp_path / "cpu.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["timing"] == "events" and rows[0]["ms"] > 0 and len(rows[0]["rank_ms"]) == 2
