"""The sm_90a kernel path behind the public API: packing, launches, the torch custom op.

Every call is turned into one packed varlen problem (a dense batch B x T becomes B sequences of T
tokens), then two launches on the caller's stream:
  gdn_prepare  chunk-local cumsum of g and the gate-free inverse A, per (chunk, v-head),
  gdn_fwd      the fused recurrence, per (sequence, v-head, V-block).
Nothing is read back to the host: chunk offsets are computed on the device, so a call can be captured
in a CUDA graph.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from . import loader
from .planner import plan_block_v
from .reference import l2norm
from .validation import Problem, validate_kernel_inputs

CHUNK = 64
FWD_KERNEL = "gdn_fwd"  # the fused forward family in the manifest
FORCE_BLOCK_V: Optional[int] = None  # tests pin a V block to cover every built variant
_SMS: dict = {}
# Debug switch for tests: fill every output with NaN before the launch, so unwritten elements show.
POISON_OUTPUTS = os.environ.get("FLASH_QLA_POISON_OUTPUTS") == "1"
_DTYPE_TAG = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def supported_head_dims() -> set:
    return {(v["K"], v["V"]) for v in loader.library().variants(FWD_KERNEL)}


def _block_v(problem: Problem, tag: str, device: torch.device) -> int:
    if FORCE_BLOCK_V is not None:
        return FORCE_BLOCK_V
    built = [v["BV"] for v in loader.library().variants(FWD_KERNEL)
             if (v["dtype"], v["K"], v["V"]) == (tag, problem.head_dim_k, problem.head_dim_v)]
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return plan_block_v(problem.num_seqs, problem.num_v_heads, problem.head_dim_v, built, _SMS[device.index])


def _packed(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> contiguous [B*T, ...] (a view when already contiguous)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def _offsets(problem: Problem, cu_seqlens: Optional[torch.Tensor], device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens int32, chunk_offsets int32) on the device; no host synchronisation."""
    if cu_seqlens is None:
        cu = torch.arange(0, problem.batch + 1, device=device, dtype=torch.int32) * problem.tokens
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
    chunks = torch.div(cu[1:] - cu[:-1] + (CHUNK - 1), CHUNK, rounding_mode="floor")
    offsets = torch.zeros_like(cu)
    torch.cumsum(chunks, 0, out=offsets[1:])
    return cu, offsets


def _empty(*shape, device, dtype) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), device=device, dtype=dtype)
    return torch.empty(*shape, device=device, dtype=dtype)


def _launch(name: str, variant: dict, device: torch.device, sizes: dict, pointers: dict) -> None:
    kernel = loader.library().kernel(name, **variant)
    stream = torch.cuda.current_stream(device).cuda_stream
    kernel.launch(device.index, stream, sizes, pointers)


