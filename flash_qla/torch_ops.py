"""The kernel path as torch.library custom ops, so torch.compile treats it as one opaque, differentiable op.

`flash_qla::chunk_gdr_fwd` and `flash_qla::chunk_gdr_bwd` wrap flash_qla.kernel_api.run_forward and run_backward with
fake (meta) implementations for tracing and an autograd formula; the public API routes through them only while
torch.compile is tracing (`torch.compiler.is_compiling()`), so eager calls keep the direct path and its lower
host cost. Outputs that do not exist (no final state, no initial state) are empty tensors here, as custom ops
cannot return None.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import kernel_api as ops
from .validation import validate_inputs


def _num_seqs(q: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


@torch.library.custom_op("flash_qla::chunk_gdr_fwd", mutates_args=())
def chunk_gdr_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                  output_final_state: bool, use_qk_l2norm: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    problem = validate_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    o, ht, _, _ = ops.run_forward(problem, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                                  use_qk_l2norm)
    return o, (ht if output_final_state else o.new_empty(0))


@chunk_gdr_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm):
    o = q.new_empty(*v.shape)
    if not output_final_state:
        return o, o.new_empty(0)
    return o, q.new_empty(_num_seqs(q, cu_seqlens), v.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)


@torch.library.custom_op("flash_qla::chunk_gdr_bwd", mutates_args=())
def chunk_gdr_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                  use_qk_l2norm: bool, do: torch.Tensor, dht: Optional[torch.Tensor]
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    problem = validate_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    dq, dk, dv, dg, dbeta, dh0 = ops.run_backward(problem, q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm,
                                                  do, dht)
    return dq, dk, dv, dg, dbeta, (dh0 if dh0 is not None else q.new_empty(0, dtype=torch.float32))


@chunk_gdr_bwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, do, dht):
    dh0 = torch.empty_like(initial_state) if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.scale, ctx.use_qk_l2norm, ctx.output_final_state = scale, use_qk_l2norm, output_final_state


def _backward(ctx, do, dht):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    use_dht = ctx.output_final_state and dht is not None and dht.numel() > 0
    dq, dk, dv, dg, dbeta, dh0 = chunk_gdr_bwd(q, k, v, g, beta, initial_state, cu_seqlens, ctx.scale,
                                               ctx.use_qk_l2norm, do, dht if use_dht else None)
    return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None), None, None, None, None


chunk_gdr_fwd.register_autograd(_backward, setup_context=_setup_context)


def chunk_gated_delta_rule(problem, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                           use_qk_l2norm_in_kernel):
    """The public API's kernel path while torch.compile traces: (o, final_state or None)."""
    o, ht = chunk_gdr_fwd(q, k, v, g, beta, initial_state, cu_seqlens, float(problem.scale), output_final_state,
                          use_qk_l2norm_in_kernel)
    return o, (ht if output_final_state else None)
