"""The gate and beta activations that FLA can fuse into its GDN kernels: their specification as differentiable torch
ops, and the mode the kernels take to apply them themselves.

* ``use_gate_in_kernel``: ``g`` is the raw gate input and the log-decay is
  ``g_log = -exp(A_log) * softplus(g + dt_bias)`` (A_log, dt_bias: one value per v-head), FLA's
  ``naive_gdn_gate``. softplus uses torch's threshold 20 (x > 20 gives x), as FLA's kernel does.
* ``use_beta_sigmoid_in_kernel``: ``beta`` holds logits and the kernels use ``sigmoid(beta)``, or
  ``2 * sigmoid(beta)`` (beta in [0, 2): negative eigenvalues of I - beta k k^T) with ``allow_neg_eigval``.

On the kernel path both are fused (:class:`KernelGate`, bits of ``gate_mode``, aot/kernels/gate_act.py): gdn_prepare
and gdn_fwd_fused activate g / beta where they load them (before gamma's cumsum and intra-card CP's bound, which then
sees beta in (0, 2)); the backward's recompute does the same and stores the activated beta, gdn_bwd_chunk runs its
plain build, and gdn_gate_bwd turns its dg / dbeta into d raw g and d raw b in place and sums dA_log and dt_bias's
gradient per head in a fixed order (deterministic: no float atomics). gdn_prepare
and gdn_fwd_fused serve every mode from one build (a CTA-uniform branch, no variants added). The kernels read g as
float32: a bf16 / fp16 raw g takes one conversion pass before the call.
The functions below run for the CPU reference, torch.compile and the multi-GPU path, and are what the fused kernels
are tested against. They compute in float32 (float64 for float64 inputs), as FLA does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SOFTPLUS_THRESHOLD = 20.0  # FLA's softplus (and torch's default): x > 20 returns x

# gate_mode bits of the kernels (aot/kernels/gate_act.py holds the same values)
GATE = 1           # g is the raw gate: g_log = -exp(A_log) * softplus(g + dt_bias)
GATE_BIAS = 2      # dt_bias given
BETA_SIGMOID = 4   # beta holds logits: sigmoid(beta)
NEG_EIGVAL = 8     # 2 * sigmoid(beta)


@dataclass(frozen=True)
class KernelGate:
    """The activations the kernels apply: ``mode`` (the bits above) and the per-head parameters as the kernels read
    them (float32, contiguous [Hv]; None where absent)."""
    mode: int = 0
    A_log: Optional[torch.Tensor] = None
    dt_bias: Optional[torch.Tensor] = None

    @property
    def gate(self) -> bool:
        return bool(self.mode & GATE)

    def pointers(self, stand_in: torch.Tensor) -> dict:
        """The kernels' A_log / dt_bias pointers; stand_in (any input of the call) where a parameter is absent (the
        kernels do not read it then)."""
        a = self.A_log if self.A_log is not None else stand_in
        return {"A_log": a.data_ptr(), "dt_bias": (self.dt_bias if self.dt_bias is not None else a).data_ptr()}


NO_GATE = KernelGate()


def kernel_gate(use_gate_in_kernel: bool, A_log, dt_bias, use_beta_sigmoid_in_kernel: bool,
                allow_neg_eigval: bool) -> KernelGate:
    """The KernelGate of the API's keywords (already checked: check_head_vector, validation.check_keywords)."""
    mode = ((GATE | (GATE_BIAS if dt_bias is not None else 0) if use_gate_in_kernel else 0)
            | (BETA_SIGMOID | (NEG_EIGVAL if allow_neg_eigval else 0) if use_beta_sigmoid_in_kernel else 0))
    if not use_gate_in_kernel:
        return KernelGate(mode)
    return KernelGate(mode, head_vector(A_log), head_vector(dt_bias) if dt_bias is not None else None)


def head_vector(x: torch.Tensor) -> torch.Tensor:
    """A per-head parameter as the kernels read it: float32, contiguous [Hv] (the same tensor when it already is)."""
    if x.dim() == 1 and x.dtype == torch.float32 and x.is_contiguous():
        return x
    return x.reshape(-1).to(torch.float32).contiguous()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (the reference checks), everything else computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_head_vector(name: str, x, num_v_heads: int, device: torch.device) -> None:
    """A_log / dt_bias: a floating tensor of Hv elements on the inputs' device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of Hv = {num_v_heads} elements, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {str(x.dtype).replace('torch.', '')}")
    if x.numel() != num_v_heads:
        raise ValueError(f"{name} must have Hv = {num_v_heads} elements (one per v-head), got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on the inputs' device {device}, got {x.device}")


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """-exp(A_log) * softplus(g + dt_bias): the log-space decay from the raw gate g [..., Hv]."""
    dt = compute_dtype(g)
    x = g.to(dt)
    if dt_bias is not None:
        x = x + dt_bias.reshape(-1).to(dt)
    return -torch.exp(A_log.reshape(-1).to(dt)) * torch.nn.functional.softplus(x, threshold=SOFTPLUS_THRESHOLD)


def beta_from_logits(b: torch.Tensor, allow_neg_eigval: bool = False) -> torch.Tensor:
    """sigmoid(b), or 2 * sigmoid(b) with allow_neg_eigval."""
    beta = torch.sigmoid(b.to(compute_dtype(b)))
    return beta * 2.0 if allow_neg_eigval else beta


__all__ = ["SOFTPLUS_THRESHOLD", "GATE", "GATE_BIAS", "BETA_SIGMOID", "NEG_EIGVAL", "KernelGate", "NO_GATE",
           "kernel_gate", "head_vector", "check_head_vector", "compute_dtype", "gdn_gate", "beta_from_logits"]
