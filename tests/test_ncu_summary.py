"""scripts/ncu_summary.py: an ncu details page -> the kernel-evidence row BENCHMARKS.md shows."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("ncu_summary", ROOT / "scripts" / "ncu_summary.py")
ncu_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_summary)

PAGE = """==PROF== Connected to process 7 (/usr/bin/python3)
[7] python3@127.0.0.1
  gdn_demo_kernel (128, 1, 1)x(512, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    DRAM Throughput                   %        30.32
    Duration                         ms         1.25
    Compute (SM) Throughput           %        40.03
    Section: Memory Workload Analysis
    L2 Compression Input Sectors                sector    8,653,999
    Section: Scheduler Statistics
    Issued Warp Per Scheduler                        0.40
    No Eligible                            %        60.24
  gdn_other_kernel (1, 1, 1)x(32, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                         us         3.00
"""


def test_parse_takes_the_first_launch_in_microseconds():
    rec = ncu_summary.parse(PAGE)
    assert rec["kernel"] == "gdn_demo"
    assert rec["duration_us"] == 1250.0 and rec["dram_pct"] == 30.32 and rec["sm_pct"] == 40.03
    assert rec["l2_input_sectors"] == 8653999.0 and rec["issue_per_scheduler"] == 0.40
    assert rec["no_eligible_pct"] == 60.24 and rec["occupancy_pct"] is None  # absent from the page


def test_main_writes_rows_the_report_shows(tmp_path, monkeypatch):
    page = tmp_path / "after.txt"
    page.write_text(PAGE)
    card = tmp_path / "h100"
    card.mkdir()
    out = card / "ncu.jsonl"
    monkeypatch.setattr("sys.argv", ["ncu_summary", str(out), f"{page}=TP2 8192x4=after", "--card", "H100"])
    ncu_summary.main()
    row = json.loads(out.read_text())
    assert (row["kernel"], row["row"], row["build"], row["card"]) == ("gdn_demo", "TP2 8192x4", "after", "H100")
    from benchmarks.cards import Card
    from benchmarks.report import ncu_section
    lines = ncu_section(Card(name="h100", path=card, ours=[], ncu=[row]))
    assert any("`gdn_demo` | TP2 8192x4 | after | 1250" in line and "8.7M" in line for line in lines)
