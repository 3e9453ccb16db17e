"""Everything of the GDN forward that depends on neither V nor the state, once per (chunk, v-head).

Per 64-token chunk with gamma the chunk-local cumsum of g, Gamma_ij = exp(gamma_i - gamma_j) (i >= j):
  A    = (I + strictLower(diag(beta) K K^T))^-1, the gate-free inverse (FlashQLA's A; stored on request),
  Agb  = Gamma * A * beta_col                       (the gate re-applied elementwise: never overflows),
  eg   = exp(gamma_i), et = exp(gamma_last - gamma_i) (0 past the sequence end), gamma itself and
  beta_i |k_i|^2 (the diagonal of diag(beta) K K^T, for intra-card CP's warm-up bound)
(P = scale * Gamma * tril(Q K^T) is gdn_qk's, which shares Q K^T across a GVA group).
The recurrence kernel (gdn_fwd) then keeps only the state-dependent chain. One CTA of 64 threads per
(chunk, v-head); chunks are numbered across the packed batch (chunk_offsets[n] = first chunk of sequence n,
a device-side cumsum of ceil(len / 64)), nothing is read on the host.
Layouts: Agb, A are [T, Hv, 64] (rows of each chunk); eg, et, gamma live head-major in 256-byte-aligned
64-slot tiles per chunk, [Hv, chunk slot * 64 + row], so the forward streams each as one TMA tile.
The solve is a forward substitution in fp32 with one column of A per thread in registers (fully unrolled,
4 partial sums per row), L read from shared memory as broadcasts: no barrier between rows.
"""
import tilelang.language as T

C = 64
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128]}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
THREADS = 64  # one thread per column of A: every thread works in the solve
H = C // 2    # columns of the second warp
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
        bkk_t: T.Tensor((Hv, TC), "float32"),
        write_a: T.int32,
    ):
        # grid x covers an upper bound of the chunk count (ceil(T / 64) + N); extra CTAs exit
        with T.Kernel(T.ceildiv(NT, C) + N, Hv, threads=THREADS) as (bc, h):
            k_s = T.alloc_shared((C, K), dt)
            kk = T.alloc_fragment((C, C), "float32")
            lower = T.alloc_shared((C, C + 4), "float32")  # padded rows: the MMA-layout stores hit 4.4-way bank conflicts (ncu)
            b_s = T.alloc_shared((C,), "float32")
            gam = T.alloc_shared((C,), "float32")
            bkk = T.alloc_shared((C,), "float32")
            col = T.alloc_local((C,), "float32")
            part = T.alloc_local((4,), "float32")
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            t0 = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            hk = T.alloc_var("int32")
            acc = T.alloc_var("float32")

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
                    acc = 0.0
                    for i in T.serial(C):
                        acc += gam[i]
                        gam[i] = acc
                T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    lower[i, j] = T.if_then_else(i > j, b_s[i] * kk[i, j], 0.0)
                    if i == j:
                        bkk[i] = b_s[i] * kk[i, j]
                tid = T.get_thread_binding()
                # column `tid` of A: x_i = [i == tid] - sum_{j<i} L_ij x_j, the sum split over 4 accumulators.
                # x_i = 0 for i < tid, so warp 1 (columns 32..63) starts at row 32: a warp-uniform branch
                # that drops ~37% of the FMAs and shared loads.
                if tid < H:
                    for i in T.unroll(C):
                        for r in T.unroll(4):
                            part[r] = 0.0
                        for j in T.unroll(i):
                            part[j % 4] += lower[i, j] * col[j]
                        col[i] = T.if_then_else(i == tid, 1.0, -((part[0] + part[1]) + (part[2] + part[3])))
                else:
                    for i in T.unroll(H):
                        col[i] = 0.0
                    for i in T.unroll(H):
                        for r in T.unroll(4):
                            part[r] = 0.0
                        for j in T.unroll(i):
                            part[j % 4] += lower[H + i, H + j] * col[H + j]
                        col[H + i] = T.if_then_else(H + i == tid, 1.0, -((part[0] + part[1]) + (part[2] + part[3])))
                # park the column in shared memory (L is dead now) so the gated, scaled copy below runs as
                # its own pass: fused into the unrolled loop it keeps ~90 more registers live
                for i in T.unroll(C):
                    lower[i, tid] = col[i]
                for i in T.serial(C):  # row by row (not unrolled: a fully unrolled 64x64 pass costs registers)
                    for j in T.Parallel(C):
                        if i < valid:
                            agb[t0 + i, h, j] = T.if_then_else(
                                i >= j, T.cast(lower[i, j] * T.exp2((gam[i] - gam[j]) * LOG2E) * b_s[j], dt),
                                T.cast(0, dt))
                            if write_a != 0:
                                A[t0 + i, h, j] = T.cast(lower[i, j], dt)
                # every slot of the chunk's tile is written: the forward reads all 64
                eg_t[h, bc * C + tid] = T.exp2(gam[tid] * LOG2E)
                et_t[h, bc * C + tid] = T.if_then_else(tid < valid, T.exp2((gam[valid - 1] - gam[tid]) * LOG2E), 0.0)
                gam_t[h, bc * C + tid] = gam[tid]
                # beta |k|^2 per token: whether the token's factor (I - beta k k^T) can expand the state (CP's
                # warm-up bound needs 0 <= beta |k|^2 <= 2; flash_qla/cp.py); -1 (harmless) past the end
                bkk_t[h, bc * C + tid] = T.if_then_else(tid < valid, T.if_then_else(b_s[tid] < 0, 3.0, bkk[tid]), -1.0)

    return gdn_prepare
