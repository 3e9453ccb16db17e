"""Runs one merged launch on the chosen backend (called on the batcher's worker thread, never the event loop)."""
from __future__ import annotations

from typing import List

import torch

import flash_qla

from .merge import merge_requests, split_outputs
from .prefill import PrefillRequest, PrefillResult


class PrefillEngine:
    """``backend="reference"`` computes on the CPU; ``"kernels"`` moves the batch to the GPU, launches the
    sm_90a kernels once, and copies the outputs back."""

    def __init__(self, backend: str):
        self.backend = backend
        self.device = torch.device("cuda") if backend == "kernels" else torch.device("cpu")

    def run(self, requests: List[PrefillRequest]) -> List[PrefillResult]:
        batch = merge_requests(requests)
        dev = self.device
        non_blocking = dev.type == "cuda"
        moved = [x.to(dev, non_blocking=non_blocking) for x in (batch.q, batch.k, batch.v, batch.g, batch.beta)]
        # int32 offsets on the launch device: what the kernels read, and no host sync to validate them.
        cu = batch.cu_seqlens.to(device=dev, dtype=torch.int32, non_blocking=non_blocking)
        h0 = None if batch.initial_state is None else batch.initial_state.to(dev, non_blocking=non_blocking)
        with torch.inference_mode():
            o, final_state = flash_qla.chunk_gated_delta_rule(
                *moved, scale=batch.scale, initial_state=h0, output_final_state=batch.output_final_state,
                cu_seqlens=cu, use_qk_l2norm_in_kernel=batch.use_qk_l2norm_in_kernel, backend=self.backend)
        o = o.cpu()
        final_state = None if final_state is None else final_state.cpu()
        return split_outputs(batch, requests, o, final_state)
