"""Public API, drop-in for FlashQLA's and FLA's ``chunk_gated_delta_rule``.

Backends:
* ``"reference"``: the pure-PyTorch chunked form (:mod:`flash_qla.reference`) on any device, computing in
  float32 (float64 for float64 inputs). Slow; it exists for CPUs, tests and checking.
* ``"kernels"``: the precompiled sm_90a kernels (CUDA tensors on a compute-capability 9.0 GPU).
* ``"auto"`` (default): CPU tensors run the reference; CUDA tensors on sm_90 run the kernels; any other
  device is an error that says which backend to ask for. There is never a silent fallback.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import reference
from .validation import Problem, validate_inputs

BACKENDS = ("auto", "kernels", "reference")
_CAPABILITY: dict = {}


def select_backend(device: torch.device, backend: str) -> str:
    """Resolve ``backend`` for tensors on ``device``; raise a clear error where nothing fits."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return "reference"
    if device.type == "cpu":
        if backend == "kernels":
            raise ValueError("backend='kernels' needs CUDA tensors on an sm_90 GPU; the inputs are on the CPU "
                             "(use backend='reference' or 'auto')")
        return "reference"
    if device.type != "cuda":
        raise ValueError(f"flash_qla runs on CUDA (sm_90) or CPU tensors, got device {device}; "
                         f"pass backend='reference' to run the pure-PyTorch path there")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:  # torch's query costs ~20 us per call; a device's capability never changes
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    major, minor = _CAPABILITY[index]
    if (major, minor) != (9, 0):
        raise RuntimeError(f"the kernels are built for sm_90a, found sm_{major}{minor} on {device}; "
                           f"pass backend='reference' to run the pure-PyTorch path there")
    return "kernels"


