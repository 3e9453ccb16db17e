"""One decoded /v1/prefill request: checked through flash_qla.validation, and the key it batches under."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import torch

from flash_qla.validation import validate_inputs

from .errors import InputError
from .sessions import SessionConfig

# What each tensor of a request looks like (no batch dim: the service always packs with cu_seqlens).
TENSOR_LAYOUTS = {"q": "[T, Hq, K]", "k": "[T, Hq, K]", "v": "[T, Hv, V]", "g": "[T, Hv]", "beta": "[T, Hv]",
                  "cu_seqlens": "[N+1]", "initial_state": "[N, Hv, K, V]"}
_DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64"}
REQUIRED_TENSORS = ("q", "k", "v", "g", "beta", "cu_seqlens")


class BatchKey(NamedTuple):
    """Requests with equal keys can share one varlen launch."""
    num_qk_heads: int
    num_v_heads: int
    head_dim_k: int
    head_dim_v: int
    qkv_dtype: torch.dtype
    g_dtype: torch.dtype
    beta_dtype: torch.dtype
    scale: float
    use_qk_l2norm_in_kernel: bool


@dataclass
class PrefillRequest:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu_seqlens: torch.Tensor               # int64, on the host
    initial_state: Optional[torch.Tensor]  # in state_dtype(q.dtype), or None for zeros
    scale: float                           # resolved (K**-0.5 when the client sent none)
    use_qk_l2norm_in_kernel: bool
    output_final_state: bool
    key: BatchKey
    session_ids: Optional[List[str]] = None  # one per sequence: continue from / store into these sessions
    memory_bytes: int = 0                    # the admission's memory estimate (the batcher's launch budget)
    offsets: Optional[List[int]] = None      # cu_seqlens' values (read once on the host, at admission)
    encoding: Optional[str] = None           # the answer's media type, when the launch thread encodes it

    def __post_init__(self):
        if self.offsets is None:
            self.offsets = self.cu_seqlens.tolist()

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.offsets) - 1

    @property
    def session_config(self) -> SessionConfig:
        """The head configuration a session continued by this request must hold."""
        key = self.key
        return SessionConfig(key.num_qk_heads, key.num_v_heads, key.head_dim_k, key.head_dim_v,
                             _DTYPE_NAMES[state_dtype(self.q.dtype)])

    def sequence_lengths(self) -> List[int]:
        return [b - a for a, b in zip(self.offsets[:-1], self.offsets[1:])]


@dataclass
class PrefillResult:
    o: torch.Tensor                        # [T, Hv, V] in v's dtype
    final_state: Optional[torch.Tensor]    # [N, Hv, K, V] float32 (float64 for float64 inputs), or None
    session_tokens: Optional[List[int]] = None  # tokens each session holds after this request


def state_dtype(qkv_dtype: torch.dtype) -> torch.dtype:
    """The dtype states travel in: what the reference computes in (and what the kernels require)."""
    return torch.float64 if qkv_dtype == torch.float64 else torch.float32


def prepare_request(tensors: dict, scale: Optional[float], use_qk_l2norm_in_kernel: bool,
                    output_final_state: Optional[bool], session_ids: Optional[List[str]] = None) -> PrefillRequest:
    """Check a request with the library's own validation (errors name the field) and build its batch key.

    ``output_final_state=None`` means: return the final states unless the request continues sessions (they keep
    them, and not sending them back is what makes a session's turn cheap)."""
    unknown = sorted(set(tensors) - set(TENSOR_LAYOUTS))
    if unknown:
        raise InputError(unknown[0], f"unknown tensor {unknown[0]!r}; expected {sorted(TENSOR_LAYOUTS)}")
    for name in REQUIRED_TENSORS:
        if tensors.get(name) is None:
            raise InputError(name, f"{name} {TENSOR_LAYOUTS[name]} is required")
    for name, x in tensors.items():
        if x is not None and x.dim() != TENSOR_LAYOUTS[name].count(",") + 1:
            raise InputError(name, f"{name} must have {TENSOR_LAYOUTS[name].count(',') + 1} dims "
                                   f"{TENSOR_LAYOUTS[name]}, got shape {tuple(x.shape)}")
    q, k, v, g, beta, cu = (tensors[n] for n in REQUIRED_TENSORS)
    h0 = tensors.get("initial_state")
    if session_ids is not None:
        if h0 is not None:
            raise InputError("session_ids", "send either session_ids (each sequence continues its session's "
                                            "stored state) or initial_state, not both")
        if len(set(session_ids)) != len(session_ids):
            raise InputError("session_ids", "a session can take one sequence per request; session_ids repeats one")
    try:
        problem = validate_inputs(q[None], k[None], v[None], g[None], beta[None], scale, h0, cu)
    except (ValueError, TypeError) as error:
        raise InputError.from_api_error(error) from error
    if session_ids is not None and len(session_ids) != problem.num_seqs:
        raise InputError("session_ids", f"session_ids must name one session per sequence: {problem.num_seqs} "
                                        f"sequences (cu_seqlens), {len(session_ids)} session ids")
    if output_final_state is None:
        output_final_state = session_ids is None
    if h0 is not None:  # exact upcast for lower precisions; lets requests with and without states share a launch
        h0 = h0.to(state_dtype(q.dtype))
    key = BatchKey(problem.num_qk_heads, problem.num_v_heads, problem.head_dim_k, problem.head_dim_v,
                   q.dtype, g.dtype, beta.dtype, problem.scale, bool(use_qk_l2norm_in_kernel))
    return PrefillRequest(q, k, v, g, beta, cu.to(torch.int64), h0, problem.scale,
                          bool(use_qk_l2norm_in_kernel), bool(output_final_state), key,
                          None if session_ids is None else list(session_ids))
