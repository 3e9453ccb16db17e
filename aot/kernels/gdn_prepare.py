"""Per chunk and v-head: the chunk-local cumsum of g and the gate-free inverse A.

A = (I + strictLower(diag(beta) K K^T))^-1 (unit lower triangular, 64 x 64), computed without the gate:
the forward re-applies it elementwise as exp(gamma_i - gamma_j) * A_ij, which never overflows.
One CTA per (chunk, v-head). Chunks are numbered across the packed batch: ``chunk_offsets[n]`` is the
first chunk of sequence n (a device-side cumsum of ceil(len / 64)), so nothing is read on the host.

Outputs: A [T, Hv, 64] (rows of each chunk), and gamma and beta head-major and chunk-aligned,
[Hv, chunk slot * 64 + row] (fp32), so the forward reads each chunk's 64 values as one 256-byte-aligned
tile through its async copy pipeline (a token-indexed tile would start misaligned in varlen batches).
The solve is a forward substitution in fp32 with one column of A per thread held in registers (fully
unrolled, 4 partial sums per row), L read from shared memory as broadcasts: no barrier between the rows.
64 threads per CTA: every thread owns a column, none idles (the 64x64x128 K K^T uses mma.sync).
"""
import tilelang.language as T

C = 64
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128]}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
THREADS = 64  # one thread per column of A: every thread works in the solve


def build(dtype: str, K: int):
    dt = DTYPES[dtype]
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    TC = T.dynamic("TC")  # chunk slots x 64: gamma/beta live in one aligned 64-slot tile per chunk

    @T.prim_func
    def gdn_prepare(
        k: T.Tensor((NT, Hq, K), dt),
        g: T.Tensor((NT, Hv), "float32"),
        beta: T.Tensor((NT, Hv), "float32"),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        A: T.Tensor((NT, Hv, C), dt),
        g_cumsum_t: T.Tensor((Hv, TC), "float32"),
        beta_t: T.Tensor((Hv, TC), "float32"),
    ):
        # grid x covers an upper bound of the chunk count (ceil(T / 64) + N); extra CTAs exit
        with T.Kernel(T.ceildiv(NT, C) + N, Hv, threads=THREADS) as (bc, h):
            k_s = T.alloc_shared((C, K), dt)
            kk = T.alloc_fragment((C, C), "float32")
            lower = T.alloc_shared((C, C), "float32")
            b_s = T.alloc_shared((C,), "float32")
            g_s = T.alloc_shared((C,), "float32")
            col = T.alloc_local((C,), "float32")
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            t0 = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            acc = T.alloc_var("float32")
            part = T.alloc_local((4,), "float32")

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
                hk = h // (Hv // Hq)
                for i, d in T.Parallel(C, K):
                    k_s[i, d] = T.if_then_else(t0 + i < eos, k[t0 + i, hk, d], T.cast(0, dt))
                for i in T.Parallel(C):
                    b_s[i] = T.if_then_else(t0 + i < eos, beta[t0 + i, h], 0.0)
                    g_s[i] = T.if_then_else(t0 + i < eos, g[t0 + i, h], 0.0)
                T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    lower[i, j] = T.if_then_else(i > j, b_s[i] * kk[i, j], 0.0)
                tid = T.get_thread_binding()
                # column `tid` of A: x_i = [i == tid] - sum_{j<i} L_ij x_j, the sum split over 4 accumulators
                # so the dependent FMA chain is a quarter as long (fully unrolled: x stays in registers)
                for i in T.unroll(C):
                    for r in T.unroll(4):
                        part[r] = 0.0
                    for j in T.unroll(i):
                        part[j % 4] += lower[i, j] * col[j]
                    col[i] = T.if_then_else(i == tid, 1.0, -((part[0] + part[1]) + (part[2] + part[3])))
                for i in T.unroll(C):
                    if t0 + i < eos:
                        A[t0 + i, h, tid] = T.cast(col[i], dt)
                if tid == 0:
                    acc = 0.0
                    for i in T.serial(C):
                        if t0 + i < eos:
                            acc += g_s[i]
                            g_cumsum_t[h, bc * C + i] = acc
                            beta_t[h, bc * C + i] = b_s[i]

    return gdn_prepare
