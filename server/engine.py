"""Runs one merged launch on the chosen backend (called on the batcher's worker thread, never the event loop).

Sequences of a launch start from: their session's row of the state pool (requests with ``session_ids``), the
state the client uploaded (``initial_state``), or zeros. Session sequences' final states are written back to the
pool after the launch; a launch that fails changes no session.
"""
from __future__ import annotations

from typing import List, Optional, Union

import torch

import flash_qla

from .merge import merge_requests, split_outputs
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
        dev = self.device
        batch = merge_requests(requests, dev)
        moved = [batch.q, batch.k, batch.v, batch.g, batch.beta]
        # int32 offsets on the launch device: what the kernels read, and no host sync to validate them.
        cu = batch.cu_seqlens.to(device=dev, dtype=torch.int32, non_blocking=dev.type == "cuda")
        h0 = self._initial_states(batch, requests, leases)
        has_sessions = any(lease is not None for lease in leases)
        # POOL-INDEXED CALL: once flash_qla.chunk_gated_delta_rule takes the pool itself (initial_state=pool,
        # initial_state_indices=<each sequence's row>, inplace_update=True), a launch whose sequences all continue
        # sessions of one pool passes lease.pool.tensor and the concatenated lease.slots here and skips both the
        # gather in SessionStore.acquire and the scatter in SessionStore.commit below.
        with torch.inference_mode():
            o, final_state = flash_qla.chunk_gated_delta_rule(
                *moved, scale=batch.scale, initial_state=h0,
                output_final_state=batch.output_final_state or has_sessions,
                cu_seqlens=cu, use_qk_l2norm_in_kernel=batch.use_qk_l2norm_in_kernel, backend=self.backend)
        session_tokens: List[Optional[List[int]]] = [None] * len(requests)
        for i, (request, lease) in enumerate(zip(requests, leases)):
            if lease is not None:
                s0, s1 = batch.seq_offsets[i], batch.seq_offsets[i + 1]
                self.store.commit(lease, final_state[s0:s1], request.sequence_lengths())
                session_tokens[i] = [s.tokens for s in lease.sessions]
        o = self._to_host(o)
        wanted = final_state is not None and any(r.output_final_state for r in requests)
        final_host = self._to_host(final_state) if wanted else None
        results = split_outputs(batch, requests, o, final_host)
        for result, tokens in zip(results, session_tokens):
            result.session_tokens = tokens
        return results

    @staticmethod
    def _to_host(x: torch.Tensor) -> torch.Tensor:
        """A host copy; from the GPU into page-locked memory of torch's caching host allocator (reused between
        launches: no page faults on fresh buffers, and a direct DMA)."""
        if x.device.type != "cuda":
            return x
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x)
        return host

    def _initial_states(self, batch, requests, leases) -> Optional[torch.Tensor]:
        """[N_total, Hv, K, V] on the device: session rows (already gathered from the pool), uploaded states,
        zeros; None when every sequence starts from zeros."""
        if batch.initial_state is None and all(lease is None for lease in leases):
            return None
        if batch.initial_state is not None:  # zeros where a request sent none; session rows are filled below
            h0 = batch.initial_state
        else:
            first = requests[0]
            dtype = next(lease.initial_states.dtype for lease in leases if lease is not None)
            h0 = torch.zeros(batch.cu_seqlens.numel() - 1, first.key.num_v_heads, first.key.head_dim_k,
                             first.key.head_dim_v, dtype=dtype, device=self.device)
        for i, lease in enumerate(leases):
            if lease is not None:
                h0[batch.seq_offsets[i]:batch.seq_offsets[i + 1]] = lease.initial_states
        return h0
