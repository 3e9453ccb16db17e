"""Everything of the GDN forward that depends on neither V nor the state, once per (chunk, v-head).

Per 64-token chunk with gamma the chunk-local cumsum of g, Gamma_ij = exp(gamma_i - gamma_j) (i >= j):
  A    = (I + strictLower(diag(beta) K K^T))^-1, the gate-free inverse (FlashQLA's A; stored on request),
  Agb  = Gamma * A * beta_col                       (the gate re-applied elementwise: never overflows),
  eg   = exp(gamma_i), et = exp(gamma_last - gamma_i) (0 past the sequence end), and gamma itself
(P = scale * Gamma * tril(Q K^T) is gdn_qk's, which shares Q K^T across a GVA group).
The recurrence kernel (gdn_fwd) then keeps only the state-dependent chain. One CTA of 128 threads (one
warpgroup) per (chunk, v-head); chunks are numbered across the packed batch (chunk_offsets[n] = first chunk of
sequence n, a device-side cumsum of ceil(len / 64)), nothing is read on the host.
Layouts: Agb, A are [T, Hv, 64] (rows of each chunk); eg, et, gamma live head-major in 256-byte-aligned
64-slot tiles per chunk, [Hv, chunk slot * 64 + row], so the forward streams each as one TMA tile.

The inverse is blocked, its products on tensor cores (fp16 operands as FlashInfer's inverse uses, fp32
accumulation; a tf32 mma.sync build measured slower on the H200): with M = I + L and D the
inverses of M's four 16 x 16 diagonal blocks (forward substitution, one thread per column, 16 rows deep),
M = blockdiag(M) (I + N) with N = D (M - blockdiag(M)) strictly block-lower, so N^4 = 0 and
    A = M^-1 = (I - N (I - N (I - N))) D            (Horner: four 64 x 64 x 64 products).
"""
import tilelang.language as T

C = 64
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128]}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
THREADS = 128  # one warpgroup: the 64 x 64 products run on wgmma
B = 16         # diagonal block of the substitution
LOG2E = 1.4426950408889634


def build(dtype: str, K: int):
    dt = DTYPES[dtype]
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    TC = T.dynamic("TC")  # chunk slots x 64

    @T.prim_func
    def gdn_prepare(
        k: T.Tensor((NT, Hq, K), dt),
        g: T.Tensor((NT, Hv), "float32"),
        beta: T.Tensor((NT, Hv), "float32"),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        A: T.Tensor((NT, Hv, C), dt),
        agb: T.Tensor((NT, Hv, C), dt),
        eg_t: T.Tensor((Hv, TC), "float32"),
        et_t: T.Tensor((Hv, TC), "float32"),
        gam_t: T.Tensor((Hv, TC), "float32"),
        write_a: T.int32,
    ):
        # grid x covers an upper bound of the chunk count (ceil(T / 64) + N); extra CTAs exit
        with T.Kernel(T.ceildiv(NT, C) + N, Hv, threads=THREADS) as (bc, h):
            k_s = T.alloc_shared((C, K), dt)
            kk = T.alloc_fragment((C, C), "float32")
            acc = T.alloc_fragment((C, C), "float32")
            m_s = T.alloc_shared((C, C), "float32")    # L (fp32: the substitution reads it), later A
            d_s = T.alloc_shared((C, C), "float16")    # D, the diagonal blocks' inverses
            o_s = T.alloc_shared((C, C), "float16")    # L off the diagonal blocks
            n_s = T.alloc_shared((C, C), "float16")    # N = D L_off
            r_s = T.alloc_shared((C, C), "float16")    # the Horner term
            b_s = T.alloc_shared((C,), "float32")
            gam = T.alloc_shared((C,), "float32")
            col = T.alloc_local((B,), "float32")
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            t0 = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            hk = T.alloc_var("int32")
            run = T.alloc_var("float32")

            # sequence of this chunk: largest n with chunk_offsets[n] <= bc (binary search, 32 steps max)
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
                hk = h // (Hv // Hq)  # in a register: inlined, the division repeats per loaded element
                valid = T.min(eos - t0, C)
                # Unmasked k tile: rows past the sequence end (the next sequence's, or zero past T) only
                # reach rows >= valid of K K^T, L and A, which are never stored nor read by valid rows.
                T.copy(k[t0:t0 + C, hk, :], k_s)
                for i in T.Parallel(C):
                    b_s[i] = T.if_then_else(i < valid, beta[t0 + i, h], 0.0)
                    gam[i] = T.if_then_else(i < valid, g[t0 + i, h], 0.0)
                if T.get_thread_binding() == 0:  # in-place cumsum; past the end gamma stays at the last value
                    run = 0.0
                    for i in T.serial(C):
                        run += gam[i]
                        gam[i] = run
                T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    m_s[i, j] = T.if_then_else(i > j, b_s[i] * kk[i, j], 0.0)
                    o_s[i, j] = T.if_then_else(i > j and i // B != j // B, T.cast(b_s[i] * kk[i, j], "float16"),
                                               T.cast(0, "float16"))
                    d_s[i, j] = T.cast(0, "float16")
                tid = T.get_thread_binding()
                # D: column (tid % 16) of block (tid // 16)'s inverse by forward substitution, 16 rows deep
                if tid < C:
                    r0 = (tid // B) * B
                    c = tid % B
                    for i in T.unroll(B):
                        col[i] = 0.0
                    for i in T.unroll(B):
                        run = T.if_then_else(i == c, 1.0, 0.0)
                        for j in T.unroll(i):
                            run -= m_s[r0 + i, r0 + j] * col[j]
                        col[i] = run
                    for i in T.unroll(B):
                        d_s[r0 + i, r0 + c] = T.cast(col[i], "float16")
                T.gemm(d_s, o_s, acc, clear_accum=True)           # N = D L_off
                for i, j in T.Parallel(C, C):
                    n_s[i, j] = T.cast(acc[i, j], "float16")
                    r_s[i, j] = T.cast(T.if_then_else(i == j, 1.0, 0.0) - acc[i, j], "float16")  # I - N
                for _ in T.serial(2):                             # R <- I - N R, twice
                    T.gemm(n_s, r_s, acc, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        r_s[i, j] = T.cast(T.if_then_else(i == j, 1.0, 0.0) - acc[i, j], "float16")
                T.gemm(r_s, d_s, acc, clear_accum=True)           # A = R D
                for i, j in T.Parallel(C, C):
                    m_s[i, j] = T.if_then_else(i >= j, acc[i, j], 0.0)
                for i in T.serial(C):  # row by row, vectorised along the row
                    for j in T.Parallel(C):
                        if i < valid:
                            agb[t0 + i, h, j] = T.if_then_else(
                                i >= j, T.cast(m_s[i, j] * T.exp2((gam[i] - gam[j]) * LOG2E) * b_s[j], dt),
                                T.cast(0, dt))
                            if write_a != 0:
                                A[t0 + i, h, j] = T.cast(m_s[i, j], dt)
                # every slot of the chunk's tile is written: the forward reads all 64
                for i in T.Parallel(C):
                    eg_t[h, bc * C + i] = T.exp2(gam[i] * LOG2E)
                    et_t[h, bc * C + i] = T.if_then_else(i < valid, T.exp2((gam[valid - 1] - gam[i]) * LOG2E), 0.0)
                    gam_t[h, bc * C + i] = gam[i]

    return gdn_prepare
