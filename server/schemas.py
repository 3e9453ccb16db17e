"""Pydantic models: the JSON request/response of /v1/prefill and the probe answers (they also drive /docs)."""
from __future__ import annotations

from typing import List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

DTypeName = Literal["float32", "float16", "bfloat16", "float64"]


class PrefillJSONRequest(BaseModel):
    """One batch of packed sequences sharing one head configuration (nested lists; for small inputs and curl).

    q/k/v are read in ``dtype``; g, beta and initial_state in float32 (float64 when ``dtype`` is float64).
    Numbers must be finite (NaN, Infinity and overflowing literals such as 1e400 are 422).
    """
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dtype: DTypeName = Field("float32", description="dtype of q, k and v (o is returned in it)")
    q: List[List[List[float]]] = Field(..., description="[T, Hq, K]")
    k: List[List[List[float]]] = Field(..., description="[T, Hq, K]")
    v: List[List[List[float]]] = Field(..., description="[T, Hv, V]")
    g: List[List[float]] = Field(..., description="[T, Hv], natural-log decay (<= 0)")
    beta: List[List[float]] = Field(..., description="[T, Hv]")
    cu_seqlens: List[int] = Field(..., description="[N+1] sequence offsets: 0, ..., T")
    initial_state: Optional[List[List[List[List[float]]]]] = Field(None, description="[N, Hv, K, V]")
    session_ids: Optional[List[str]] = Field(
        None, description="[N] one session per sequence (instead of initial_state): each sequence continues from "
                          "its session's stored state (zeros for a new session) and its final state is stored back")
    scale: Optional[float] = Field(None, description="defaults to K**-0.5")
    use_qk_l2norm_in_kernel: bool = False
    output_final_state: Optional[bool] = Field(
        None, description="return final_state; default true, or false when session_ids is given")


class PrefillJSONResponse(BaseModel):
    dtype: DTypeName = Field(..., description="dtype o was computed in (v's dtype)")
    o: List[List[List[float]]] = Field(..., description="[T, Hv, V]")
    final_state: Optional[List[List[List[List[float]]]]] = Field(
        None, description="[N, Hv, K, V] float32; null unless output_final_state")
    session_tokens: Optional[List[int]] = Field(
        None, description="with session_ids: the tokens each session has consumed after this request")


class ErrorInfo(BaseModel):
    reason: str = Field(..., description="machine-readable code, e.g. queue_full, no_gpu, body_too_large")
    message: str


class ErrorResponse(BaseModel):
    detail: ErrorInfo


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    ready: bool
    backend: str
    reason: str = Field(..., description="'ok', or why not: starting, no_gpu, wrong_compute_capability, "
                                         "kernels_unavailable, self_check_failed, self_check_error")
    message: str = ""


class SessionCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    ttl_s: Optional[float] = Field(None, gt=0, description="expire after this many idle seconds "
                                                           "(default: the server's --session-ttl-s)")


class SessionInfo(BaseModel):
    session_id: str
    tokens: int = Field(..., description="tokens consumed so far")
    ttl_s: Optional[float] = Field(None, description="idle seconds before the session expires; null = never")
    created_at: float = Field(..., description="Unix time")
    last_used: float = Field(..., description="Unix time of the last request that used it")
    head_config: Optional[dict] = Field(None, description="num_qk_heads, num_v_heads, head_dim_k, head_dim_v, "
                                                          "state_dtype; null until the first prefill")
    location: Literal["none", "pool", "disk"] = Field(..., description="where the state is: none yet, the "
                                                                       "device's state pool, or --state-dir")
