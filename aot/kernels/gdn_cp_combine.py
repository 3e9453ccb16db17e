"""Intra-card CP, the serial step: each segment's entering state from its predecessors' pre-pass results.

h_in arrives holding Z[s] (the pre-pass's state-only chain over the warm-up before segment s, from S = 0;
flash_qla/cp.py). Per (sequence, v-head, 16 V columns) one CTA walks the sequence's segments in order:
    h_in[first] = h0 (or 0)
    h_in[s]    += M[s] h_in[s-1]      only where fallback[s] (the exact transition of s - 1's range, for
                                      heads whose decay does not bound the warm-up); elsewhere Z[s] stands.
With reverse (the backward's dS chain, flash_qla/cp.py) the walk runs last segment to first:
    h_in[last] = dht (or 0);  h_in[s] += M^T[s] h_in[s+1] where fallback[s]
(m then holds the transposed transitions of the segments after, gdn_bwd_dh's "trans" mode).
With zero_z the Z[s] are taken as zero and h_in is not read, every row of a sequence written (multi-GPU CP's linked
forward: from h0 = I this gives B[s], the part of h_in[s] linear in the state entering the sequence, into an
unset buffer).
So a sequence whose heads all decay costs one flag read per segment, and a fallback step ~3.7 us on the
H200 (TP8 1x8192 at 8-chunk segments: 16 steps, 0.059 ms; 0.086 ms with one output per thread). A step's loads
(Z[s], M[s] and the predecessor's state unless this CTA just computed it, which it keeps in shared memory) are
issued together before its first barrier: 7% faster on an H100 than three latencies in a row (hk4_hv8 32k_1seq).
fp32 FMAs (no tf32), so the combination adds no error beyond the chains'. Segments of one sequence are contiguous,
seg_base[n] is the first of sequence n's.
"""
import tilelang.language as T

VARIANTS = {"K": [64, 128], "V": [64, 128, 256]}
BVC = 16  # V columns per CTA: K x 16 outputs (each a K-long fp32 dot product)
ROWS, COLS = 4, 2  # outputs per thread: a 4 x 2 register tile, so M arrives as 16-byte shared loads (one
                   # output per thread with scalar loads, two per FMA, took ~5.3 us a step: the shared-memory
                   # pipe, not the global loads, was the limit: prefetching M and Z changed nothing, H200)


# Both CTA barriers of a fallback step are written out: TileLang's own pass added two more (it cannot tell the running
# state's two parities apart)
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}


def threads(K: int) -> int:
    return K * BVC // (ROWS * COLS)


