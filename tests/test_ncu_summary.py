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


CSV_RUN = """==PROF== Connected to process 9 (/usr/bin/python3)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","9","python3","h","void device_kernel<Flat<bfloat16_t>>(Params)","1","7","(512, 1, 1)","(256, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","413,600"
"0","9","python3","h","void device_kernel<Flat<bfloat16_t>>(Params)","1","7","(512, 1, 1)","(256, 1, 1)","0","9.0","Command line profiler metrics","l1tex__data_pipe_lsu_wavefronts_mem_shared.sum","","49,682,633"
"0","9","python3","h","void device_kernel<Flat<bfloat16_t>>(Params)","1","7","(512, 1, 1)","(256, 1, 1)","0","9.0","Command line profiler metrics","smsp__inst_executed_op_shared_st.sum","inst","196,608"
"0","9","python3","h","void device_kernel<Flat<bfloat16_t>>(Params)","1","7","(512, 1, 1)","(256, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","428,506,880"
"1","9","python3","h","void other_kernel(Params)","1","7","(32, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","2,000"
"""


def test_csv_metric_runs_merge_with_a_details_page(tmp_path, monkeypatch):
    """`ncu --metrics --csv` output: the first launch's counters in millions, its duration and DRAM bytes; joined by
    "+" with a details page, one row holds both (the page's fields where both have one)."""
    rec = ncu_summary.parse_csv(CSV_RUN)
    assert rec["kernel"] == "device" and rec["duration_us"] == 413.6 and rec["dram_read_mb"] == 428.5
    assert rec["shared_wavefronts_m"] == 49.683 and rec["shared_st_inst_m"] == 0.197
    page, run = tmp_path / "page.txt", tmp_path / "run.csv"
    page.write_text(PAGE)
    run.write_text(CSV_RUN)
    merged = ncu_summary.parse_report(f"{page}+{run}")
    assert merged["kernel"] == "gdn_demo" and merged["duration_us"] == 1250.0 and merged["shared_wavefronts_m"] == 49.683
    out = tmp_path / "ncu.jsonl"
    monkeypatch.setattr("sys.argv", ["ncu_summary", str(out), f"{run}=TP2 4096x8=peer", "--kernel", "peer kernel"])
    ncu_summary.main()
    assert json.loads(out.read_text())["kernel"] == "peer kernel"
