"""``python -m flash_qla.bench``: time flash_qla on the benchmark matrix, one JSON line per row.

Examples::

    python -m flash_qla.bench --pass both --out ours.jsonl                          # the standard matrix
    python -m flash_qla.bench --rows "fwd|TP8|" --warmup 5 --iters 50              # a subset
    python -m flash_qla.bench --device cpu --backend reference --matrix smoke      # CPU plumbing check

Rows that raise are written with null timings and an ``error`` key, and the exit status is then 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

import torch

from . import timing
from .matrix import DEFAULT_MATRIX, PASSES, iter_rows, load_matrix
from .runner import failed_record, measure_row, resolved_backend

NAMED_MATRICES = {"standard": DEFAULT_MATRIX, "smoke": Path(__file__).with_name("smoke_matrix.json")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flash_qla.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--matrix", default="standard",
                   help="matrix file, or 'standard' (the packaged matrix.json) or "
                        "'smoke' (a tiny matrix for CPU runs)")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "bwd", "both"), default="both")
    p.add_argument("--out", help="JSONL file to write (default: stdout)")
    p.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    p.add_argument("--rows", help="keep only rows whose 'pass|model|seqs' key contains this substring")
    p.add_argument("--backend", choices=("auto", "kernels", "reference"), default="auto")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed eager calls per row before timing (default: 10 ms worth, as triton's do_bench)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed eager calls per row, median reported (default: 60 ms worth, as triton's do_bench)")
    return p


def resolve_matrix_path(name: str) -> Path:
    return Path(NAMED_MATRICES.get(name, name))


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("flash_qla.bench: CUDA is not available here; for a CPU plumbing run use "
                         "--device cpu --backend reference --matrix smoke")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.warmup is not None and args.warmup < 0) or (args.iters is not None and args.iters < 1):
        raise SystemExit("flash_qla.bench: --warmup must be >= 0 and --iters >= 1")
    device = resolve_device(args.device)
    try:
        backend_name = resolved_backend(device, args.backend)  # one that cannot run here fails before any row
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"flash_qla.bench: {exc}")
    passes = PASSES if args.pass_ == "both" else (args.pass_,)
    rows = list(iter_rows(load_matrix(str(resolve_matrix_path(args.matrix))), passes, args.rows))
    if not rows:
        raise SystemExit(f"flash_qla.bench: no matrix rows match pass={args.pass_} rows={args.rows!r}")

    out = open(args.out, "a" if args.append else "w") if args.out else sys.stdout
    timing.prepare_device(device)
    failures = 0
    try:
        for index, row in enumerate(rows):
            try:
                record = measure_row(row, device, args.backend, args.warmup, args.iters, first_in_process=index == 0)
            except Exception as exc:  # keep going: one broken row must not hide the others' numbers
                failures += 1
                record = failed_record(row, device, backend_name, exc, first_in_process=index == 0)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(_progress_line(index, len(rows), record), file=sys.stderr, flush=True)
    finally:
        if out is not sys.stdout:
            out.close()
    return 1 if failures else 0


def _progress_line(index: int, total: int, record: dict) -> str:
    what = f"[{index + 1}/{total}] {record['pass_']}|{record['model']}|{record['seqs']}"
    if "error" in record:
        return f"{what}: FAILED {record['error']}"
    graph = "-" if record["graph_ms"] is None else f"{record['graph_ms']:.4f}"
    return f"{what}: graph {graph} ms, eager {record['eager_ms']:.4f} ms, first {record['first_call_s']:.2f} s"
