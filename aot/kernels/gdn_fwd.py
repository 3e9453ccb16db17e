"""Fused GDN forward: one CTA per (sequence, v-head, V-block) walks its sequence's 64-token chunks.

Per chunk, with the state S (K x BV, fp32, in registers), gamma the chunk-local cumsum of g and A the
gate-free inverse from gdn_prepare:
    A_gb = Gamma * A * beta_col                      (gate re-applied elementwise, i >= j only)
    W    = V - diag(exp(gamma)) K S
    Vnew = A_gb W                                     (one C x C x BV product)
    O    = scale * (diag(exp(gamma)) Q S + (Gamma * Q K^T) Vnew)
    S    = exp(gamma_last) S + K^T diag(exp(gamma_last - gamma)) Vnew
Rows past the sequence end are masked wherever they could contribute (A rows, the causal masks, the
decayed Vnew), the chunk-end decay is the last valid row's gamma, and their outputs are never stored.
q, k, v and A tiles arrive by TMA in a 2-stage software pipeline (TileLang warp-specialises the loop:
a producer warpgroup prefetches chunk c+1 while the consumers compute chunk c).
"""
import tilelang.language as T

C = 64
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128], "V": [64, 128, 256], "BV": [32, 64]}
# BV: the V columns one CTA owns (flash_qla/planner.py trades chain count against chain cost). BV = 128
# was built and measured on the H200: its chains took ~2x BV = 64's, so it never paid and is not built.
VARIANT_RULE = "BV <= V"
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
THREADS = 256
STAGES = 2
LOG2E = 1.4426950408889634


def build(dtype: str, K: int, V: int, BV: int):
    dt = DTYPES[dtype]
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    TC = T.dynamic("TC")  # chunk slots x 64 of gdn_prepare's chunk-aligned gamma/beta

    @T.prim_func
    def gdn_fwd(
        q: T.Tensor((NT, Hq, K), dt),
        k: T.Tensor((NT, Hq, K), dt),
        v: T.Tensor((NT, Hv, V), dt),
        g_cumsum_t: T.Tensor((Hv, TC), "float32"),
        beta_t: T.Tensor((Hv, TC), "float32"),
        A: T.Tensor((NT, Hv, C), dt),
        h0: T.Tensor((N, Hv, K, V), "float32"),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        o: T.Tensor((NT, Hv, V), dt),
        ht: T.Tensor((N, Hv, K, V), "float32"),
        scale: T.float32,
        use_h0: T.int32,
        store_ht: T.int32,
    ):
        with T.Kernel(V // BV, Hv, N, threads=THREADS) as (bv, h, n):
            q_s = T.alloc_shared((C, K), dt)
            k_s = T.alloc_shared((C, K), dt)
            v_s = T.alloc_shared((C, BV), dt)
            a_s = T.alloc_shared((C, C), dt)
            agb_s = T.alloc_shared((C, C), dt)
            p_s = T.alloc_shared((C, C), dt)
            s_s = T.alloc_shared((K, BV), dt)
            w_s = T.alloc_shared((C, BV), dt)
            vn_s = T.alloc_shared((C, BV), dt)
            vd_s = T.alloc_shared((C, BV), dt)
            g_s = T.alloc_shared((C,), "float32")
            b_s = T.alloc_shared((C,), "float32")
            S = T.alloc_fragment((K, BV), "float32")
            ks = T.alloc_fragment((C, BV), "float32")
            qs = T.alloc_fragment((C, BV), "float32")
            vn = T.alloc_fragment((C, BV), "float32")
            p = T.alloc_fragment((C, C), "float32")

            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            slot0 = T.alloc_var("int32")
            bos = cu_seqlens[n]          # held in registers: an inlined global read would repeat per chunk
            eos = cu_seqlens[n + 1]
            slot0 = chunk_offsets[n] * C
            hk = h // (Hv // Hq)
            v0 = bv * BV
            if use_h0 != 0:
                T.copy(h0[n, h, :, v0:v0 + BV], S)
            else:
                T.clear(S)
            for c in T.Pipelined(T.ceildiv(eos - bos, C), num_stages=STAGES):
                t0 = bos + c * C
                # Rows past the sequence end hold the next sequence's tokens (or TMA's zero fill past T).
                # Every tile, g and beta included, goes through the pipelined copies (consumer-written
                # single buffers race with the prefetch); padded rows are masked where they are used.
                T.copy(q[t0:t0 + C, hk, :], q_s)
                T.copy(k[t0:t0 + C, hk, :], k_s)
                T.copy(v[t0:t0 + C, h, v0:v0 + BV], v_s)
                T.copy(A[t0:t0 + C, h, :], a_s)
                T.copy(g_cumsum_t[h, slot0 + c * C:slot0 + c * C + C], g_s)
                T.copy(beta_t[h, slot0 + c * C:slot0 + c * C + C], b_s)
                valid = T.min(eos - t0, C)
                g_last = g_s[valid - 1]
                T.copy(S, s_s)
                for i, j in T.Parallel(C, C):
                    agb_s[i, j] = T.if_then_else(
                        (i >= j) and (i < valid),
                        T.cast(T.cast(a_s[i, j], "float32") * T.exp2((g_s[i] - g_s[j]) * LOG2E) * b_s[j], dt),
                        T.cast(0, dt))
                T.gemm(k_s, s_s, ks, clear_accum=True)
                T.gemm(q_s, s_s, qs, clear_accum=True)
                T.gemm(q_s, k_s, p, transpose_B=True, clear_accum=True)
                for i, d in T.Parallel(C, BV):
                    # padded rows zeroed: their gamma may be uninitialised, and 0 * NaN in Vnew = A_gb W is NaN
                    w_s[i, d] = T.if_then_else(
                        i < valid, T.cast(T.cast(v_s[i, d], "float32") - T.exp2(g_s[i] * LOG2E) * ks[i, d], dt),
                        T.cast(0, dt))
                for i, j in T.Parallel(C, C):
                    p_s[i, j] = T.if_then_else((i >= j) and (i < valid), T.cast(p[i, j] * T.exp2((g_s[i] - g_s[j]) * LOG2E) * scale, dt),
                                               T.cast(0, dt))
                T.gemm(agb_s, w_s, vn, clear_accum=True)
                for i, d in T.Parallel(C, BV):
                    vn_s[i, d] = T.cast(vn[i, d], dt)
                    vd_s[i, d] = T.if_then_else(i < valid, T.cast(vn[i, d] * T.exp2((g_last - g_s[i]) * LOG2E), dt),
                                                T.cast(0, dt))
                    qs[i, d] = qs[i, d] * scale * T.exp2(g_s[i] * LOG2E)
                T.gemm(p_s, vn_s, qs)
                for i, d in T.Parallel(C, BV):
                    if i < valid:
                        o[t0 + i, h, v0 + d] = T.cast(qs[i, d], dt)
                for kk, d in T.Parallel(K, BV):
                    S[kk, d] = S[kk, d] * T.exp2(g_last * LOG2E)
                T.gemm(k_s, vd_s, S, transpose_A=True)
            if store_ht != 0:
                T.copy(S, ht[n, h, :, v0:v0 + BV])

    return gdn_fwd
