"""What one request may cost, checked when it is admitted: before the launch allocates anything for it.

* head dims: the kernels backend takes the (K, V) pairs that were built (and their dtypes); the reference backend
  takes K, V <= :data:`~server.config.REFERENCE_MAX_HEAD_DIM` (422 naming q or v);
* memory: an estimate of every buffer the request makes the service hold (decoded inputs and their merged and
  device copies, outputs, initial and final states, the backend's workspace, the encoded answer) against
  ``--max-request-mb`` (413 ``request_memory`` with the estimate). The batcher holds a merged launch to the same
  budget.
"""
from __future__ import annotations

from dataclasses import dataclass

from flash_qla.validation import Problem, validate_kernel_inputs

from .codec import JSON
from .config import REFERENCE_MAX_HEAD_DIM
from .errors import InputError, LimitExceeded
from .prefill import PrefillRequest

CHUNK = 64
# A JSON answer holds each output number as a Python float in a list (32 bytes) and then as text (<= 24 bytes).
JSON_BYTES_PER_NUMBER = 56


@dataclass(frozen=True)
class MemoryEstimate:
    inputs: int
    outputs: int
    states: int
    workspace: int
    response: int

    @property
    def total(self) -> int:
        return self.inputs + self.outputs + self.states + self.workspace + self.response

    def describe(self) -> str:
        mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
        return (f"{mib(self.total)} MiB (inputs {mib(self.inputs)}, outputs {mib(self.outputs)}, states "
                f"{mib(self.states)}, workspace {mib(self.workspace)}, encoded answer {mib(self.response)})")


def estimate_memory(request: PrefillRequest, backend: str, encoding: str) -> MemoryEstimate:
    key = request.key
    T, N, Hq, Hv, K, V = (request.num_tokens, request.num_seqs, key.num_qk_heads, key.num_v_heads,
                          key.head_dim_k, key.head_dim_v)
    elt = request.q.element_size()
    state_elt = 8 if request.q.dtype.itemsize == 8 else 4
    host = sum(t.nbytes for t in (request.q, request.k, request.v, request.g, request.beta, request.cu_seqlens))
    if request.initial_state is not None:
        host += request.initial_state.nbytes
    copies = 3 if backend == "kernels" else 2           # decoded, merged (page-locked for a GPU), on the device
    state_bytes = N * Hv * K * V * state_elt
    states = state_bytes * (3 if request.output_final_state else 2)   # initial and final (and a host copy)
    o_bytes = T * Hv * V * elt
    if backend == "kernels":   # the split path's per-chunk intermediates (A, P) and per-token w / u rows
        workspace = 4 * T * Hv * (2 * CHUNK + K + V)
    else:                      # float32 upcasts, GVA-expanded q / k, chunk matrices, W, a working state
        workspace = 4 * T * (2 * Hq * K + Hv * (2 * K + 3 * V + 3 * CHUNK)) + N * Hv * K * V * 4
    answer_numbers = T * Hv * V + (N * Hv * K * V if request.output_final_state else 0)
    if encoding == JSON:
        response = answer_numbers * JSON_BYTES_PER_NUMBER
    else:
        response = o_bytes + (state_bytes if request.output_final_state else 0)
    return MemoryEstimate(host * copies, 2 * o_bytes, states, workspace, response)


def check_memory(request: PrefillRequest, backend: str, encoding: str, limit_bytes: int) -> MemoryEstimate:
    estimate = estimate_memory(request, backend, encoding)
    if estimate.total > limit_bytes:
        raise LimitExceeded(f"this request would need about {estimate.describe()}, over the server's limit of "
                            f"{limit_bytes / 2**20:.1f} MiB (--max-request-mb); send fewer tokens or sequences"
                            + (", or use safetensors instead of JSON" if encoding == JSON else ""),
                            reason="request_memory")
    return estimate


def check_head_dims(request: PrefillRequest, backend: str, kernel_head_dims=None) -> None:
    """422 for head configurations the backend does not run."""
    key = request.key
    if backend == "reference":
        for field, name, dim in (("q", "K", key.head_dim_k), ("v", "V", key.head_dim_v)):
            if dim > REFERENCE_MAX_HEAD_DIM:
                raise InputError(field, f"head dim {name} = {dim} exceeds the reference backend's limit of "
                                        f"{REFERENCE_MAX_HEAD_DIM}")
        return
    problem = Problem(1, request.num_tokens, key.num_qk_heads, key.num_v_heads, key.head_dim_k, key.head_dim_v,
                      request.num_seqs, key.scale, True)
    try:
        validate_kernel_inputs(problem, request.q, request.g, request.beta, request.initial_state,
                               kernel_head_dims or set())
    except (ValueError, TypeError) as error:
        raise InputError.from_api_error(error) from error

