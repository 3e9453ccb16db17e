"""``python -m flash_qla.bench`` on the CPU with the reference backend: schema, filters, failures."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flash_qla
from flash_qla.bench import cli
from flash_qla.bench.inputs import draw_inputs
from flash_qla.bench.matrix import DEFAULT_MATRIX, BenchRow, all_rows, load_matrix

ROOT = Path(__file__).resolve().parents[1]
SHARED_BENCH = ROOT.parent / "shared" / "bench"
FIXTURES = ROOT / "tests" / "data" / "bench"
PEER_KEYS = ["lib", "version", "device", "pass_", "model", "hq", "hv", "seqs", "eager_ms", "graph_ms",
             "first_call_s"]
CPU_ARGS = ["--device", "cpu", "--backend", "reference", "--matrix", "smoke", "--warmup", "1", "--iters", "2"]


def anchor_keys():
    """The peers' schema, read from the real anchors when present (else the fixture copy)."""
    path = SHARED_BENCH / "anchors_h200.jsonl"
    path = path if path.exists() else FIXTURES / "anchors_small.jsonl"
    return list(json.loads(path.read_text().splitlines()[0]))


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_schema_matches_the_anchors():
    assert anchor_keys() == PEER_KEYS


def test_cli_writes_one_record_per_row_in_the_peer_schema(tmp_path):
    out = tmp_path / "r.jsonl"
    assert cli.main(CPU_ARGS + ["--out", str(out)]) == 0
    records = read_jsonl(out)
    expected = all_rows(load_matrix(str(cli.resolve_matrix_path("smoke"))))
    assert [(r["pass_"], r["model"], r["seqs"]) for r in records] == [(w.pass_, w.model, w.label) for w in expected]
    for r, row in zip(records, expected):
        assert list(r)[:len(PEER_KEYS)] == PEER_KEYS
        assert r["lib"] == "flash_qla_aot" and r["version"] == flash_qla.__version__
        assert (r["hq"], r["hv"], r["tokens"], r["num_seqs"]) == (row.hq, row.hv, row.tokens, len(row.seqlens))
        assert r["backend"] == "reference" and r["device"].startswith("cpu")
        assert r["graph_ms"] is None and r["peak_mem_mb"] is None  # no graphs, no allocator stats on CPU
        assert isinstance(r["eager_ms"], float) and r["eager_ms"] > 0
        assert isinstance(r["first_call_s"], float) and r["first_call_s"] >= 0
        assert "error" not in r
    assert [r["first_in_process"] for r in records] == [True] + [False] * (len(records) - 1)


def test_rows_filter_pass_and_append(tmp_path):
    out = tmp_path / "r.jsonl"
    assert cli.main(CPU_ARGS + ["--pass", "bwd", "--rows", "3seq", "--out", str(out)]) == 0
    assert cli.main(CPU_ARGS + ["--pass", "fwd", "--rows", "1x96", "--out", str(out), "--append"]) == 0
    assert [(r["pass_"], r["seqs"]) for r in read_jsonl(out)] == [("bwd", "3seq"), ("fwd", "1x96")]


