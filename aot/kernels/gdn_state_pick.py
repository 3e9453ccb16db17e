"""Intra-card CP's per-sequence states from its per-segment ones, in one launch.

With CP (flash_qla/cp.py) a sequence runs as segments, and the chains leave one state per segment: the forward's
final state of sequence n is its last segment's, the backward's dh0 its first segment's. A zero-length sequence has
no segment and passes its boundary through (h0 for the final state, dht for dh0; zeros when there is none):
    out[n] = last[n] >= 0 ? states[segment[n]] : (use_boundary ? boundary[n] : 0)
One CTA copies a 512-float slice of one (sequence, v-head) state, a float4 a thread: a plain copy, so the call
issues this pick inside its recorded plan instead of running a gather, a mask and a select in torch after it.
"""
import tilelang.language as T

VARIANTS = {"K": [64, 128], "V": [64, 128, 256]}
THREADS = 128
VEC = 4


def build(K: int, V: int):
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    S = T.dynamic("S")  # segment slots (an upper bound of the segment count)
    SLICE = THREADS * VEC

    @T.prim_func
    def gdn_state_pick(
        states: T.Tensor((S, Hv, K, V), "float32"),
        segment: T.Tensor((N,), "int32"),
        last: T.Tensor((N,), "int32"),
        boundary: T.Tensor((N, Hv, K, V), "float32"),
        out: T.Tensor((N, Hv, K, V), "float32"),
        use_boundary: T.int32,
    ):
        with T.Kernel(K * V // SLICE, Hv, N, threads=THREADS) as (bx, h, n):
            tid = T.get_thread_binding()
            at = bx * SLICE + tid * VEC
            r = at // V
            c = at % V
            if last[n] >= 0:
                for e in T.vectorized(VEC):
                    out[n, h, r, c + e] = states[segment[n], h, r, c + e]
            elif use_boundary != 0:
                for e in T.vectorized(VEC):
                    out[n, h, r, c + e] = boundary[n, h, r, c + e]
            else:
                for e in T.vectorized(VEC):
                    out[n, h, r, c + e] = T.float32(0)

    return gdn_state_pick
