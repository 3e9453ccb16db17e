"""Intra-card CP, the serial step: each segment's entering state from its predecessors' pre-pass results.

h_in arrives holding Z[s] (the pre-pass's state-only chain over the warm-up before segment s, from S = 0;
flash_qla/cp.py). Per (sequence, v-head, 16 V columns) one CTA walks the sequence's segments in order:
    h_in[first] = h0 (or 0)
    h_in[s]    += M[s] h_in[s-1]      only where fallback[s] (the exact transition of s - 1's range, for
                                      heads whose decay does not bound the warm-up); elsewhere Z[s] stands.
So a sequence whose heads all decay costs one flag read per segment (the former walk copied every Z
through shared memory: ~5 us a step, 0.086 ms of TP8 1x8192's 0.31 ms on the H200). fp32 FMAs (no tf32),
so the combination adds no error beyond the chains'. Segments of one sequence are contiguous, seg_base[n]
is the first of sequence n's.
"""
import tilelang.language as T

VARIANTS = {"K": [64, 128], "V": [64, 128, 256]}
THREADS = 1024  # 2 outputs per thread at K = 128: the serial chain of loads and FMAs per step is what costs
BVC = 16  # V columns per CTA: K x 16 outputs (each a K-long fp32 dot product)


def build(K: int, V: int):
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    S = T.dynamic("S")  # segment slots (an upper bound of the segment count)

    @T.prim_func
    def gdn_cp_combine(
        m: T.Tensor((S, Hv, K, K), "float32"),
        fallback: T.Tensor((S, Hv), "int32"),
        seg_base: T.Tensor((N + 1,), "int32"),
        h0: T.Tensor((N, Hv, K, V), "float32"),
        h_in: T.Tensor((S, Hv, K, V), "float32"),
        use_h0: T.int32,
    ):
        with T.Kernel(V // BVC, Hv, N, threads=THREADS) as (bv, h, n):
            hs = T.alloc_shared((K, BVC), "float32")
            m_s = T.alloc_shared((K, K), "float32")  # one bulk copy: loads from global inside the dot
                                                       # products serialised on their latency (14 us a step)
            acc = T.alloc_fragment((K, BVC), "float32")
            s0 = T.alloc_var("int32")
            s1 = T.alloc_var("int32")
            s0 = seg_base[n]
            s1 = seg_base[n + 1]
            v0 = bv * BVC
            if s1 > s0:
                if use_h0 != 0:
                    T.copy(h0[n, h, :, v0:v0 + BVC], hs)
                else:
                    T.clear(hs)
                # plain stores, not a TMA store: a fallback step reads this back with ordinary loads after a
                # barrier, which orders generic-proxy writes only
                for r, c in T.Parallel(K, BVC):
                    h_in[s0, h, r, v0 + c] = hs[r, c]
                for i in T.serial(s1 - s0 - 1):
                    seg = s0 + 1 + i
                    if fallback[seg, h] != 0:
                        # the predecessor's entering state is final: this CTA wrote it (or left its Z) earlier
                        T.copy(h_in[seg - 1, h, :, v0:v0 + BVC], hs)
                        T.copy(m[seg, h, :, :], m_s)
                        for r, c in T.Parallel(K, BVC):
                            acc[r, c] = h_in[seg, h, r, v0 + c]
                            for kk in T.unroll(K):
                                acc[r, c] += m_s[r, kk] * hs[kk, c]
                        T.copy(acc, h_in[seg, h, :, v0:v0 + BVC])

    return gdn_cp_combine
