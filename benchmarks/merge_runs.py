"""Merge several bench runs of the same library into one results file: each row's median over the runs.

A long backward row's graph median moves by a few percent between captures of the same call on one card, more
than some rows' distance to a peer; a row's median over separate runs (each itself a median over replays) is the
figure a ratio should use. The first run's row supplies every other field; `runs`, `graph_ms_runs` and `eager_ms_runs` record what was merged.
usage: python -m benchmarks.merge_runs OUT.jsonl RUN.jsonl [RUN.jsonl ...]
"""
import json
import statistics
import sys


def row_key(r: dict) -> tuple:
    return (r["lib"], r["pass_"], r["model"], r["seqs"])


def merge(runs: list) -> list:
    """One row per key, in the first run's order, with graph_ms / eager_ms the medians over the runs that have it."""
    order, by_key = [], {}
    for rows in runs:
        for r in rows:
            key = row_key(r)
            if key not in by_key:
                order.append(key)
            by_key.setdefault(key, []).append(r)
    merged = []
    for key in order:
        rows = by_key[key]
        out = dict(rows[0], runs=len(rows))
        for field in ("graph_ms", "eager_ms"):
            values = [r[field] for r in rows if r.get(field) is not None]
            out[f"{field}_runs"] = values
            out[field] = round(statistics.median(values), 4) if values else None
        merged.append(out)
    return merged


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: python -m benchmarks.merge_runs OUT.jsonl RUN.jsonl [RUN.jsonl ...]")
    out_path, paths = sys.argv[1], sys.argv[2:]
    runs = [[json.loads(line) for line in open(p) if line.strip()] for p in paths]
    with open(out_path, "w") as out:
        for r in merge(runs):
            out.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
