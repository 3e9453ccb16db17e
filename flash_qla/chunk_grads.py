"""The chunk-parallel half of the GDN backward: dq, dk, dbeta and dgamma from per-chunk states.

Once the forward recompute (gdn_bwd_recompute, save build) has stored every chunk's entering state S, W and Vnew,
and the reverse recurrence (gdn_bwd_dh) every chunk's leaving-state gradient dS', X = dL/dVnew and
dW = dL/dV, what remains is independent per (chunk, v-head). With Gamma_ij = exp(gamma_i - gamma_j)
(i >= j), eg = exp(gamma), et = exp(gamma_last - gamma), A the gate-free inverse and
Agb = Gamma * A * beta_col, the forward terms and their adjoints are
    O  = scale diag(eg) Q S          -> dQ += scale eg * (dO S^T)
    O += P Vnew, P = scale Gamma*QK^T -> dPs = scale Gamma * tril(dO Vnew^T); dQ += dPs K; dK += dPs^T Q
    Vnew = Agb W                      -> dAgb = tril(X W^T); dbeta_j += sum_i dAgb * Gamma * A
    A = (I + L)^-1                    -> dL = -strictLower(A^T dA A^T), dA = dAgb * Gamma * beta_col
    L = strictLower(diag(beta) K K^T) -> dbeta_i += sum_j dL * KK^T; dK += (beta dL) K + (beta dL)^T K
    W = V - diag(eg) K S              -> dK += -eg * (dW S^T)
    S' = eg_last S + K^T diag(et) Vnew -> dK += et * (Vnew dS'^T)
and dgamma collects every exp's derivative (row sums of the elementwise products above; gamma_last
takes the et and eg_last terms). dg (w.r.t. the raw g) is dgamma's reverse cumsum inside the chunk.
The factors that are exactly 1 (Gamma's diagonal, the last row's et) carry no gamma term and stay out of
dgamma: a + and a - of the same O(1) product, summed in two orders, cancel only up to rounding, which under
strong decay (dg ~1e-13) is an error far above dg itself. The fused kernel (gdn_bwd_chunk) does the same.

Tensors live in a chunk-slot layout [slots, H, 64, D] (rows past a sequence end are zero), computed in
float32 with batched GEMMs. This is the stage a fused TileLang kernel is meant to replace.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

CHUNK = 64


class SlotMap(NamedTuple):
    """Where each packed token sits in the chunk-slot layout: flat row = slot * 64 + row in chunk."""
    rows: torch.Tensor   # [T] int64
    slots: int           # slot count (an upper bound of the chunk count: ceil(T / 64) + N)


def token_positions(cu: torch.Tensor, tokens: int):
    """(sequence index, position inside its sequence) of every packed token, int64, on cu's device with no
    host synchronisation (output_size is known)."""
    lens = (cu[1:] - cu[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, output_size=tokens)
    return seq, torch.arange(tokens, device=cu.device) - cu[seq].long()


def slot_map(cu: torch.Tensor, chunk_offsets: torch.Tensor, tokens: int, slots: int) -> SlotMap:
    """Token -> slot row on the device."""
    seq, local = token_positions(cu, tokens)
    return SlotMap(chunk_offsets[seq].long() * CHUNK + local, slots)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half inputs; float64 stays float64 (the CPU tests run the math in float64)."""
    return torch.promote_types(x.dtype, torch.float32)


def to_slots(x: torch.Tensor, m: SlotMap) -> torch.Tensor:
    """[T, H, ...] -> [slots, H, 64, ...] in the compute dtype, zero where no token sits."""
    dtype = compute_dtype(x)
    out = x.new_zeros((m.slots * CHUNK,) + tuple(x.shape[1:]), dtype=dtype)
    out.index_copy_(0, m.rows, x.to(dtype))
    return out.unflatten(0, (m.slots, CHUNK)).transpose(1, 2)


def from_slots(x: torch.Tensor, m: SlotMap) -> torch.Tensor:
    """[slots, H, 64, ...] -> [T, H, ...]."""
    return x.transpose(1, 2).flatten(0, 1).index_select(0, m.rows)


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def chunk_gradients(q, k, do, w, vnew, x, dw, h, dh, A, beta, gamma, valid, scale: float):
    """All in slot layout, float32: q, k [S, Hv, 64, K] (GVA already expanded), do, w, vnew, x, dw
    [S, Hv, 64, V], h, dh [S, Hv, K, V], A [S, Hv, 64, 64], beta, gamma, valid [S, Hv, 64].
    Returns (dq, dk [S, Hv, 64, K], dbeta, dgamma [S, Hv, 64])."""
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    pair = causal & (valid[..., :, None] > 0) & (valid[..., None, :] > 0)
    last = (valid.sum(-1, keepdim=True).long() - 1).clamp(min=0)
    g_last = gamma.gather(-1, last)
    eg = torch.exp(gamma) * valid
    et = torch.exp(g_last - gamma) * valid
    decay = torch.exp(torch.where(pair, gamma[..., :, None] - gamma[..., None, :], float("-inf")))

    # state terms: O's diag(eg) Q S, W's diag(eg) K S, S' through et and eg_last
    dq = (scale * eg)[..., None] * (do @ _t(h))
    dgamma = (q * dq).sum(-1)
    dk_w = -eg[..., None] * (dw @ _t(h))
    dk_s = et[..., None] * (vnew @ _t(dh))
    dk = dk_w + dk_s
    # the last valid row's et is exp(0): no gamma term
    not_last = torch.arange(n, device=q.device) != last
    through_et = (k * dk_s).sum(-1) * not_last
    dgamma += (k * dk_w).sum(-1) - through_et
    d_last = through_et.sum(-1, keepdim=True) + torch.exp(g_last) * (dh * h).sum((-1, -2))[..., None]
    strict = pair & ~torch.eye(n, dtype=torch.bool, device=q.device)  # Gamma_ii = 1: no gamma term

    # P = scale * Gamma * tril(Q K^T)
    dps = scale * decay * (do @ _t(vnew))
    through_p = dps * (q @ _t(k)) * strict
    dgamma += through_p.sum(-1) - through_p.sum(-2)
    dq += dps @ k
    dk += _t(dps) @ q

    # Agb = Gamma * A * beta_col and the inverse
    gated = decay * A
    dagb = (x @ _t(w)) * pair
    through_agb = dagb * gated * beta[..., None, :] * strict
    dgamma += through_agb.sum(-1) - through_agb.sum(-2)
    dbeta = (dagb * gated).sum(-2)
    dA = dagb * decay * beta[..., None, :]
    dL = -(_t(A) @ dA @ _t(A)) * strict
    dbeta += (dL * (k @ _t(k))).sum(-1)
    dLb = beta[..., :, None] * dL
    dk += dLb @ k + _t(dLb) @ k

    dgamma.scatter_add_(-1, last, d_last)
    return dq, dk, dbeta, dgamma * valid


def reverse_chunk_cumsum(dgamma: torch.Tensor) -> torch.Tensor:
    """d/dg_t = sum of d/dgamma_i over i >= t in the chunk (gamma is the chunk-local cumsum of g)."""
    return dgamma.flip(-1).cumsum(-1).flip(-1)
