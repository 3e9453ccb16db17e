"""Roofline floor of one row: no implementation can run much faster than this.

    floor = max(FLOP / peak_flops, minimum_bytes / bandwidth)

with FLOP = 163,840 (fwd) or 491,520 (bwd) per token per v-head at K = V = 128 and chunk 64, and
minimum bytes per token per v-head = 520 + 512 / r (fwd) or 784 + 1024 / r (bwd), r = hv / hq (q and k
are shared by r v-heads): every input read and every output written once in bf16 (fp32 g and beta), no
intermediate traffic. The ceilings are measured ones (bf16 dense matrix product, device-to-device copy counting
bytes read plus bytes written), not datasheet peaks.
"""
from __future__ import annotations

from typing import Optional, Sequence

# bf16 dense FLOP/s and copy bandwidth in B/s, measured on one card of each kind.
CEILINGS = {"H200": (790e12, 4.3e12), "H100": (798e12, 3.0e12)}
FLOP_PER_TOKEN_HEAD = {"fwd": 163_840, "bwd": 491_520}


def bytes_per_token_head(pass_: str, hq: int, hv: int) -> float:
    r = hv / hq
    return (520 + 512 / r) if pass_ == "fwd" else (784 + 1024 / r)


def floor_ms(pass_: str, seqlens: Sequence[int], hq: int, hv: int, gpu: str = "H200") -> float:
    """The floor in milliseconds on ``gpu`` (a key of CEILINGS)."""
    peak_flops, bandwidth = CEILINGS[gpu]
    token_heads = sum(seqlens) * hv
    compute_s = FLOP_PER_TOKEN_HEAD[pass_] * token_heads / peak_flops
    memory_s = bytes_per_token_head(pass_, hq, hv) * token_heads / bandwidth
    return 1e3 * max(compute_s, memory_s)


def gpu_family(device_name: Optional[str]) -> Optional[str]:
    """'H200' / 'H100' from a torch.cuda.get_device_name() string, else None (no measured ceilings)."""
    for family in CEILINGS:
        if device_name and family in device_name:
            return family
    return None
