"""Intra-card CP, the serial step: each segment's entering state from its predecessors' pre-pass results.

h_in arrives holding Z[s] (the pre-pass's state-only chain over the warm-up before segment s, from S = 0;
flash_qla/cp.py). Per (sequence, v-head, BVC V columns) one CTA walks the sequence's segments in order:
    h_in[first] = h0 (or 0)
    h_in[s]    += M[s] h_in[s-1]      only where fallback[s] (the exact transition of s - 1's range, for
                                      heads whose decay does not bound the warm-up); elsewhere Z[s] stands.
With reverse (the backward's dS chain, flash_qla/cp.py) the walk runs last segment to first:
    h_in[last] = dht (or 0);  h_in[s] += M^T[s] h_in[s+1] where fallback[s]
(m then holds the transposed transitions of the segments after, gdn_bwd_dh's "trans" mode).
With zero_z the Z[s] are taken as zero and h_in is not read, every row of a sequence written (multi-GPU CP's linked
forward: from h0 = I this gives B[s], the part of h_in[s] linear in the state entering the sequence, into an
unset buffer).
So a sequence whose heads all decay costs one shared-memory flag read per segment (each CTA reads the flags of
THREADS steps at once). A fallback step is a serial latency chain (one CTA an SM, 4-16 warps): M[s] comes by TMA into
one of two buffers, the next fallback step's transition issued before this step's products (M does not depend on
the running state), and the product's k loop is unrolled so the swizzled shared addresses fold to constants. The
host picks the fewest V columns per CTA (BVC) whose grid fits one CTA an SM (flash_qla/cp.combine_variant): a
step's products scale with BVC, its M load does not. H100, TP8 1x32768 at 32-chunk segments (16 steps, two
fallback heads): 0.054 -> 0.028 ms against the previous build (16 columns, M staged through registers, a step's
loads waited for at its start), outputs bit-identical (bench/results/h100/kernel_ab_combine.jsonl).
fp32 FMAs (no tf32), so the combination adds no error beyond the chains'. Segments of one sequence are contiguous,
seg_base[n] is the first of sequence n's.
"""
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

VARIANTS = {"K": [64, 128], "V": [64, 128, 256], "BVC": [8, 16, 32]}
VARIANT_RULE = "BVC <= V"
ROWS, COLS = 4, 2  # outputs per thread: 4 rows K / 4 apart (a warp's rows are consecutive: conflict-free 16-byte loads
                   # of M's rows) x 2 adjacent columns


# The CTA barriers of a fallback step are written out: TileLang's own pass added more (it cannot tell the running
# state's two parities apart)
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}


def threads(K: int, BVC: int) -> int:
    return K * BVC // (ROWS * COLS)


