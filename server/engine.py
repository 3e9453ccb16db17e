"""Runs one merged launch on the chosen backend (called on the batcher's worker thread, never the event loop).

Sequences of a launch start from: their session's row of the state pool (requests with ``session_ids``), the
state the client uploaded (``initial_state``), or zeros. Session sequences' final states are written back to the
pool after the launch; a launch that fails changes no session.
"""
from __future__ import annotations

from typing import List, Optional, Union

import torch

import flash_qla

from .merge import merge_requests, session_rows, split_outputs
from .prefill import PrefillRequest, PrefillResult
from .sessions import Lease, SessionStore


class PrefillEngine:
    """``backend="reference"`` computes on the CPU; ``"kernels"`` moves the batch to the GPU, launches the
    sm_90a kernels once, and copies the outputs back."""

    def __init__(self, backend: str, store: Optional[SessionStore] = None):
        self.backend = backend
        self.device = torch.device("cuda") if backend == "kernels" else torch.device("cpu")
        self.store = store

    def run(self, requests: List[PrefillRequest]) -> List[Union[PrefillResult, BaseException]]:
        results: List[Union[PrefillResult, BaseException, None]] = [None] * len(requests)
        leases: List[Optional[Lease]] = [None] * len(requests)
        try:
            for i, request in enumerate(requests):
                if request.session_ids:
                    try:
                        leases[i] = self.store.acquire(request.session_ids)
                    except Exception as error:  # noqa: BLE001 - this request alone fails (404 / 507)
                        results[i] = error
            runnable = [i for i in range(len(requests)) if results[i] is None]
            if runnable:
                outputs = self._launch([requests[i] for i in runnable], [leases[i] for i in runnable])
                for i, result in zip(runnable, outputs):
                    results[i] = result
            return results
        finally:
            for lease in leases:
                if lease is not None:
                    self.store.release(lease)

    def _launch(self, requests: List[PrefillRequest], leases: List[Optional[Lease]]) -> List[PrefillResult]:
        """A fixed number of torch calls per launch, whatever its number of requests (see server.merge): one
        gather of every session row, one concatenation and (GPU) one host-to-device copy per input, the kernels,
        one scatter, one copy per output."""
        dev = self.device
        held = [lease for lease in leases if lease is not None]
        rows = stored = None
        if held:
            rows, stored = self.store.gather(held)
        batch = merge_requests(requests, dev, stored)
        # int32 offsets on the launch device: what the kernels read, and no host sync to validate them.
        cu = batch.cu_seqlens.to(device=dev, dtype=torch.int32, non_blocking=dev.type == "cuda")
        # POOL-INDEXED CALL: once flash_qla.chunk_gated_delta_rule takes the pool itself (initial_state=pool,
        # initial_state_indices=<each sequence's row>, inplace_update=True), a launch whose sequences all continue
        # sessions passes held[0].pool.tensor and ``rows`` here and skips both the gather in SessionStore.gather
        # and the scatter in SessionStore.commit below.
        with torch.inference_mode():
            o, final_state = flash_qla.chunk_gated_delta_rule(
                batch.q, batch.k, batch.v, batch.g, batch.beta, scale=batch.scale, initial_state=batch.initial_state,
                output_final_state=batch.output_final_state or bool(held),
                cu_seqlens=cu, use_qk_l2norm_in_kernel=batch.use_qk_l2norm_in_kernel, backend=self.backend)
        if held:
            self.store.commit(held, rows, session_rows(batch, requests, final_state),
                              [r.sequence_lengths() for r in requests if r.session_ids])
        wanted = final_state is not None and batch.output_final_state
        o, final_host = self._to_host(o, final_state if wanted else None)
        results = split_outputs(batch, requests, o, final_host)
        for result, lease in zip(results, leases):
            if lease is not None:
                result.session_tokens = [s.tokens for s in lease.sessions]
        return results

    @staticmethod
    def _to_host(o: torch.Tensor, final_state: Optional[torch.Tensor]):
        """Host copies; from the GPU into page-locked memory of torch's caching host allocator (reused between
        launches: no page faults on fresh buffers, and a direct DMA), both queued, then one wait."""
        if o.device.type != "cuda":
            return o, final_state
        copies = []
        for x in (o, final_state):
            if x is not None:
                host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                host.copy_(x, non_blocking=True)
                x = host
            copies.append(x)
        torch.cuda.current_stream(o.device).synchronize()
        return copies[0], copies[1]
