"""Benchmark inputs: seeded draws, in the order and dtypes the peer libraries' benchmark uses.

The draws go call for call as the peers' input maker does (same seed, same order, same dtypes), so on the same
device our rows time the very tensors the peers are timed on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .matrix import BenchRow

SEED = 0


@dataclass
class BenchInputs:
    """One row's tensors: q, k [1, T, Hq, D] bf16; v, do [1, T, Hv, D] bf16; g, beta [1, T, Hv] fp32;
    h0, dht [N, Hv, D, D] fp32; cu_seqlens [N + 1] int32."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    h0: torch.Tensor
    do: torch.Tensor
    dht: torch.Tensor
    cu_seqlens: torch.Tensor
    scale: float


def l2normalize(x: torch.Tensor) -> torch.Tensor:
    """Normalise in fp32 and round back, as the peers' benchmark does."""
    x32 = x.float()
    return (x32 / x32.norm(dim=-1, keepdim=True).clamp_min(1e-6)).to(x.dtype)


def draw_inputs(row: BenchRow, device: str = "cuda", seed: Optional[int] = SEED) -> BenchInputs:
    """Draw one row's inputs on ``device`` (seeded, so every library sees the same data)."""
    if seed is not None:
        torch.manual_seed(seed)
    seqlens, hq, hv, dim = list(row.seqlens), row.hq, row.hv, row.head_dim
    tokens = sum(seqlens)
    offsets = [0] + torch.tensor(seqlens).cumsum(0).tolist()
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
    q = l2normalize(torch.randn(1, tokens, hq, dim, device=device, dtype=torch.bfloat16))
    k = l2normalize(torch.randn(1, tokens, hq, dim, device=device, dtype=torch.bfloat16))
    v = torch.randn(1, tokens, hv, dim, device=device, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(1, tokens, hv, device=device)) / 16
    beta = torch.randn(1, tokens, hv, device=device).sigmoid()
    # A random quarter of the v-heads never decay (g = 0): FlashQLA's benchmark does this, and it
    # matters because gate-driven scheduling can treat those heads differently.
    decaying = torch.zeros(hv, dtype=torch.bool, device=device)
    decaying[: math.ceil(0.75 * hv)] = True
    g[:, :, ~decaying[torch.randperm(hv, device=device)]] = 0.0
    h0 = torch.randn(len(seqlens), hv, dim, dim, device=device)
    do = torch.randn_like(v)
    dht = torch.randn(len(seqlens), hv, dim, dim, device=device) / 8
    return BenchInputs(q=q, k=k, v=v, g=g, beta=beta, h0=h0, do=do, dht=dht, cu_seqlens=cu_seqlens,
                       scale=dim ** -0.5)