def build(K: int, V: int, BVC: int):
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    S = T.dynamic("S")  # segment slots (an upper bound of the segment count)

    THREADS = threads(K, BVC)
    RSTEP = K // ROWS            # a thread's rows: r0, r0 + RSTEP, ...

    @T.macro
    def load_step(m, m_s, mfull, h_in, zreg, at, h, issued, tid, zero_z, r0, v0, c0):
        """Segment at's M by TMA into buffer issued % 2 (warp 0 issues and arrives) and its Z into zreg."""
        if tid < 32:
            T.tma_copy(m[at, h, :, :], m_s[issued % 2, :, :], barrier=mfull[issued % 2], leader_scope_threads=32)
            T.barrier_arrive(mfull[issued % 2])
        for i2 in T.unroll(ROWS):
            for u in T.unroll(COLS):
                zreg[i2 * COLS + u] = T.if_then_else(zero_z != 0, 0.0, h_in[at, h, r0 + i2 * RSTEP, v0 + c0 + u])

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
            # M by TMA, two buffers: the next fallback step's transition loads while this step multiplies (M does
            # not depend on the running state); swizzled, so a warp's eight consecutive rows hit distinct banks
            m_s = T.alloc_shared((2, K, K), "float32")
            T.annotate_layout({m_s: make_swizzled_layout(m_s)})
            mfull = T.alloc_barrier([32, 32])
            # the fallback flags of the next THREADS steps, read at once (not one latency a step)
            flags_s = T.alloc_shared((THREADS,), "int32")
            acc = T.alloc_local((ROWS * COLS,), "float32")
            zreg = T.alloc_local((ROWS * COLS,), "float32")
            hreg = T.alloc_local((ROWS * COLS,), "float32")
            mrow = T.alloc_local((ROWS * 4,), "float32")
            hcol = T.alloc_local((4 * COLS,), "float32")
            s0 = T.alloc_var("int32")
            s1 = T.alloc_var("int32")
            first = T.alloc_var("int32")
            seg = T.alloc_var("int32")
            prev = T.alloc_var("int32")
            nxt = T.alloc_var("int32")
            step = T.alloc_var("int32")
            nfb = T.alloc_var("int32")   # the next step is a fallback step
            here = T.alloc_var("int32")  # the predecessor's state is this CTA's last output, held in hs[par]
            have = T.alloc_var("int32")  # this step's M is loading and its Z in zreg (issued the step before)
            issued = T.alloc_var("int32")  # M loads issued: load j fills buffer j % 2, phase (j // 2) % 2
            used = T.alloc_var("int32")    # M loads consumed
            par = T.alloc_var("int32")
            s0 = seg_base[n]
            s1 = seg_base[n + 1]
            v0 = bv * BVC
            tid = T.get_thread_binding()
            r0 = tid // (BVC // COLS)
            c0 = tid % (BVC // COLS) * COLS
            if s1 > s0:
                first = T.if_then_else(reverse != 0, s1 - 1, s0)
                for i in T.unroll(ROWS):
                    for u in T.unroll(COLS):
                        acc[i * COLS + u] = T.if_then_else(use_h0 != 0, h0[n, h, r0 + i * RSTEP, v0 + c0 + u], 0.0)
                        h_in[first, h, r0 + i * RSTEP, v0 + c0 + u] = acc[i * COLS + u]
                        hs[0, r0 + i * RSTEP, c0 + u] = acc[i * COLS + u]
                here = 1
                have = 0
                issued = 0
                used = 0
                par = 0
                for i in T.serial(s1 - s0 - 1):
                    seg = T.if_then_else(reverse != 0, s1 - 2 - i, s0 + 1 + i)
                    prev = T.if_then_else(reverse != 0, seg + 1, seg - 1)
                    nxt = T.if_then_else(reverse != 0, seg - 1, seg + 1)
                    if i % THREADS == 0:
                        T.sync_threads()  # the last window's flags are read
                        step = i + tid
                        flags_s[tid] = 0
                        if step < s1 - s0 - 1:
                            flags_s[tid] = fallback[T.if_then_else(reverse != 0, s1 - 2 - step, s0 + 1 + step), h]
                        T.sync_threads()
                    if flags_s[i % THREADS] != 0:
                        if have == 0:  # not prefetched: M[seg] into the free buffer (its last readers passed the
                                       # previous step's barriers) and Z[seg]
                            load_step(m, m_s, mfull, h_in, zreg, seg, h, issued, tid, zero_z, r0, v0, c0)
                            issued = issued + 1
                        if here == 0:  # the predecessor's state, left by the pre-pass
                            for i2 in T.unroll(ROWS):
                                for u in T.unroll(COLS):
                                    hreg[i2 * COLS + u] = h_in[prev, h, r0 + i2 * RSTEP, v0 + c0 + u]
                        nfb = 0
                        if (i + 1) % THREADS != 0 and i + 1 < s1 - s0 - 1:  # (a new window's flags: no prefetch)
                            nfb = flags_s[(i + 1) % THREADS]
                        T.sync_threads()  # the previous step's reads of m_s and hs[par] are done
                        if here == 0:
                            for i2 in T.unroll(ROWS):
                                for u in T.unroll(COLS):
                                    hs[par, r0 + i2 * RSTEP, c0 + u] = hreg[i2 * COLS + u]
                        for i2 in T.unroll(ROWS * COLS):
                            acc[i2] = zreg[i2]
                        have = 0
                        if nfb != 0:  # the next fallback step's M and Z load under this step's products
                            load_step(m, m_s, mfull, h_in, zreg, nxt, h, issued, tid, zero_z, r0, v0, c0)
                            issued = issued + 1
                            have = 1
                        T.sync_threads()  # hs[par]
                        T.barrier_wait(mfull[used % 2], used // 2 % 2)
                        for k4 in T.unroll(K // 4):  # unrolled: the swizzled addresses fold to constants
                            for i2 in T.unroll(ROWS):
                                for e in T.vectorized(4):
                                    mrow[i2 * 4 + e] = m_s[used % 2, r0 + i2 * RSTEP, k4 * 4 + e]
                            for e in T.unroll(4):
                                for u in T.vectorized(COLS):
                                    hcol[e * COLS + u] = hs[par, k4 * 4 + e, c0 + u]
                            for i2 in T.unroll(ROWS):
                                for e in T.unroll(4):
                                    for u in T.unroll(COLS):
                                        acc[i2 * COLS + u] += mrow[i2 * 4 + e] * hcol[e * COLS + u]
                        used = used + 1
                        for i2 in T.unroll(ROWS):
                            for u in T.unroll(COLS):
                                h_in[seg, h, r0 + i2 * RSTEP, v0 + c0 + u] = acc[i2 * COLS + u]
                                hs[1 - par, r0 + i2 * RSTEP, c0 + u] = acc[i2 * COLS + u]
                        par = 1 - par
                        here = 1
                    else:
                        here = 0  # Z[seg] stands: the pre-pass wrote it
                        if zero_z != 0:  # or zero does: each thread writes (and a later step reads) its own outputs
                            for i2 in T.unroll(ROWS):
                                for u in T.unroll(COLS):
                                    h_in[seg, h, r0 + i2 * RSTEP, v0 + c0 + u] = 0.0

    return gdn_cp_combine