def forward(problem: Problem, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
    """Returns (o [B,T,Hv,V], final_state [N,Hv,K,V] or an empty tensor, (gamma in chunk slots [Hv, slots*64],
    cu_seqlens, chunk_offsets), A [B,T,Hv,64])."""
    validate_kernel_inputs(problem, q, g, beta, initial_state, supported_head_dims())
    dev = q.device
    dt = q.dtype
    if use_qk_l2norm:  # TODO(issue 4): fuse into the kernels; a separate pass today
        q, k = l2norm(q.float()).to(dt), l2norm(k.float()).to(dt)
    T = problem.batch * problem.tokens
    Hv, K, V, N = problem.num_v_heads, problem.head_dim_k, problem.head_dim_v, problem.num_seqs
    qp, kp, vp = _packed(q), _packed(k), _packed(v)
    gp = _packed(g)
    bp = _packed(beta.float())
    cu, offsets = _offsets(problem, cu_seqlens, dev)
    A = _empty(T, Hv, CHUNK, device=dev, dtype=dt)
    # head-major and chunk-aligned: chunk slot s of the packed batch owns [s * 64, s * 64 + 64), so every
    # tile starts 256-byte aligned (slots: an upper bound of the chunk count, as gdn_prepare's grid)
    TC = (-(-T // CHUNK) + N) * CHUNK
    g_cumsum_t = _empty(Hv, TC, device=dev, dtype=torch.float32)
    beta_t = _empty(Hv, TC, device=dev, dtype=torch.float32)
    o = _empty(T, Hv, V, device=dev, dtype=dt)
    ht = _empty(N, Hv, K, V, device=dev, dtype=torch.float32) if output_final_state else A.new_empty(0)
    h0 = initial_state.contiguous() if initial_state is not None else None
    sizes = {"T": T, "TC": TC, "Hq": problem.num_qk_heads, "Hv": Hv, "N": N}
    tag = _DTYPE_TAG[dt]
    _launch("gdn_prepare", {"dtype": tag, "K": K}, dev, sizes,
            {"k": kp.data_ptr(), "g": gp.data_ptr(), "beta": bp.data_ptr(), "cu_seqlens": cu.data_ptr(),
             "chunk_offsets": offsets.data_ptr(), "A": A.data_ptr(), "g_cumsum_t": g_cumsum_t.data_ptr(),
             "beta_t": beta_t.data_ptr()})
    _launch(FWD_KERNEL, {"dtype": tag, "K": K, "V": V, "BV": _block_v(problem, tag, dev)}, dev,
            dict(sizes, scale=problem.scale, use_h0=int(h0 is not None), store_ht=int(output_final_state)),
            {"q": qp.data_ptr(), "k": kp.data_ptr(), "v": vp.data_ptr(), "g_cumsum_t": g_cumsum_t.data_ptr(),
             "beta_t": beta_t.data_ptr(), "A": A.data_ptr(),
             "h0": (h0 if h0 is not None else ht).data_ptr(), "cu_seqlens": cu.data_ptr(),
             "chunk_offsets": offsets.data_ptr(),
             "o": o.data_ptr(), "ht": ht.data_ptr()})
    shape = (problem.batch, problem.tokens)
    return o.view(*shape, Hv, V), ht, (g_cumsum_t, cu, offsets), A.view(*shape, Hv, CHUNK)


def tokens_from_chunk_slots(slots: torch.Tensor, cu: torch.Tensor, offsets: torch.Tensor, shape) -> torch.Tensor:
    """[Hv, slots*64] chunk-aligned values -> [B, T, Hv] token order, on the device without a host sync."""
    T = shape[0] * shape[1]
    lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, output_size=T)
    pos = offsets[seq].long() * CHUNK + torch.arange(T, device=cu.device) - cu[seq].long()
    return slots[:, pos].t().unflatten(0, shape)


class _ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, problem, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
        o, ht, _, _ = forward(problem, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                              use_qk_l2norm)
        return o, (ht if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        raise NotImplementedError(
            "the sm_90a backward kernels are not part of this build yet; call chunk_gated_delta_rule with "
            "backend='reference' to differentiate (slow), or run the forward under torch.no_grad()")


def chunk_gated_delta_rule(problem, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                           use_qk_l2norm_in_kernel):
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    if needs_grad:
        return _ChunkGatedDeltaRule.apply(problem, q, k, v, g, beta, initial_state, output_final_state,
                                          cu_seqlens, use_qk_l2norm_in_kernel)
    o, ht, _, _ = forward(problem, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                          use_qk_l2norm_in_kernel)
    return o, (ht if output_final_state else None)


def chunk_gated_delta_rule_fwd(problem, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                               use_qk_l2norm_in_kernel):
    o, ht, (g_slots, cu, offsets), A = forward(problem, q, k, v, g, beta, initial_state, output_final_state,
                                               cu_seqlens, use_qk_l2norm_in_kernel)
    g_cumsum = tokens_from_chunk_slots(g_slots, cu, offsets, (problem.batch, problem.tokens))
    return g_cumsum, A, o, None, (ht if output_final_state else None)


def chunk_gated_delta_rule_bwd(*args, **kwargs):
    raise NotImplementedError("the sm_90a backward kernels are not part of this build yet; "
                              "use backend='reference' for chunk_gated_delta_rule_bwd")
