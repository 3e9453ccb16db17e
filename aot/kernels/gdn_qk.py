"""P = scale * Gamma * tril(Q K^T) per chunk and v-head, with Q K^T computed once per GVA group.

All Hv / Hq v-heads of a group read the same q/k head, so one CTA per (chunk, q/k head) forms Q K^T once
(one 64 x 64 x K wgmma) and writes P for each v-head of the group with that head's decay
Gamma_ij = exp(gamma_i - gamma_j), i >= j (gamma from gdn_prepare's chunk-aligned tiles).
Rows past the sequence end are not written (the forward never reads them into a valid row).
"""
import tilelang.language as T

C = 64
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128]}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
THREADS = 128
LOG2E = 1.4426950408889634


def build(dtype: str, K: int):
    dt = DTYPES[dtype]
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    TC = T.dynamic("TC")

    @T.prim_func
    def gdn_qk(
        q: T.Tensor((NT, Hq, K), dt),
        k: T.Tensor((NT, Hq, K), dt),
        gam_t: T.Tensor((Hv, TC), "float32"),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        p: T.Tensor((NT, Hv, C), dt),
        scale: T.float32,
    ):
        with T.Kernel(T.ceildiv(NT, C) + N, Hq, threads=THREADS) as (bc, hk):
            q_s = T.alloc_shared((C, K), dt)
            k_s = T.alloc_shared((C, K), dt)
            gam = T.alloc_shared((C,), "float32")
            p_s = T.alloc_shared((C, C), dt)
            qk = T.alloc_fragment((C, C), "float32")
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            t0 = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            ratio = T.alloc_var("int32")
            lo = 0
            hi = N
            for _ in T.serial(32):
                if lo < hi:
                    mid = (lo + hi + 1) // 2
                    if chunk_offsets[mid] <= bc:
                        lo = mid
                    else:
                        hi = mid - 1
            if bc < chunk_offsets[N]:
                t0 = cu_seqlens[lo] + (bc - chunk_offsets[lo]) * C
                eos = cu_seqlens[lo + 1]
                ratio = Hv // Hq
                valid = T.min(eos - t0, C)
                T.copy(q[t0:t0 + C, hk, :], q_s)
                T.copy(k[t0:t0 + C, hk, :], k_s)
                T.gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
                for r in T.serial(ratio):
                    h = hk * ratio + r
                    T.copy(gam_t[h, bc * C:bc * C + C], gam)
                    for i, j in T.Parallel(C, C):
                        p_s[i, j] = T.if_then_else(
                            i >= j, T.cast(qk[i, j] * T.exp2((gam[i] - gam[j]) * LOG2E) * scale, dt), T.cast(0, dt))
                    # stored from shared memory along rows (vectorised), not in the scattered MMA layout
                    for i, j in T.Parallel(C, C):
                        if i < valid:
                            p[t0 + i, h, j] = p_s[i, j]

    return gdn_qk
