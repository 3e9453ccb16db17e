"""Per chunk and v-head: the chunk-local cumsum of g and the gate-free inverse A.

A = (I + strictLower(diag(beta) K K^T))^-1 (unit lower triangular, 64 x 64), computed without the gate:
the forward re-applies it elementwise as exp(gamma_i - gamma_j) * A_ij, which never overflows.
One CTA per (chunk, v-head). Chunks are numbered across the packed batch: ``chunk_offsets[n]`` is the
first chunk of sequence n (a device-side cumsum of ceil(len / 64)), so nothing is read on the host.
"""
import tilelang.language as T

C = 64
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128]}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
THREADS = 128


def build(dtype: str, K: int):
    dt = DTYPES[dtype]
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")

    @T.prim_func
    def gdn_prepare(
        k: T.Tensor((NT, Hq, K), dt),
        g: T.Tensor((NT, Hv), "float32"),
        beta: T.Tensor((NT, Hv), "float32"),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        A: T.Tensor((NT, Hv, C), dt),
        g_cumsum: T.Tensor((NT, Hv), "float32"),
    ):
        # grid x covers an upper bound of the chunk count (ceil(T / 64) + N); extra CTAs exit
        with T.Kernel(T.ceildiv(NT, C) + N, Hv, threads=THREADS) as (bc, h):
            k_s = T.alloc_shared((C, K), dt)
            kk = T.alloc_fragment((C, C), "float32")
            lower = T.alloc_shared((C, C), "float32")
            inv = T.alloc_shared((C, C), "float32")
            b_s = T.alloc_shared((C,), "float32")
            g_s = T.alloc_shared((C,), "float32")
            seq = T.alloc_var("int32")
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
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
            seq = lo
            if bc < chunk_offsets[N]:
                bos = cu_seqlens[seq]
                eos = cu_seqlens[seq + 1]
                t0 = bos + (bc - chunk_offsets[seq]) * C
                hk = h // (Hv // Hq)
                for i, d in T.Parallel(C, K):
                    k_s[i, d] = T.if_then_else(t0 + i < eos, k[t0 + i, hk, d], T.cast(0, dt))
                for i in T.Parallel(C):
                    b_s[i] = T.if_then_else(t0 + i < eos, beta[t0 + i, h], 0.0)
                    g_s[i] = T.if_then_else(t0 + i < eos, g[t0 + i, h], 0.0)
                T.gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    lower[i, j] = T.if_then_else(i > j, b_s[i] * kk[i, j], 0.0)
                    inv[i, j] = T.if_then_else(i == j, 1.0, 0.0)
                # forward substitution, one column per thread: row i = e_i - sum_{j<i} L_ij row j
                for i in T.serial(1, C):
                    for col in T.Parallel(C):
                        acc = 0.0
                        for j in T.serial(i):
                            acc += lower[i, j] * inv[j, col]
                        if col < i:
                            inv[i, col] = -acc
                for i, j in T.Parallel(C, C):
                    if t0 + i < eos:
                        A[t0 + i, h, j] = T.cast(inv[i, j], dt)
                if T.get_thread_binding() == 0:
                    acc = 0.0
                    for i in T.serial(C):
                        if t0 + i < eos:
                            acc += g_s[i]
                            g_cumsum[t0 + i, h] = acc

    return gdn_prepare