def build(K: int, V: int):
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    S = T.dynamic("S")  # segment slots (an upper bound of the segment count)

    THREADS = threads(K)
    NM = K * K // (THREADS * 4)  # M's float4 loads per thread

    @T.prim_func
    def gdn_cp_combine(
        m: T.Tensor((S, Hv, K, K), "float32"),
        fallback: T.Tensor((S, Hv), "int32"),
        seg_base: T.Tensor((N + 1,), "int32"),
        h0: T.Tensor((N, Hv, K, V), "float32"),
        h_in: T.Tensor((S, Hv, K, V), "float32"),
        use_h0: T.int32,
        reverse: T.int32,
        zero_z: T.int32,
    ):
        with T.Kernel(V // BVC, Hv, N, threads=THREADS) as (bv, h, n):
            # the running state by parity: a fallback step reads hs[p] and writes hs[1 - p], whose last readers
            # (the step before) passed this step's barriers
            hs = T.alloc_shared((2, K, BVC), "float32")
            m_s = T.alloc_shared((K, K + 4), "float32")  # padded rows: the 4 rows of a tile hit other banks
            acc = T.alloc_local((ROWS * COLS,), "float32")
            hreg = T.alloc_local((ROWS * COLS,), "float32")
            mreg = T.alloc_local((NM * 4,), "float32")
            mrow = T.alloc_local((ROWS * 4,), "float32")
            hcol = T.alloc_local((4 * COLS,), "float32")
            s0 = T.alloc_var("int32")
            s1 = T.alloc_var("int32")
            first = T.alloc_var("int32")
            seg = T.alloc_var("int32")
            prev = T.alloc_var("int32")
            here = T.alloc_var("int32")  # the predecessor's state is this CTA's last output, held in hs[par]
            par = T.alloc_var("int32")
            s0 = seg_base[n]
            s1 = seg_base[n + 1]
            v0 = bv * BVC
            tid = T.get_thread_binding()
            r0 = tid // (BVC // COLS) * ROWS
            c0 = tid % (BVC // COLS) * COLS
            if s1 > s0:
                first = T.if_then_else(reverse != 0, s1 - 1, s0)
                for i in T.unroll(ROWS):
                    for u in T.unroll(COLS):
                        acc[i * COLS + u] = T.if_then_else(use_h0 != 0, h0[n, h, r0 + i, v0 + c0 + u], 0.0)
                        h_in[first, h, r0 + i, v0 + c0 + u] = acc[i * COLS + u]
                        hs[0, r0 + i, c0 + u] = acc[i * COLS + u]
                here = 1
                par = 0
                for i in T.serial(s1 - s0 - 1):
                    seg = T.if_then_else(reverse != 0, s1 - 2 - i, s0 + 1 + i)
                    prev = T.if_then_else(reverse != 0, seg + 1, seg - 1)
                    if fallback[seg, h] != 0:
                        # every load of the step issued at once (one latency, not three in a row): Z[seg] into
                        # the accumulators, M[seg] and, when another kernel left it, the predecessor's state
                        for i2 in T.unroll(ROWS):
                            for u in T.unroll(COLS):
                                acc[i2 * COLS + u] = T.if_then_else(zero_z != 0, 0.0,
                                                                    h_in[seg, h, r0 + i2, v0 + c0 + u])
                        for j in T.unroll(NM):
                            for e in T.vectorized(4):
                                mreg[j * 4 + e] = m[seg, h, (j * THREADS + tid) * 4 // K,
                                                    (j * THREADS + tid) * 4 % K + e]
                        if here == 0:
                            for i2 in T.unroll(ROWS):
                                for u in T.unroll(COLS):
                                    hreg[i2 * COLS + u] = h_in[prev, h, r0 + i2, v0 + c0 + u]
                        T.sync_threads()  # the previous step's reads of m_s and hs[par] are done
                        for j in T.unroll(NM):
                            for e in T.vectorized(4):
                                m_s[(j * THREADS + tid) * 4 // K, (j * THREADS + tid) * 4 % K + e] = mreg[j * 4 + e]
                        if here == 0:
                            for i2 in T.unroll(ROWS):
                                for u in T.unroll(COLS):
                                    hs[par, r0 + i2, c0 + u] = hreg[i2 * COLS + u]
                        T.sync_threads()  # m_s, hs[par]
                        for k4 in T.serial(K // 4):
                            for i2 in T.unroll(ROWS):
                                for e in T.vectorized(4):
                                    mrow[i2 * 4 + e] = m_s[r0 + i2, k4 * 4 + e]
                            for e in T.unroll(4):
                                for u in T.vectorized(COLS):
                                    hcol[e * COLS + u] = hs[par, k4 * 4 + e, c0 + u]
                            for i2 in T.unroll(ROWS):
                                for e in T.unroll(4):
                                    for u in T.unroll(COLS):
                                        acc[i2 * COLS + u] += mrow[i2 * 4 + e] * hcol[e * COLS + u]
                        for i2 in T.unroll(ROWS):
                            for u in T.unroll(COLS):
                                h_in[seg, h, r0 + i2, v0 + c0 + u] = acc[i2 * COLS + u]
                                hs[1 - par, r0 + i2, c0 + u] = acc[i2 * COLS + u]
                        par = 1 - par
                        here = 1
                    else:
                        here = 0  # Z[seg] stands: the pre-pass wrote it
                        if zero_z != 0:  # or zero does: each thread writes (and a later step reads) its own outputs
                            for i2 in T.unroll(ROWS):
                                for u in T.unroll(COLS):
                                    h_in[seg, h, r0 + i2, v0 + c0 + u] = 0.0

    return gdn_cp_combine
