"""Pure-PyTorch Gated DeltaNet: the executable specification the kernels are checked against.

Two independent formulations of the same operator, per sequence n and v-head h with a state
S in R^{K x V}:

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T (scale * q_t)

* :func:`recurrent_gated_delta_rule` runs that token loop literally.
* :func:`chunked_gated_delta_rule` uses the chunked form the kernels compute (chunk 64 by default):
  a gate-free unit-lower-triangular inverse A = (I + strictLower(diag(beta) K K^T))^-1, the gate
  re-applied elementwise (Gamma * A, only exp(gamma_i - gamma_j) with i >= j, so nothing overflows),
  and one C x C x V product per chunk on W = V - diag(exp(gamma)) K S.

Both accept packed varlen batches (``cu_seqlens`` with B == 1), GVA (Hv a multiple of Hq; v-head h
reads q/k head h // (Hv / Hq)), an optional initial state and q/k l2-normalisation, and compute in
float32 (float64 for float64 inputs, or whatever ``compute_dtype`` says). Every operation is a
differentiable torch op, so autograd through them is the reference backward.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as FLA and FlashQLA define it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def sequence_bounds(batch: int, tokens: int, cu_seqlens: Optional[torch.Tensor]) -> List[Tuple[int, int, int]]:
    """(batch index, start, end) of every sequence: B dense rows, or the packed cu_seqlens spans."""
    if cu_seqlens is None:
        return [(b, 0, tokens) for b in range(batch)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _compute_dtype(x: torch.Tensor, compute_dtype: Optional[torch.dtype]) -> torch.dtype:
    if compute_dtype is not None:
        return compute_dtype
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, compute_dtype):
    """Upcast, normalise, expand GVA heads; return everything the per-sequence loops need."""
    dt = _compute_dtype(q, compute_dtype)
    B, T, Hq, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    q, k = q.to(dt), k.to(dt)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    ratio = Hv // Hq
    if ratio > 1:  # v-head h reads q/k head h // ratio
        q = q.repeat_interleave(ratio, dim=2)
        k = k.repeat_interleave(ratio, dim=2)
    scale = K ** -0.5 if scale is None else float(scale)
    seqs = sequence_bounds(B, T, cu_seqlens)
    if initial_state is None:
        h0 = [q.new_zeros(Hv, K, V) for _ in seqs]
    else:
        h0 = [initial_state[i].to(dt) for i in range(len(seqs))]
    return q, k, v.to(dt), g.to(dt), beta.to(dt), scale, seqs, h0


def _assemble(o_parts, v, B, T, seqs, states, output_final_state):
    """Stitch per-sequence outputs back into [B, T, Hv, V] (v's dtype) and stack final states."""
    rows = [[] for _ in range(B)]
    for (b, _, _), part in zip(seqs, o_parts):
        rows[b].append(part)
    o = torch.stack([torch.cat(r, dim=0) if r else v.new_zeros(0, *v.shape[2:]) for r in rows])
    if o.shape[1] != T:  # packed batch whose cu_seqlens[-1] < T cannot happen after validation
        raise AssertionError("sequence spans do not cover the tokens")
    o = o.to(v.dtype)
    final = torch.stack(states) if output_final_state else None
    return o, final


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, compute_dtype=None):
    """Token-by-token GDN recurrence. Shapes as in :func:`flash_qla.chunk_gated_delta_rule`."""
    B, T = q.shape[:2]
    qc, kc, vc, gc, bc, scale, seqs, h0 = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                                   use_qk_l2norm_in_kernel, compute_dtype)
    o_parts, states = [], []
    for (b, start, end), S in zip(seqs, h0):
        outs = []
        for t in range(start, end):
            S = torch.exp(gc[b, t])[:, None, None] * S
            resid = bc[b, t][:, None] * (vc[b, t] - torch.einsum("hk,hkv->hv", kc[b, t], S))
            S = S + kc[b, t][:, :, None] * resid[:, None, :]
            outs.append(torch.einsum("hk,hkv->hv", qc[b, t] * scale, S))
        o_parts.append(torch.stack(outs) if outs else vc.new_zeros(0, *vc.shape[2:]))
        states.append(S)
    return _assemble(o_parts, v, B, T, seqs, states, output_final_state)


