"""Measure one matrix row and return its JSON record (the peers' results schema).

Order within a row, chosen so each figure measures one thing:
1. reset the peak-memory counter, draw the inputs;
2. first call, synchronised (for the backward: the untimed forward plus the first backward, as
   the peers' benchmark counts it); in the process's first row this includes loading the kernels;
3. eager timing; the peak memory is read here, before graph capture adds its private pool;
4. CUDA-graph timing.
"""
from __future__ import annotations

import platform
from typing import Optional

import torch

import flash_qla

from . import timing
from .inputs import draw_inputs
from .matrix import BenchRow
from .workloads import backward_call, forward_call, forward_for_backward

LIB_NAME = "flash_qla_aot"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine() or 'unknown'})"


def resolved_backend(device: torch.device, backend: str) -> str:
    """The backend the API will pick for tensors on ``device`` (raises where none fits, before any row)."""
    return flash_qla.api.select_backend(device, backend)


def _round(x: Optional[float], digits: int) -> Optional[float]:
    return None if x is None else round(x, digits)


def base_record(row: BenchRow, device: torch.device, backend: str) -> dict:
    """The identifying keys, in the peers' order, then our extra ones."""
    return dict(lib=LIB_NAME, version=flash_qla.__version__, device=device_name(device), pass_=row.pass_,
                model=row.model, hq=row.hq, hv=row.hv, seqs=row.label, eager_ms=None, graph_ms=None,
                first_call_s=None, tokens=row.tokens, num_seqs=len(row.seqlens), head_dim=row.head_dim,
                backend=backend, torch=torch.__version__,
                host_lengths=row.pass_ == "fwd")  # the forward gets cu_seqlens_cpu (workloads.forward_call)


def measure_row(row: BenchRow, device: torch.device, backend: str, warmup: Optional[int], iters: Optional[int],
                first_in_process: bool) -> dict:
    """One row's record. warmup / iters: the eager calls; None picks them as triton's do_bench does, from
    its time budgets (timing.eager_counts), so both libraries' graph timings follow the same eager phase."""
    record = base_record(row, device, resolved_backend(device, backend))
    record["first_in_process"] = first_in_process
    timing.reset_peak_memory(device)
    x = draw_inputs(row, str(device))
    timing.synchronize(device)
    inputs_mb = timing.allocated_mb(device)

    if row.pass_ == "fwd":
        call = forward_call(x, backend)
        first_s = timing.first_call_seconds(call, device)
    else:
        holder = {}

        def forward_then_first_backward():
            holder["saved"] = forward_for_backward(x, backend)
            backward_call(x, *holder["saved"], backend)()
        first_s = timing.first_call_seconds(forward_then_first_backward, device)
        call = backward_call(x, *holder["saved"], backend)

    record["first_call_s"] = round(first_s, 3)
    budget = warmup is None or iters is None
    if budget:
        counted_warmup, counted_iters = timing.eager_counts(call, device)
        warmup = counted_warmup if warmup is None else warmup
        iters = counted_iters if iters is None else iters
    record["eager_ms"] = round(timing.eager_median_ms(call, device, warmup, iters), 4)
    peak = timing.peak_mb(device)
    graph_ms, graph_error = timing.graph_median_ms(call, device)
    record["graph_ms"] = _round(graph_ms, 4)
    record["peak_mem_mb"] = _round(peak, 1)
    record["inputs_mem_mb"] = _round(inputs_mb, 1)
    record["warmup"], record["iters"] = warmup, iters
    if budget:
        record["eager_budget_ms"] = [timing.PEER_WARMUP_MS, timing.PEER_REP_MS]
    if graph_error and device.type == "cuda":
        record["graph_error"] = graph_error
    return record


def failed_record(row: BenchRow, device: torch.device, backend: str, error: BaseException,
                  first_in_process: bool) -> dict:
    """A row that raised: timings stay null (reports show it as missing) and the error is kept."""
    record = base_record(row, device, backend)
    record["first_in_process"] = first_in_process
    record["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    return record
