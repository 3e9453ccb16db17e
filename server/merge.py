"""Many requests with one batch key -> one packed varlen launch, and its outputs -> each caller's slices.

Built for a launch thread that competes for the GIL with the event loop and the request threads: every torch call
releases and re-takes the GIL, so the merge makes a fixed number of them per launch, not one per request and
tensor. For a GPU, each input's pieces are concatenated into page-locked host memory (torch's caching host
allocator, reused between launches) and copied to the device once, asynchronously: a copy from pageable memory
would wait for the device's stream and stage through the driver's own buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from .prefill import PrefillRequest, PrefillResult, state_dtype

_PACKED = ("q", "k", "v", "g", "beta")


@dataclass
class MergedBatch:
    q: torch.Tensor                        # [1, T_total, Hq, K] on the launch device
    k: torch.Tensor
    v: torch.Tensor                        # [1, T_total, Hv, V]
    g: torch.Tensor                        # [1, T_total, Hv]
    beta: torch.Tensor
    cu_seqlens: torch.Tensor               # [N_total + 1] int64, host
    initial_state: Optional[torch.Tensor]  # [N_total, Hv, K, V] on the device, None when every sequence starts at 0
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


def _concat(pieces: List[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _packed(pieces: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``pieces`` (along dim 0) on ``device``. Host pieces bound for a GPU are concatenated into page-locked memory
    and copied in one asynchronous transfer (the caching host allocator keeps the buffer until the copy is done);
    pieces on the device already are concatenated there."""
    if all(p.device == device for p in pieces):
        return _concat(pieces)
    if any(p.device.type != "cpu" for p in pieces):  # mixed: stored states on the device beside uploaded ones
        return _concat([p.to(device, non_blocking=True) for p in pieces])
    if device.type != "cuda":
        return _concat(pieces).to(device)
    first = pieces[0]
    host = torch.empty((sum(p.shape[0] for p in pieces), *first.shape[1:]), dtype=first.dtype, pin_memory=True)
    torch.cat(pieces, out=host)
    return host.to(device, non_blocking=True)


def merge_requests(requests: List[PrefillRequest], device: Optional[torch.device] = None,
                   stored_states: Optional[torch.Tensor] = None) -> MergedBatch:
    """Concatenate along tokens; shift every request's cu_seqlens by the tokens before it; stack the initial
    states: a session request's rows of ``stored_states`` (the stored states of every session request's
    sequences, in request order), an uploaded state, or zeros (what the API assumes for a request without one).

    The packed tensors are built on ``device`` (default: the host): one concatenation each, and for a GPU one copy
    each."""
    device = torch.device(device or "cpu")
    if not requests or len({r.key for r in requests}) != 1:
        raise ValueError("merge_requests needs one or more requests with the same batch key")
    first = requests[0]
    token_offsets = _offsets([r.num_tokens for r in requests])
    seq_offsets = _offsets([r.num_seqs for r in requests])
    cu = [0]
    for r, t0 in zip(requests, token_offsets):
        cu.extend(t0 + end for end in r.offsets[1:])
    packed = [_packed([getattr(r, name) for r in requests], device)[None] for name in _PACKED]
    return MergedBatch(*packed, torch.tensor(cu, dtype=torch.int64),
                       _initial_states(requests, device, stored_states), first.scale, first.use_qk_l2norm_in_kernel,
                       any(r.output_final_state for r in requests), token_offsets, seq_offsets)


def _initial_states(requests: List[PrefillRequest], device: torch.device,
                    stored_states: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    sessions = [bool(r.session_ids) for r in requests]
    if any(sessions) and stored_states is None:
        raise ValueError("requests that continue sessions need their stored states (stored_states)")
    if all(sessions):  # every sequence continues a session: the gathered rows are the initial states
        return stored_states
    if not any(sessions) and all(r.initial_state is None for r in requests):
        return None
    first = requests[0]
    shape = (first.key.num_v_heads, first.key.head_dim_k, first.key.head_dim_v)
    dtype = state_dtype(first.q.dtype)
    # zeros where the stored states live (the device), or on the host beside uploaded states that go there in one copy
    zeros_on = device if any(sessions) else torch.device("cpu")
    pieces, row = [], 0
    for r, is_session in zip(requests, sessions):
        if is_session:
            pieces.append(stored_states[row:row + r.num_seqs])
            row += r.num_seqs
        elif r.initial_state is not None:
            pieces.append(r.initial_state)
        else:
            pieces.append(torch.zeros(r.num_seqs, *shape, dtype=dtype, device=zeros_on))
    return _packed(pieces, device)


def session_rows(batch: MergedBatch, requests: List[PrefillRequest], states: torch.Tensor) -> torch.Tensor:
    """The rows of ``states`` [N_total, ...] that belong to session requests' sequences, in request order (the
    order of ``stored_states``)."""
    if all(r.session_ids for r in requests):
        return states
    return _concat([states[batch.seq_offsets[i]:batch.seq_offsets[i + 1]]
                    for i, r in enumerate(requests) if r.session_ids])


def split_outputs(batch: MergedBatch, requests: List[PrefillRequest], o: torch.Tensor,
                  final_state: Optional[torch.Tensor]) -> List[PrefillResult]:
    """Each request's own rows of o [1, T_total, Hv, V] and final_state [N_total, Hv, K, V] (views)."""
    o = o[0]
    results = []
    for i, request in enumerate(requests):
        t0, t1 = batch.token_offsets[i], batch.token_offsets[i + 1]
        s0, s1 = batch.seq_offsets[i], batch.seq_offsets[i + 1]
        state = final_state[s0:s1] if (request.output_final_state and final_state is not None) else None
        results.append(PrefillResult(o[t0:t1], state))
    return results