def _pad_to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Zero-pad dim 0 to a multiple of ``chunk``; zero g/beta/k/v rows contribute nothing."""
    pad = (-x.shape[0]) % chunk
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros(pad, *x.shape[1:])], dim=0)


def _chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[L, H, ...] -> [H, NT, chunk, ...]."""
    x = _pad_to_chunks(x, chunk)
    x = x.reshape(x.shape[0] // chunk, chunk, *x.shape[1:])
    return x.movedim(2, 0)


def gate_free_inverse_chunks(k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """A = (I + strictLower(diag(beta) K K^T))^-1 per chunk; k [..., C, K], beta [..., C]."""
    C = k.shape[-2]
    strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    lower = (beta[..., :, None] * (k @ k.transpose(-1, -2))).masked_fill(~strict, 0.0)
    eye = torch.eye(C, dtype=k.dtype, device=k.device).expand_as(lower)
    return torch.linalg.solve_triangular(eye + lower, eye, upper=False, unitriangular=True)


def _decay_matrix(gamma: torch.Tensor) -> torch.Tensor:
    """Gamma_ij = exp(gamma_i - gamma_j) for i >= j, else 0 (masked before exp: no overflow)."""
    C = gamma.shape[-1]
    keep = torch.ones(C, C, dtype=torch.bool, device=gamma.device).tril()
    diff = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~keep, float("-inf"))
    return torch.exp(diff)


def chunked_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                             cu_seqlens=None, use_qk_l2norm_in_kernel=False, compute_dtype=None,
                             chunk_size=CHUNK_SIZE):
    """Chunked GDN with the gate-free inverse, as the kernels compute it."""
    B, T = q.shape[:2]
    qc, kc, vc, gc, bc, scale, seqs, h0 = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                                   use_qk_l2norm_in_kernel, compute_dtype)
    o_parts, states = [], []
    for (b, start, end), S in zip(seqs, h0):
        L = end - start
        if L == 0:
            o_parts.append(vc.new_zeros(0, *vc.shape[2:]))
            states.append(S)
            continue
        qn, kn, vn = (_chunks(x[b, start:end], chunk_size) for x in (qc, kc, vc))
        gn, bn = (_chunks(x[b, start:end], chunk_size) for x in (gc, bc))
        gamma = gn.cumsum(dim=-1)                                  # [H, NT, C]
        decay = _decay_matrix(gamma)                               # [H, NT, C, C]
        a_gb = decay * gate_free_inverse_chunks(kn, bn) * bn[..., None, :]
        qk = (qn @ kn.transpose(-1, -2)) * decay
        outs = []
        for c in range(gamma.shape[1]):
            e_g = torch.exp(gamma[:, c])[..., None]                # [H, C, 1]
            w = vn[:, c] - e_g * (kn[:, c] @ S)
            v_new = a_gb[:, c] @ w
            outs.append(scale * (e_g * (qn[:, c] @ S) + qk[:, c] @ v_new))
            g_last = gamma[:, c, -1]
            tail = torch.exp(g_last[:, None] - gamma[:, c])[..., None]
            S = torch.exp(g_last)[:, None, None] * S + kn[:, c].transpose(-1, -2) @ (tail * v_new)
        o_seq = torch.stack(outs, dim=1).reshape(vc.shape[2], -1, vc.shape[3])[:, :L]
        o_parts.append(o_seq.movedim(0, 1))
        states.append(S)
    return _assemble(o_parts, v, B, T, seqs, states, output_final_state)


def chunk_local_cumsum(g: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                       chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Cumulative sum of g restarted at every chunk of every sequence (fp32, or g's float64)."""
    out = torch.empty_like(g, dtype=_compute_dtype(g, None))
    for b, start, end in sequence_bounds(g.shape[0], g.shape[1], cu_seqlens):
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
            out[b, c0:c1] = g[b, c0:c1].to(out.dtype).cumsum(dim=0)
    return out


def chunk_local_diff(g_cumsum: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                     chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Inverse of :func:`chunk_local_cumsum`: recover the raw per-token g."""
    out = g_cumsum.clone()
    for b, start, end in sequence_bounds(g_cumsum.shape[0], g_cumsum.shape[1], cu_seqlens):
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
            out[b, c0 + 1:c1] = g_cumsum[b, c0 + 1:c1] - g_cumsum[b, c0:c1 - 1]
    return out


def gate_free_inverse(k: torch.Tensor, beta: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                      chunk_size: int = CHUNK_SIZE, use_qk_l2norm_in_kernel: bool = False,
                      num_v_heads: Optional[int] = None) -> torch.Tensor:
    """The per-chunk gate-free inverse laid out [B, T, Hv, chunk] (row t holds A[t mod chunk, :]).

    This is the tensor FlashQLA's forward returns as ``A`` and its backward consumes.
    """
    B, T, Hq, _ = k.shape
    Hv = num_v_heads or beta.shape[2]
    dt = _compute_dtype(k, None)
    kc = k.to(dt)
    if use_qk_l2norm_in_kernel:
        kc = l2norm(kc)
    kc = kc.repeat_interleave(Hv // Hq, dim=2)
    out = torch.zeros(B, T, Hv, chunk_size, dtype=k.dtype, device=k.device)
    for b, start, end in sequence_bounds(B, T, cu_seqlens):
        if end == start:
            continue
        a = gate_free_inverse_chunks(_chunks(kc[b, start:end], chunk_size),
                                     _chunks(beta[b, start:end].to(dt), chunk_size))  # [H, NT, C, C]
        a = a.movedim(0, 2).reshape(-1, Hv, chunk_size)[: end - start]
        out[b, start:end] = a.to(k.dtype)
    return out


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_2 / ||expected||_2 in float64: the peers' accuracy metric."""
    diff = (actual.double() - expected.double()).norm()
    return float(diff) / max(float(expected.double().norm()), 1e-30)


__all__ = [
    "CHUNK_SIZE", "L2NORM_EPS", "l2norm", "sequence_bounds", "recurrent_gated_delta_rule",
    "chunked_gated_delta_rule", "chunk_local_cumsum", "chunk_local_diff", "gate_free_inverse",
    "gate_free_inverse_chunks", "relative_l2",
]
