"""Time forward-kernel families on representative rows (CUDA-graph medians), for kernel experiments."""
import sys

import torch

from flash_qla import ops
from flash_qla.bench.timing import graph_median_ms
from flash_qla.validation import validate_inputs

ROWS = {"TP1 4096x8": (16, 64, [4096] * 8), "TP8 1x32768": (2, 8, [32768]), "TP2 1x8192": (8, 32, [8192]),
        "TP8 4096x8": (2, 8, [4096] * 8), "TP8 1x8192": (2, 8, [8192]), "TP2 1x32768": (8, 32, [32768]),
        "2B 4096x8": (16, 16, [4096] * 8), "TP8 1x2048": (2, 8, [2048])}


def inputs(hq, hv, lengths):
    """q, k, v, g, beta, cu_seqlens, h0 drawn as ../shared/bench/inputs.md (K = V = 128, bf16)."""
    T = sum(lengths)
    q = torch.nn.functional.normalize(torch.randn(1, T, hq, 128, device="cuda"), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, hq, 128, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(1, T, hv, 128, device="cuda").bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, hv, device="cuda")) / 16
    beta = torch.rand(1, T, hv, device="cuda")
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32, device="cuda")
    return q, k, v, g, beta, cu, torch.randn(len(lengths), hv, 128, 128, device="cuda")


def graph_ms(fn) -> float:
    """CUDA-graph median per call (flash_qla.bench.timing, the benchmark's own method)."""
    ms, why = graph_median_ms(fn, torch.device("cuda"))
    if ms is None:
        raise RuntimeError(why)
    return ms


def main(families):
    """families: output-pass kernels (gdn_fwd_st after gdn_prepare, or gdn_fwd_fused alone), each at every built V
    block for K = V = 128 bf16, CP off."""
    from flash_qla import cp, loader
    cp.FORCE_SEGMENT_CHUNKS = 0
    for name, (hq, hv, lengths) in ROWS.items():
        q, k, v, g, beta, cu, h0 = inputs(hq, hv, lengths)
        p = validate_inputs(q, k, v, g, beta, None, h0, cu)
        out = []
        for fam in families:
            blocks = sorted({b["BV"] for b in loader.library().variants(fam)
                             if (b["dtype"], b["K"], b["V"], b.get("mode", "out")) == ("bf16", 128, 128, "out")})
            for bv in blocks:
                ops.USE_FUSED = fam == ops.FUSED_KERNEL
                if not ops.USE_FUSED:
                    ops.OUT_KERNEL = fam
                ops.FORCE_BLOCK_V = bv
                ms = graph_ms(lambda: ops.forward(p, q, k, v, g, beta, h0, True, cu, False))
                out.append(f"{fam}/BV{bv} {ms:.3f}")
        print(f"{name:14s}", "  ".join(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
