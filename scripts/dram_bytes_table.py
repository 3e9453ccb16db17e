"""Per-kernel DRAM traffic and time of one backward call from scripts/dram_bytes.sh's ncu CSVs: a table on stdout,
JSON lines (one per kernel, then one total per file) with --jsonl OUT.
usage: python scripts/dram_bytes_table.py CSV [CSV ...] [--jsonl OUT]
A file is named LIB_MODEL_SEQS.csv (ours_hk16_hv32_32k_8seq.csv)."""
import csv
import json
import os
import sys

UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "ns": 1e-3, "nsecond": 1e-3, "us": 1.0,
         "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def kernels(path):
    """[(kernel name, {metric: value in bytes or microseconds})] in launch order."""
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    if not rows:
        return []
    head = rows[0]
    col = {name: head.index(name) for name in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
    found: dict = {}
    for r in rows[1:]:
        value = float(r[col["Metric Value"]].replace(",", "")) * UNITS[r[col["Metric Unit"]]]
        found.setdefault((int(r[col["ID"]]), r[col["Kernel Name"]]), {})[r[col["Metric Name"]]] = value
    return [(name, metrics) for (_, name), metrics in sorted(found.items())]


def record(lib, model, seqs, kernel, read, write, us):
    """One JSON line: bytes in MB, time in us, the achieved DRAM rate."""
    return {"lib": lib, "model": model, "seqs": seqs, "kernel": kernel, "read_mb": round(read / 1e6, 1),
            "write_mb": round(write / 1e6, 1), "us": round(us, 1),
            "tb_per_s": round((read + write) / us / 1e6, 2) if us else None}


def main():
    args = sys.argv[1:]
    out = open(args[args.index("--jsonl") + 1], "w") if "--jsonl" in args else None
    paths = [a for i, a in enumerate(args) if a != "--jsonl" and (i == 0 or args[i - 1] != "--jsonl")]
    for path in paths:
        lib, rest = os.path.basename(path)[:-4].split("_", 1)
        model, length, count = rest.rsplit("_", 2)  # hk16_hv32 _ 32k _ 8seq
        seqs = f"{length}_{count}"
        print(f"== {lib} {model} {seqs}")
        total = {"read": 0.0, "write": 0.0, "us": 0.0}
        for name, m in kernels(path):
            rd, wr, us = m["dram__bytes_read.sum"], m["dram__bytes_write.sum"], m["gpu__time_duration.sum"]
            for key, value in (("read", rd), ("write", wr), ("us", us)):
                total[key] += value
            rec = record(lib, model, seqs, name.split("(")[0][:60], rd, wr, us)
            print(f"  {rec['kernel'][:44]:44s} read {rec['read_mb']:8.1f} MB  write {rec['write_mb']:8.1f} MB  "
                  f"{us:8.1f} us  {rec['tb_per_s']} TB/s")
            if out:
                out.write(json.dumps(rec) + "\n")
        rec = record(lib, model, seqs, "TOTAL", total["read"], total["write"], total["us"])
        print(f"  TOTAL {rec['read_mb'] + rec['write_mb']:.0f} MB in {rec['us'] / 1e3:.3f} ms of kernels: "
              f"{rec['tb_per_s']} TB/s")
        if out:
            out.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
