"""What bounds a kernel, from Nsight Compute: the key metrics of `ncu --page details` reports as JSON lines, which
`python -m benchmarks.report` turns into BENCHMARKS.md's kernel-evidence table (any machine, no GPU).

usage: python scripts/ncu_summary.py OUT.jsonl REPORT.txt=ROW=BUILD [...] [--card NAME] [--commit REV] [--append]
                                    [--kernel NAME]
  REPORT.txt: stdout of one profiled launch, e.g. (GPU machine)
      ncu --clock-control none -k regex:gdn_fwd_fused -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \\
          --section SchedulerStats --section WarpStateStats --section Occupancy --page details \\
          python scripts/profile_case.py "TP2|8192x4" --calls 1 > fused_after.txt
  ROW: the benchmark row profiled; BUILD: which build ran (e.g. before / after a change).
One line per report: {kernel, row, build, card, commit, duration_us, dram_pct, sm_pct, l1tex_pct, issue_per_scheduler,
no_eligible_pct, warp_cycles_per_issue, occupancy_pct, l1_hit_pct, l2_hit_pct, l2_input_sectors}; a metric the
report lacks is null. Rows from an `ncu --metrics dram__bytes_read.sum,...` run instead of a details page carry
dram_read_mb (BENCHMARKS.md shows it) and dram_write_mb, their DRAM % from those bytes over the duration.
A REPORT may also be `ncu --metrics ... --csv` output (reports joined by "+" merge: one launch's metrics from several
runs): CSV_METRICS's counters, in millions (the shared-memory wavefronts, bank conflicts and st / ld.shared
instructions that compare two kernels' shared-memory traffic), dram_read_mb / dram_write_mb and the duration.
--kernel names the rows' kernel (a peer's templated name reads poorly).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import re
from pathlib import Path

# metric label in ncu's details page -> our field
METRICS = {
    "Duration": "duration_us",
    "DRAM Throughput": "dram_pct",
    "Compute (SM) Throughput": "sm_pct",
    "L1/TEX Cache Throughput": "l1tex_pct",
    "Issued Warp Per Scheduler": "issue_per_scheduler",
    "No Eligible": "no_eligible_pct",
    "Warp Cycles Per Issued Instruction": "warp_cycles_per_issue",
    "Achieved Occupancy": "occupancy_pct",
    "L1/TEX Hit Rate": "l1_hit_pct",
    "L2 Hit Rate": "l2_hit_pct",
    "L2 Compression Input Sectors": "l2_input_sectors",
}
# `ncu --metrics --csv` counter -> our field (millions; bytes -> MB)
CSV_METRICS = {
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": "shared_wavefronts_m",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": "shared_ld_wavefronts_m",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum": "shared_st_wavefronts_m",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": "shared_conflicts_m",
    "smsp__inst_executed_op_shared_ld.sum": "shared_ld_inst_m",
    "smsp__inst_executed_op_shared_st.sum": "shared_st_inst_m",
    "smsp__inst_executed.sum": "inst_m",
    "sm__inst_executed_pipe_tensor_op_gmma.sum": "gmma_inst_m",
    "smsp__inst_executed_pipe_lsu.sum": "lsu_inst_m",
}
KERNEL_LINE = re.compile(r"^\s+(\w+)\s+\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")
UNITS = {"us": 1.0, "ms": 1000.0, "ns": 0.001}


def parse(text: str) -> dict:
    """The first profiled launch's kernel name and metrics (durations in us)."""
    out = {field: None for field in METRICS.values()}
    out["kernel"] = None
    for line in text.splitlines():
        if out["kernel"] is None:
            found = KERNEL_LINE.match(line)
            if found:
                out["kernel"] = found.group(1).removesuffix("_kernel")
            continue
        for label, field in METRICS.items():
            m = re.match(rf"^\s+{re.escape(label)}\s+(\S+)?\s+([\d,.]+)\s*$", line)
            if m and out[field] is None:
                value = float(m.group(2).replace(",", ""))
                if field == "duration_us":
                    value *= UNITS.get(m.group(1) or "us", 1.0)
                out[field] = value
        if line.strip().startswith("==PROF== Disconnected") and out["duration_us"] is not None:
            break
    return out


def parse_csv(text: str) -> dict:
    """The first profiled launch's counters from `ncu --metrics ... --csv` output (the ==PROF== lines skipped)."""
    rows = list(csv.DictReader(io.StringIO("".join(line + "\n" for line in text.splitlines()
                                                      if line.startswith('"')))))
    if not rows:
        return {"kernel": None}
    first = rows[0]["ID"]
    values = {r["Metric Name"]: float(r["Metric Value"].replace(",", "")) for r in rows
              if r["ID"] == first and r["Metric Value"].replace(",", "").replace(".", "", 1).isdigit()}
    out = {"kernel": rows[0]["Kernel Name"].split("(")[0].split("<")[0].removeprefix("void ").removesuffix("_kernel")}
    out.update({field: round(values[name] / 1e6, 3) for name, field in CSV_METRICS.items() if name in values})
    if "gpu__time_duration.sum" in values:
        out["duration_us"] = round(values["gpu__time_duration.sum"] / 1e3, 2)
    for name, field in (("dram__bytes_read.sum", "dram_read_mb"), ("dram__bytes_write.sum", "dram_write_mb")):
        if name in values:
            out[field] = round(values[name] / 1e6, 1)
    return out


def parse_report(path: str) -> dict:
    """One launch's metrics from a details page (parse), CSV metric runs (parse_csv) or several of them joined by "+"
    (merged; the first kernel name and the first value of each field win)."""
    rec: dict = {"kernel": None}
    for part in path.split("+"):
        text = Path(part).read_text(errors="replace")
        got = parse_csv(text) if '"Metric Name"' in text else parse(text)
        rec.update({k: v for k, v in got.items() if v is not None and rec.get(k) is None})
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("reports", nargs="+", help="REPORT.txt=ROW=BUILD")
    ap.add_argument("--card", default=None, help="the card, e.g. H200")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--kernel", default=None, help="the rows' kernel name (default: the report's)")
    args = ap.parse_args()
    rows = []
    for spec in args.reports:
        path, row, build = spec.split("=", 2)
        rec = parse_report(path)
        if rec["kernel"] is None:
            raise SystemExit(f"ncu_summary: no profiled kernel in {path}")
        kernel = rec.pop("kernel")
        rows.append({"kernel": args.kernel or kernel, "row": row, "build": build, "card": args.card,
                     "commit": args.commit, **rec})
    with open(args.out, "a" if args.append else "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"ncu_summary: {len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
