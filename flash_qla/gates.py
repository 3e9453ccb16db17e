"""The gate and beta activations that FLA can fuse into its GDN kernels, as differentiable torch ops.

* ``use_gate_in_kernel``: ``g`` is the raw gate input and the log-decay is
  ``g_log = -exp(A_log) * softplus(g + dt_bias)`` (A_log, dt_bias: one value per v-head), FLA's
  ``naive_gdn_gate``. softplus uses torch's threshold 20 (x > 20 gives x), as FLA's kernel does.
* ``use_beta_sigmoid_in_kernel``: ``beta`` holds logits and the kernels use ``sigmoid(beta)``, or
  ``2 * sigmoid(beta)`` (beta in [0, 2): negative eigenvalues of I - beta k k^T) with ``allow_neg_eigval``.

NOT YET NATIVE IN THE KERNELS: both run here as one elementwise torch pass over [B, T, Hv] before the
kernel call (autograd gives d raw g, dA_log, ddt_bias and d raw beta). The kernels' gate / beta loads
are where they belong; this module is then the specification those fused loads are tested against.
The results are computed in float32 (float64 for float64 inputs), as FLA computes them.
"""
from __future__ import annotations

from typing import Optional

import torch

SOFTPLUS_THRESHOLD = 20.0  # FLA's softplus (and torch's default): x > 20 returns x


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


__all__ = ["SOFTPLUS_THRESHOLD", "check_head_vector", "compute_dtype", "gdn_gate", "beta_from_logits"]