def _kernel_ops():
    from . import ops  # imported lazily: CPU-only users never touch the loader
    return ops


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, scale: Optional[float] = None,
                           initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                           cu_seqlens: Optional[torch.Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
                           backend: str = "auto") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated DeltaNet chunked prefill, differentiable in q, k, v, g, beta and initial_state.

    Shapes: q, k [B, T, Hq, K]; v [B, T, Hv, V]; g (natural-log decay, <= 0), beta [B, T, Hv];
    initial_state [N, Hv, K, V]; cu_seqlens [N+1] int32/int64 with B == 1 for packed sequences.
    Hv must be a multiple of Hq (v-head h reads q/k head h // (Hv // Hq)). scale defaults to K**-0.5.
    Returns (o [B, T, Hv, V] in v's dtype, final_state [N, Hv, K, V] float32 or None).
    """
    problem = validate_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if select_backend(q.device, backend) == "kernels":
        if torch.compiler.is_compiling():  # one opaque custom op for torch.compile (flash_qla.torch_ops)
            from . import torch_ops
            return torch_ops.chunk_gated_delta_rule(problem, q, k, v, g, beta, initial_state, output_final_state,
                                                    cu_seqlens, use_qk_l2norm_in_kernel)
        return _kernel_ops().chunk_gated_delta_rule(problem, q, k, v, g, beta, initial_state, output_final_state,
                                                    cu_seqlens, use_qk_l2norm_in_kernel)
    return reference.chunked_gated_delta_rule(q, k, v, g, beta, problem.scale, initial_state, output_final_state,
                                              _host(cu_seqlens), use_qk_l2norm_in_kernel)


def _host(cu_seqlens: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if cu_seqlens is None else cu_seqlens.cpu()


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, backend="auto"):
    """Forward only, FlashQLA's low-level signature.

    Returns ``(g_cumsum, A, o, h, final_state)``: the chunk-local cumulative g (float32), the gate-free
    inverse A [B, T, Hv, 64] in k's dtype (what the backward consumes), o, ``h = None`` (chunk states are
    never materialised here) and the final state (or None).
    """
    problem = validate_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if select_backend(q.device, backend) == "kernels":
        return _kernel_ops().chunk_gated_delta_rule_fwd(problem, q, k, v, g, beta, initial_state,
                                                        output_final_state, cu_seqlens, use_qk_l2norm_in_kernel)
    cu = _host(cu_seqlens)
    with torch.no_grad():
        g_cumsum = reference.chunk_local_cumsum(g, cu)
        A = reference.gate_free_inverse(k, beta, cu, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                        num_v_heads=problem.num_v_heads)
        o, final = reference.chunked_gated_delta_rule(q, k, v, g, beta, problem.scale, initial_state,
                                                      output_final_state, cu, use_qk_l2norm_in_kernel)
    return g_cumsum, A, o, None, final


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, A, do, dht=None, scale=None, initial_state=None,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, backend="auto"):
    """Backward only, FlashQLA's low-level signature.

    ``g`` is the chunk-local cumsum returned by :func:`chunk_gated_delta_rule_fwd` and ``A`` its gate-free
    inverse, which the kernels read instead of solving it again (None: solved; the reference recomputes it).
    Returns ``(dq, dk, dv, dbeta, dg, dh0)`` with dg taken with respect to the raw g and dh0 None when there is no
    initial state.
    """
    problem = validate_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if tuple(do.shape) != tuple(v.shape):
        raise ValueError(f"do must have v's shape {tuple(v.shape)} [B, T, Hv, V], got {tuple(do.shape)}")
    expected_state = (problem.num_seqs, problem.num_v_heads, problem.head_dim_k, problem.head_dim_v)
    if dht is not None and tuple(dht.shape) != expected_state:
        raise ValueError(f"dht must have shape [N, Hv, K, V] = {expected_state}, got {tuple(dht.shape)}")
    if A is not None:
        _check_gate_free_inverse(A, q, problem)
    if select_backend(q.device, backend) == "kernels":
        return _kernel_ops().chunk_gated_delta_rule_bwd(problem, q, k, v, g, beta, A, do, dht, initial_state,
                                                        cu_seqlens, use_qk_l2norm_in_kernel)
    return _reference_bwd(problem, q, k, v, g, beta, do, dht, initial_state, _host(cu_seqlens),
                          use_qk_l2norm_in_kernel)


def _check_gate_free_inverse(A, q, problem) -> None:
    """A must be chunk_gated_delta_rule_fwd's gate-free inverse for these inputs: [B, T, Hv, 64] in q's dtype, on
    q's device (the kernels read it in place of solving it again)."""
    want = (problem.batch, problem.tokens, problem.num_v_heads, 64)
    if not isinstance(A, torch.Tensor):
        raise TypeError("A must be a tensor (chunk_gated_delta_rule_fwd's gate-free inverse) or None, got "
                        f"{type(A).__name__}")
    if tuple(A.shape) != want:
        raise ValueError(f"A must have shape [B, T, Hv, 64] = {want} (chunk_gated_delta_rule_fwd's gate-free "
                         f"inverse), got {tuple(A.shape)}")
    if A.dtype != q.dtype:
        raise ValueError(f"A must have q's dtype {q.dtype}, got {A.dtype}")
    if A.device != q.device:
        raise ValueError(f"A must be on q's device {q.device}, got {A.device}")


def _reference_bwd(problem: Problem, q, k, v, g_cumsum, beta, do, dht, initial_state, cu, l2norm):
    """Gradients by autograd through the reference (A is recomputed, not read)."""
    g_raw = reference.chunk_local_diff(g_cumsum, cu)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g_raw, beta)]
    h0 = initial_state.detach().requires_grad_(True) if initial_state is not None else None
    with torch.enable_grad():
        o, final = reference.chunked_gated_delta_rule(*leaves, problem.scale, h0, dht is not None, cu, l2norm)
        outputs, grads = [o], [do]
        if dht is not None:
            outputs.append(final)
            grads.append(dht.to(final.dtype))
        inputs = leaves + ([h0] if h0 is not None else [])
        got = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
    got = [torch.zeros_like(x) if d is None else d for x, d in zip(inputs, got)]
    dq, dk, dv, dg, db = got[:5]
    return dq, dk, dv, db, dg, (got[5] if h0 is not None else None)