def test_failing_rows_are_recorded_not_invented(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel not available")
    monkeypatch.setattr(flash_qla, "chunk_gated_delta_rule", broken)  # the bench calls through the module
    out = tmp_path / "r.jsonl"
    assert cli.main(CPU_ARGS + ["--pass", "fwd", "--out", str(out)]) == 1
    records = read_jsonl(out)
    assert len(records) == 2
    for r in records:
        assert r["graph_ms"] is None and r["eager_ms"] is None
        assert r["error"] == "RuntimeError: kernel not available"


def test_unusable_backend_or_device_fails_before_any_row(tmp_path):
    with pytest.raises(SystemExit, match="kernels"):
        cli.main(["--device", "cpu", "--backend", "kernels", "--matrix", "smoke", "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cpu"):
            cli.main(["--matrix", "smoke"])
    with pytest.raises(SystemExit, match="no matrix rows"):
        cli.main(CPU_ARGS + ["--rows", "no-such-row"])


def test_inputs_follow_inputs_md():
    row = BenchRow("bwd", "gva-4-8", 4, 8, "3seq", (100, 28, 3), 128)  # small: drawing is the slow part
    x = draw_inputs(row, "cpu")
    tokens, n = row.tokens, len(row.seqlens)
    assert x.q.shape == x.k.shape == (1, tokens, row.hq, 128) and x.q.dtype == torch.bfloat16
    assert x.v.shape == x.do.shape == (1, tokens, row.hv, 128) and x.v.dtype == torch.bfloat16
    assert x.g.dtype == x.beta.dtype == x.h0.dtype == x.dht.dtype == torch.float32
    assert x.h0.shape == x.dht.shape == (n, row.hv, 128, 128)
    assert x.cu_seqlens.dtype == torch.int32 and x.cu_seqlens.tolist()[-1] == tokens
    assert torch.allclose(x.q.float().norm(dim=-1), torch.ones(()), atol=1e-2)
    assert (x.g <= 0).all() and ((x.beta > 0) & (x.beta < 1)).all()
    no_decay_heads = int((x.g == 0).all(dim=1).sum())
    assert no_decay_heads == row.hv - math.ceil(0.75 * row.hv)  # a quarter of the v-heads
    assert x.scale == 128 ** -0.5
    assert torch.equal(draw_inputs(row, "cpu").v, x.v)  # seeded: every library sees the same data


def test_packaged_matrix_is_the_standard_one():
    shared = SHARED_BENCH / "matrix.json"
    if not shared.exists():
        pytest.skip("../shared/bench/matrix.json is not here")
    assert json.loads(DEFAULT_MATRIX.read_text()) == json.loads(shared.read_text())


def test_module_entry_point_runs(tmp_path):
    out = tmp_path / "r.jsonl"
    proc = subprocess.run([sys.executable, "-m", "flash_qla.bench", *CPU_ARGS, "--rows", "fwd|", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(read_jsonl(out)) == 2 and "[2/2] fwd|tiny-gva|40+70" in proc.stderr


def test_eager_counts_follow_peer_bench_time_budgets(monkeypatch):
    """Without --warmup / --iters the eager call counts come from do_bench's budgets (10 ms, 60 ms), as the peers are
    timed: a ~3.9 ms call gets 2 warm-up and 15 timed calls, a ~0.49 ms call 20 and 122. A fake clock that each call
    advances by exactly its duration (binary fractions of a second, so no rounding) keeps the counts independent of
    the machine's load."""
    from flash_qla.bench import timing

    class Clock:
        now = 0.0

        def perf_counter(self):
            return self.now
    clock = Clock()
    monkeypatch.setattr(timing, "time", clock)
    for seconds, want_warmup, want_iters in ((1 / 256, 2, 15), (1 / 2048, 20, 122)):
        def call(seconds=seconds):
            clock.now += seconds
        assert timing.eager_counts(call, torch.device("cpu")) == (want_warmup, want_iters), seconds


def test_cli_default_counts_are_recorded(tmp_path):
    out = tmp_path / "r.jsonl"
    args = CPU_ARGS[:-4]  # without --warmup / --iters
    assert cli.main(args + ["--pass", "bwd", "--rows", "3seq", "--out", str(out)]) == 0
    for r in read_jsonl(out):
        assert r["eager_budget_ms"] == [10.0, 60.0]
        assert r["warmup"] >= 1 and r["iters"] >= 1


@pytest.mark.skipif(not (ROOT / "scripts" / "gpu_bench.sh").exists(), reason="beside the installed wheel")
def test_gpu_bench_refuses_to_mix_two_runs_of_a_pass(tmp_path):
    """gpu_bench.sh appends to its folder's files (a later call adds the other pass): a pass whose rows a file already
    holds is refused, naming the file, before anything runs."""
    (tmp_path / "ours.jsonl").write_text(json.dumps({"lib": "flash_qla_aot", "pass_": "fwd"}) + "\n")
    (tmp_path / "qla.jsonl").write_text(json.dumps({"lib": "qla", "pass_": "bwd"}) + "\n")
    script = str(ROOT / "scripts" / "gpu_bench.sh")
    for args, culprit in ((["--pass", "fwd", "--peers", "none"], "ours.jsonl already holds fwd rows"),
                          (["--pass", "both", "--peers", "qla", "--no-ours"], "qla.jsonl already holds bwd rows")):
        run = subprocess.run(["bash", script, str(tmp_path), *args], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and culprit in run.stderr, (run.returncode, run.stderr)
    assert not (tmp_path / "gpu_bench.log").exists()  # refused before it started
