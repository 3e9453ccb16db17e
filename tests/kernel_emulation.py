"""Float64 stand-ins for the backward's chain kernels, for CPU tests of the backward's math and plumbing.

`emulate_chains` does, in plain torch and in the kernels' layouts, what gdn_prepare + gdn_bwd_recompute
(save build) and gdn_bwd_dh compute on the GPU: it returns the recompute dict and (dv, x, dhs, dh0) that
flash_qla.backward._chunk_parallel consumes. The GPU tests check the real kernels end to end.
"""
import torch

from flash_qla.chunk_grads import CHUNK, from_slots, slot_map, to_slots
from flash_qla.reference import gate_free_inverse_chunks


def emulate_chains(q, k, v, g, beta, h0, cu, scale, do, dht):
    """q, k [T, Hq, K]; v, do [T, Hv, V]; g, beta [T, Hv]; h0, dht [N, Hv, K, V] or None; cu int64 [N+1]."""
    T, Hq, K = q.shape
    Hv, V = v.shape[1:]
    N = cu.numel() - 1
    lens = (cu[1:] - cu[:-1]).tolist()
    chunks = [-(-n // CHUNK) for n in lens]
    offsets = torch.tensor([0] + list(torch.tensor(chunks).cumsum(0).tolist()), dtype=torch.int64)
    slots = -(-T // CHUNK) + N
    m = slot_map(cu, offsets, T, slots)
    ratio = Hv // Hq
    qs = to_slots(q, m).repeat_interleave(ratio, 1)
    ks = to_slots(k, m).repeat_interleave(ratio, 1)
    vs, dos = to_slots(v, m), to_slots(do, m)
    bs = to_slots(beta, m)
    valid = to_slots(torch.ones(T, 1, dtype=q.dtype), m).expand(slots, Hv, CHUNK)
    gamma = to_slots(g, m).cumsum(-1)  # zero padding keeps gamma at the last valid value, as the kernel
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
    pair = causal & (valid[..., :, None] > 0) & (valid[..., None, :] > 0)
    decay = torch.exp(torch.where(pair, gamma[..., :, None] - gamma[..., None, :], float("-inf")))
    A = gate_free_inverse_chunks(ks, bs) * valid[..., :, None]
    agb = decay * A * bs[..., None, :]
    P = scale * decay * (qs @ ks.transpose(-1, -2))
    eg = torch.exp(gamma)
    last = (valid.sum(-1, keepdim=True).long() - 1).clamp(min=0)
    eg_last = torch.exp(gamma.gather(-1, last))[..., None]           # [S, Hv, 1, 1]
    et = torch.exp(gamma.gather(-1, last) - gamma) * valid
    hs = torch.zeros(slots, Hv, K, V, dtype=q.dtype)
    dhs = torch.zeros_like(hs)
    W, Vn, X, dW = (torch.zeros_like(vs) for _ in range(4))
    dh0 = torch.zeros(N, Hv, K, V, dtype=q.dtype)
    for n in range(N):
        S = h0[n].clone() if h0 is not None else hs.new_zeros(Hv, K, V)
        for c in range(chunks[n]):
            s = int(offsets[n]) + c
            hs[s] = S
            W[s] = vs[s] - eg[s][..., None] * (ks[s] @ S)
            Vn[s] = agb[s] @ W[s]
            S = eg_last[s] * S + ks[s].transpose(-1, -2) @ (et[s][..., None] * Vn[s])
        dS = dht[n].clone() if dht is not None else hs.new_zeros(Hv, K, V)
        for c in reversed(range(chunks[n])):
            s = int(offsets[n]) + c
            dhs[s] = dS
            X[s] = P[s].transpose(-1, -2) @ dos[s] + et[s][..., None] * (ks[s] @ dS)
            dW[s] = agb[s].transpose(-1, -2) @ X[s]
            dS = (eg_last[s] * dS + qs[s].transpose(-1, -2) @ (scale * eg[s][..., None] * dos[s])
                  - ks[s].transpose(-1, -2) @ (eg[s][..., None] * dW[s]))
        dh0[n] = dS
    saved = dict(q=q, k=k, beta=beta, w=from_slots(W, m), vnew=from_slots(Vn, m), hs=hs, A=from_slots(A, m),
                 gam_t=gamma.transpose(0, 1).reshape(Hv, slots * CHUNK), TC=slots * CHUNK, cu=cu, offsets=offsets)
    return saved, from_slots(dW, m), from_slots(X, m), dhs, dh0
