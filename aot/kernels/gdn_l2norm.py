"""use_qk_l2norm_in_kernel as a pass of its own: every q and k row x becomes x / sqrt(sum x^2 + eps), in fp32 with
one rounding to the input dtype, into qn / kn, which the plain (l2norm = 0) kernels then read.

The arithmetic is gdn_prepare's (tile_rows.l2norm_row, the same sum order and rounding), so the rows match what the
backward's recompute normalises. One CTA normalises one 64-row block of one q / k head: both tiles come into shared
memory and leave it whole by coalesced 16-byte accesses, and in between threads 0-63 normalise its k rows, 64-127 its
q rows, one row a thread in place (the tiles swizzled, so a warp's rows at one column fall in different banks). Why a pass: the fused
kernel's l2norm build does the normalisation algebraically on its aux warpgroup, which bounds the chunk, and has no
BV = 128 build; reading and writing q and k once costs less where the GVA ratio is large (flash_qla/planner.py,
PRENORM_US).
"""
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from .common import L2NORM_EPS
from .tile_rows import l2norm_row

C = 64
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128]}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
THREADS = 2 * C


def build(dtype: str, K: int):
    dt = DTYPES[dtype]
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")

    @T.prim_func
    def gdn_l2norm(
        q: T.Tensor((NT, Hq, K), dt),
        k: T.Tensor((NT, Hq, K), dt),
        qn: T.Tensor((NT, Hq, K), dt),
        kn: T.Tensor((NT, Hq, K), dt),
    ):
        with T.Kernel(T.ceildiv(NT, C), Hq, threads=THREADS) as (bt, h):
            q_s = T.alloc_shared((C, K), dt)
            k_s = T.alloc_shared((C, K), dt)
            l2n = T.alloc_local((8,), dt)
            nrm = T.alloc_local((2,), "float32")
            T.annotate_layout({q_s: make_swizzled_layout(q_s), k_s: make_swizzled_layout(k_s)})
            t0 = bt * C
            for i, d in T.Parallel(C, K):
                q_s[i, d] = T.if_then_else(t0 + i < NT, q[t0 + i, h, d], T.cast(0, dt))
                k_s[i, d] = T.if_then_else(t0 + i < NT, k[t0 + i, h, d], T.cast(0, dt))
            T.sync_threads()
            tid = T.get_thread_binding()
            row = tid % C
            if tid < C:
                l2norm_row(k_s, row, K, L2NORM_EPS, l2n, nrm, kn, t0 + row, h, False, None, 1, row)
            else:
                l2norm_row(q_s, row, K, L2NORM_EPS, l2n, nrm, qn, t0 + row, h, False, None, 0, row)
            T.sync_threads()
            for i, d in T.Parallel(C, K):
                if t0 + i < NT:
                    qn[t0 + i, h, d] = q_s[i, d]
                    kn[t0 + i, h, d] = k_s[i, d]

    return gdn_l2norm
