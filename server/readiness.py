"""The /ready probe: is the backend able to answer correctly right now?

* kernels: an sm_90 GPU is present, the precompiled kernels load, and a tiny launch matches the reference.
* reference: the library's chunked path matches the token-by-token recurrence on a tiny problem.
The reasons are stable, machine-readable codes (see :class:`ReadyState`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

import flash_qla
from flash_qla.reference import recurrent_gated_delta_rule, relative_l2

log = logging.getLogger("server.readiness")

# (qkv dtype, tolerance): bf16 inputs are rounded, so the kernels are held to the peers' bf16 bar.
_KERNEL_CHECK = (torch.bfloat16, 2e-2)
_REFERENCE_CHECK = (torch.float32, 1e-5)
PREFERRED_CHECK_HEAD_DIMS = (128, 128)  # (K, V) of the self-check when built; else the smallest built pair


@dataclass(frozen=True)
class ReadyState:
    ready: bool
    reason: str      # ok | starting | no_gpu | wrong_compute_capability | kernels_unavailable |
                     # self_check_failed | self_check_error
    message: str = ""


STARTING = ReadyState(False, "starting", "the readiness self-check has not finished yet")


def tiny_problem(dtype: torch.dtype, head_dims, device: str = "cpu", seed: int = 0):
    """Two packed sequences (one crossing a 64-token chunk boundary), GVA 1 -> 2 heads, an initial state."""
    gen = torch.Generator().manual_seed(seed)
    (lengths, Hq, Hv), (K, V) = ((70, 9), 1, 2), head_dims
    T = sum(lengths)
    q = torch.nn.functional.normalize(torch.randn(T, Hq, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, Hq, K, generator=gen), dim=-1)
    v = torch.randn(T, Hv, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(T, Hv, generator=gen))
    beta = torch.rand(T, Hv, generator=gen)
    h0 = 0.1 * torch.randn(len(lengths), Hv, K, V, generator=gen)
    cu = torch.tensor([0, lengths[0], T], dtype=torch.int32)
    qkv = [x.to(dtype)[None].to(device) for x in (q, k, v)]
    return qkv + [g[None].to(device), beta[None].to(device), h0.to(device), cu.to(device)]


def _self_check(backend: str, device: str, dtype: torch.dtype, tolerance: float, head_dims) -> ReadyState:
    q, k, v, g, beta, h0, cu = tiny_problem(dtype, head_dims, device)
    with torch.inference_mode():
        o, final = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                    cu_seqlens=cu, backend=backend)
        ref = [x.cpu() for x in (q, k, v, g, beta, h0)]
        o_ref, final_ref = recurrent_gated_delta_rule(*ref[:5], initial_state=ref[5], output_final_state=True,
                                                      cu_seqlens=cu.cpu())
    errors = {"o": relative_l2(o.cpu().float(), o_ref.float()),
              "final_state": relative_l2(final.cpu().float(), final_ref.float())}
    worst = max(errors.values())
    if not worst < tolerance:  # also catches NaN
        return ReadyState(False, "self_check_failed",
                          f"tiny {backend} launch differs from the reference: relative L2 {errors} "
                          f"(tolerance {tolerance})")
    return ReadyState(True, "ok", f"tiny {backend} launch matched the reference (relative L2 {worst:.2e})")


def probe(backend: str) -> ReadyState:
    """Run the checks for ``backend`` (blocking: call it on a worker thread)."""
    try:
        if backend == "reference":
            return _self_check("reference", "cpu", *_REFERENCE_CHECK, head_dims=(16, 16))
        if not torch.cuda.is_available():
            return ReadyState(False, "no_gpu", "no CUDA GPU is visible to this process "
                                               "(start with --backend reference to serve the CPU reference)")
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) != (9, 0):
            return ReadyState(False, "wrong_compute_capability",
                              f"the kernels are built for sm_90a; {torch.cuda.get_device_name()} is "
                              f"compute capability {major}.{minor}")
        try:
            from flash_qla import kernel_api
            built = kernel_api.supported_head_dims()  # loads the precompiled kernel library
        except Exception as error:  # noqa: BLE001 - any load failure means not ready, with its text
            return ReadyState(False, "kernels_unavailable", f"the precompiled kernels failed to load: "
                                                            f"{type(error).__name__}: {error}")
        if not built:
            return ReadyState(False, "kernels_unavailable", "the kernel library holds no forward kernels")
        head_dims = PREFERRED_CHECK_HEAD_DIMS if PREFERRED_CHECK_HEAD_DIMS in built else min(built)
        return _self_check("kernels", "cuda", *_KERNEL_CHECK, head_dims=head_dims)
    except Exception as error:  # noqa: BLE001 - the probe reports, it never crashes the server
        log.exception("readiness self-check failed")
        return ReadyState(False, "self_check_error", f"{type(error).__name__}: {error}")
