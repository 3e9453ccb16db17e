"""Intra-card CP's per-chunk bounds for the fused pre-pass, without gdn_prepare: per (chunk slot, v-head) the chunk's
summed g (gamma at its last row) and its largest beta_i |k_i|^2 (3 for a negative beta, -1 for a slot of no rows),
the two inputs of gdn_cp_plan's warm-up walk (flash_qla/cp.py).

gdn_prepare writes these beside Agb / P; the fused CP path (gdn_fwd_fused's "state" / "trans" pre-pass and out pass
over the segments) needs only them, so this kernel reads k, g and beta and nothing else: one CTA per (chunk slot, q / k
head) measures the chunk's k rows once for the GVA group's v-heads. FLA's activations (gate_mode, gate_act.py) are
applied as gdn_prepare applies them. With use_qk_l2norm_in_kernel a row's |k|^2 is that of the normalised row,
|k|^2 / (|k|^2 + eps). Only gamma's last row of each chunk slot is written (the walk reads no other).
"""
import tilelang.language as T

from .common import L2NORM_EPS, last_at_most
from .gate_act import BETA_SIGMOID, GATE, beta_act, gate_log

C = 64
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128]}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
THREADS = 128   # two threads a row: each sums half of the row's squares
PASS_CONFIGS = {}


def build(dtype: str, K: int):
    dt = DTYPES[dtype]
    HALF = K // 2
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    TC = T.dynamic("TC")  # chunk slots x 64

    @T.prim_func
    def gdn_cp_scan(
        k: T.Tensor((NT, Hq, K), dt),
        g: T.Tensor((NT, Hv), "float32"),
        beta: T.Tensor((NT, Hv), "float32"),
        A_log: T.Tensor((Hv,), "float32"),
        dt_bias: T.Tensor((Hv,), "float32"),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        gam_t: T.Tensor((Hv, TC), "float32"),
        bkk_max: T.Tensor((Hv, TC // C), "float32"),
        l2norm: T.int32,
        gate_mode: T.int32,
    ):
        # grid x: an upper bound of the chunk slots (ceil(T / 64) + N; extra CTAs write their -1 and exit)
        with T.Kernel(T.ceildiv(NT, C) + N, Hq, threads=THREADS) as (bc, hk):
            kv = T.alloc_local((HALF,), dt)
            acc = T.alloc_local((1,), "float32")
            gb = T.alloc_local((2,), "float32")
            red = T.alloc_local((2,), "float32")
            seq = T.alloc_local((2,), "int32")
            nrm_s = T.alloc_shared((C,), "float32")
            g_s = T.alloc_shared((C,), "float32")
            b_s = T.alloc_shared((C,), "float32")
            tid = T.get_thread_binding()
            row = tid // 2
            ratio = Hv // Hq
            seq[1] = N
            last_at_most(chunk_offsets, bc, seq)
            if bc < chunk_offsets[N]:
                t0 = cu_seqlens[seq[0]] + (bc - chunk_offsets[seq[0]]) * C
                valid = T.min(cu_seqlens[seq[0] + 1] - t0, C)
                acc[0] = 0.0
                if row < valid:  # every 16-byte load of the half row issued before the sums
                    for j in T.unroll(HALF // 8):
                        for u in T.vectorized(8):
                            kv[j * 8 + u] = k[t0 + row, hk, tid % 2 * HALF + j * 8 + u]
                    for u in T.unroll(HALF):
                        acc[0] += T.cast(kv[u], "float32") * T.cast(kv[u], "float32")
                acc[0] += T.shfl_xor(acc[0], 1)
                if tid % 2 == 0:
                    nrm_s[row] = T.if_then_else(l2norm != 0, acc[0] / (acc[0] + L2NORM_EPS), acc[0])
                for hj in T.serial(ratio):
                    h = hk * ratio + hj
                    T.sync_threads()  # the previous head's reads of g_s / b_s are done (and nrm_s is written)
                    if tid < C:
                        gb[0] = T.if_then_else(tid < valid, g[t0 + tid, h], 0.0)
                        gb[1] = T.if_then_else(tid < valid, beta[t0 + tid, h], 0.0)
                        if (gate_mode & GATE) != 0 and tid < valid:
                            gb[0] = gate_log(gb[0], A_log[h], dt_bias[h], gate_mode)
                        if (gate_mode & BETA_SIGMOID) != 0 and tid < valid:
                            gb[1] = beta_act(gb[1], gate_mode)
                        g_s[tid] = gb[0]
                        b_s[tid] = T.if_then_else(tid < valid, T.if_then_else(gb[1] < 0, 3.0, gb[1] * nrm_s[tid]),
                                                  -1.0)
                    T.sync_threads()
                    if tid < 32:  # one warp: two rows a lane
                        red[0] = T.warp_reduce_sum(g_s[tid] + g_s[tid + 32])
                        red[1] = T.warp_reduce_max(T.max(b_s[tid], b_s[tid + 32]))
                        if tid == 0:
                            gam_t[h, bc * C + C - 1] = red[0]
                            bkk_max[h, bc] = red[1]
            elif tid < Hv // Hq:  # a slot past the last chunk: no rows
                bkk_max[hk * (Hv // Hq) + tid, bc] = -1.0
                gam_t[hk * (Hv // Hq) + tid, bc * C + C - 1] = 0.0

    return gdn_cp_scan
