"""Many requests with one batch key -> one packed varlen launch, and its outputs -> each caller's slices."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from .prefill import PrefillRequest, PrefillResult, state_dtype


@dataclass
class MergedBatch:
    q: torch.Tensor                        # [1, T_total, Hq, K] on the launch device
    k: torch.Tensor
    v: torch.Tensor                        # [1, T_total, Hv, V]
    g: torch.Tensor                        # [1, T_total, Hv]
    beta: torch.Tensor
    cu_seqlens: torch.Tensor               # [N_total + 1] int64, host
    initial_state: Optional[torch.Tensor]  # [N_total, Hv, K, V] on the device, None when no request sent one
    scale: float
    use_qk_l2norm_in_kernel: bool
    output_final_state: bool               # true when any request asked for its final state
    token_offsets: List[int]               # request i owns tokens [token_offsets[i], token_offsets[i + 1])
    seq_offsets: List[int]                 # ... and sequences [seq_offsets[i], seq_offsets[i + 1])

    @property
    def num_tokens(self) -> int:
        return self.q.shape[1]


def _offsets(sizes: List[int]) -> List[int]:
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


def merge_requests(requests: List[PrefillRequest], device: Optional[torch.device] = None) -> MergedBatch:
    """Concatenate along tokens; shift every request's cu_seqlens by the tokens before it; stack the states
    (zeros for requests that sent none, which is what the API assumes for them anyway).

    The packed tensors are built on ``device`` (default: the host) by copying each request's piece into its rows:
    for a GPU launch that is one host-to-device copy per piece and no host-side concatenation."""
    device = device or torch.device("cpu")
    non_blocking = device.type == "cuda"
    if not requests or len({r.key for r in requests}) != 1:
        raise ValueError("merge_requests needs one or more requests with the same batch key")
    first = requests[0]
    token_offsets = _offsets([r.num_tokens for r in requests])
    seq_offsets = _offsets([r.num_seqs for r in requests])
    cu = torch.cat([first.cu_seqlens[:1]] + [r.cu_seqlens[1:] + t0 for r, t0 in zip(requests, token_offsets)])
    initial_state = None
    if any(r.initial_state is not None for r in requests):
        Hv, K, V = first.key.num_v_heads, first.key.head_dim_k, first.key.head_dim_v
        dt = state_dtype(first.q.dtype)
        initial_state = torch.zeros(seq_offsets[-1], Hv, K, V, dtype=dt, device=device)
        for r, s0 in zip(requests, seq_offsets):
            if r.initial_state is not None:
                initial_state[s0:s0 + r.num_seqs].copy_(r.initial_state, non_blocking=non_blocking)

    def packed(name: str) -> torch.Tensor:
        first_piece = getattr(first, name)
        out = torch.empty(token_offsets[-1], *first_piece.shape[1:], dtype=first_piece.dtype, device=device)
        for r, t0 in zip(requests, token_offsets):
            out[t0:t0 + r.num_tokens].copy_(getattr(r, name), non_blocking=non_blocking)
        return out[None]

    return MergedBatch(packed("q"), packed("k"), packed("v"), packed("g"), packed("beta"), cu, initial_state,
                       first.scale, first.use_qk_l2norm_in_kernel,
                       any(r.output_final_state for r in requests), token_offsets, seq_offsets)


def split_outputs(batch: MergedBatch, requests: List[PrefillRequest], o: torch.Tensor,
                  final_state: Optional[torch.Tensor]) -> List[PrefillResult]:
    """Each request's own rows of o [1, T_total, Hv, V] and final_state [N_total, Hv, K, V]."""
    results = []
    for i, request in enumerate(requests):
        t0, t1 = batch.token_offsets[i], batch.token_offsets[i + 1]
        s0, s1 = batch.seq_offsets[i], batch.seq_offsets[i + 1]
        state = final_state[s0:s1] if (request.output_final_state and final_state is not None) else None
        results.append(PrefillResult(o[0, t0:t1], state))
    return results
