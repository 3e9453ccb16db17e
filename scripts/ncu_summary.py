"""What bounds a kernel, from Nsight Compute: the key metrics of `ncu --page details` reports as JSON lines, which
`python -m benchmarks.report` turns into BENCHMARKS.md's kernel-evidence table (any machine, no GPU).

usage: python scripts/ncu_summary.py OUT.jsonl REPORT.txt=ROW=BUILD [...] [--card NAME] [--commit REV] [--append]
  REPORT.txt: stdout of one profiled launch, e.g. (GPU machine)
      ncu --clock-control none -k regex:gdn_fwd_fused -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \\
          --section SchedulerStats --section WarpStateStats --section Occupancy --page details \\
          python scripts/profile_case.py "TP2|8192x4" --calls 1 > fused_after.txt
  ROW: the benchmark row profiled; BUILD: which build ran (e.g. before / after a change).
One line per report: {kernel, row, build, card, commit, duration_us, dram_pct, sm_pct, l1tex_pct, issue_per_scheduler,
no_eligible_pct, warp_cycles_per_issue, occupancy_pct, l1_hit_pct, l2_hit_pct, l2_input_sectors}; a metric the
report lacks is null. Rows from an `ncu --metrics dram__bytes_read.sum,...` run instead of a details page carry
dram_read_mb (BENCHMARKS.md shows it) and dram_write_mb, their DRAM % from those bytes over the duration.
"""
from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("reports", nargs="+", help="REPORT.txt=ROW=BUILD")
    ap.add_argument("--card", default=None, help="the card, e.g. H200")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    rows = []
    for spec in args.reports:
        path, row, build = spec.split("=", 2)
        rec = parse(Path(path).read_text(errors="replace"))
        if rec["kernel"] is None:
            raise SystemExit(f"ncu_summary: no profiled kernel in {path}")
        rows.append({"kernel": rec.pop("kernel"), "row": row, "build": build, "card": args.card,
                     "commit": args.commit, **rec})
    with open(args.out, "a" if args.append else "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"ncu_summary: {len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
