"""scripts/short_batch_sweep.py on the CPU: the sweep's matrix file and the merge of ours and the peers' rows."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("short_batch_sweep", ROOT / "scripts" / "short_batch_sweep.py")
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)


def test_matrix_holds_every_shape_in_the_peers_format(tmp_path):
    out = tmp_path / "m.json"
    assert sweep.main(["matrix", str(out), "--seqs", "16,512", "--tokens", "8,64"]) == 0
    m = json.loads(out.read_text())
    assert m["head_dim"] == 128 and [x[1:] for x in m["fwd"]["models"]] == [[2, 8], [8, 32], [16, 64], [16, 16]]
    assert [s[0] for s in m["fwd"]["seqs"]] == ["16x8", "16x64", "512x8", "512x64"]
    assert m["fwd"]["seqs"][3][1] == [64] * 512


def _row(lib, model, hq, hv, label, graph, eager=1.0):
    return json.dumps(dict(lib=lib, pass_="fwd", model=model, hq=hq, hv=hv, seqs=label, graph_ms=graph,
                           eager_ms=eager)) + "\n"


def test_merge_compares_ours_with_the_fastest_peer(tmp_path):
    ours, fi, qla = tmp_path / "o.jsonl", tmp_path / "fi.jsonl", tmp_path / "qla.jsonl"
    ours.write_text(_row("flash_qla_aot", "TP2", 8, 32, "256x8", 0.5) + _row("flash_qla_aot", "TP8", 2, 8, "16x8", 0.02))
    fi.write_text(_row("flashinfer", "TP2", 8, 32, "256x8", 0.55) + _row("flashinfer", "TP8", 2, 8, "16x8", 0.01))
    qla.write_text(_row("qla", "TP2", 8, 32, "256x8", None, eager=0.45) + "not json\n")
    out = tmp_path / "short.jsonl"
    rc = sweep.main(["merge", "--ours", str(ours), "--peer", f"fi={fi}", "--peer", f"qla={qla}", "--out", str(out),
                     "--source", "fi=test", "--min-ratio", "1.0"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cmp = {(r["model"], r["seqs"]): r for r in rows if r["lib"] == "compare"}
    # a library without a graph time is compared on its eager time
    assert cmp[("TP2", 256)]["best_peer"] == "qla" and cmp[("TP2", 256)]["ratio"] == 0.9
    assert cmp[("TP8", 16)]["ratio"] == 0.5
    assert rc == 1  # a row under --min-ratio
    fi_rows = [r for r in rows if r["lib"] == "fi"]
    assert all(r["source"] == "test" for r in fi_rows)
    # state bytes: 256 sequences x 32 heads x 64 KB read and written
    tp2 = next(r for r in rows if r["lib"] == "ours" and r["model"] == "TP2")
    assert tp2["state_GB"] == round(2 * 256 * 32 * 128 * 128 * 4 / 1e9, 4)
