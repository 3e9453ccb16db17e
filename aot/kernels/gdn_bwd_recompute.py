"""GDN state recurrence with the state staged through shared memory: the backward's recompute pass.
One CTA per (sequence, v-head, V-block) walks its sequence's chunks.

gdn_prepare has done everything that depends on neither V nor the state (Agb = Gamma * A * beta_col,
P = scale * Gamma * tril(Q K^T), eg = exp(gamma), et = exp(gamma_last - gamma)), so per chunk only the
state-dependent chain remains, with S (K x BV, fp32) in registers:
    W    = V - diag(eg) K S
    Vnew = Agb W                                      (one C x C x BV product)
    S    = eg_last S + K^T diag(et) Vnew
(The output pass, O = scale * diag(eg) Q S + P Vnew, is gdn_fwd_chain's: the same chain on S^T in registers.)
Every tile (k, v, Agb, eg, et) arrives by TMA in a 2- or 3-stage software pipeline (TileLang warp-
specialises the loop: a producer warp prefetches chunks ahead while the consumers compute chunk c).
Rows past the sequence end: et = 0 there and Agb / P are causal, so they reach no valid row; their
outputs are not stored. eg_last is the last valid row's.
Builds (the mode axis): save, the backward's recompute pass: stores, exactly as the chain used them
(bf16/fp16), every chunk's entering state hs [chunk slot, Hv, K, V], W and Vnew [T, Hv, V]. (The CP
pre-pass builds moved to gdn_fwd_chain, whose transposed-state chain is faster.)
h0 is [N, Hv, K, V], or the caller's V-first [N, Hv, V, K] with state_mode & V_FIRST (aot/kernels/state_io.py): read
in place, no transposed copy.
"""
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from .producer_warp import register as single_warp_producer
from .state_io import V_FIRST
from .state_product import state_policy

C = 64
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128], "V": [64, 128, 256], "BV": [32, 64],
            "mode": ["save"]}
# BV: the V columns one CTA owns (flash_qla/planner.py trades chain count against chain cost). BV = 128
# was built and measured on the H200: its chains took ~2x BV = 64's, so it never paid and is not built.
VARIANT_RULE = "BV <= V"
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
THREADS = 256
# input stages by V block. BV = 64 (one CTA per SM) takes three: with the two W / Vnew buffers below, alone on an H100
# against two stages and one buffer:
# hk16_hv32 32k_1seq 0.922 -> 0.869 ms, 8k_8seq 0.180 -> 0.178, but 32k_8seq 0.628 -> 0.635-0.643 (an H200 gave
# 32k_8seq 0.512 -> 0.493 for three stages alone). BV = 32 keeps two: 79 KB, so
# that two CTAs, or one beside gdn_bwd_dh's BV = 32 chain (136 KB), share an SM.
STAGES = {32: 2, 64: 3}
# W / Vnew tile buffers by V block. At BV = 64 two, by chunk parity: a chunk's stores may still read one buffer while
# the next chunk fills the other, so the chunk's one store wait sits a whole chunk after those stores. BV = 32 keeps
# one (8 KB of shared memory: this CTA and gdn_bwd_dh's BV = 32 chain must fit one SM together).
WBUFS = {32: 1, 64: 2}
# the whole shared-memory carveout: this save build shares its SMs with gdn_bwd_dh's chain (why: gdn_bwd_dh.py)
SHARED_CARVEOUT = 100
# Every barrier of the chain is written out below: three per chunk (each names the tiles it publishes), where
# TileLang's own pass put eight (as in gdn_bwd_dh, whose chain got 4.7% faster for it)
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}
CHAIN_BARRIER = 1  # a named barrier of the consumer threads only (0 is __syncthreads: the producer warp is not there)

# producer warps 1-3 leave at once: a lagging parity wait among them hung the backward (producer_warp.py)
single_warp_producer("gdn_bwd_recompute_kernel")


def build(dtype: str, K: int, V: int, BV: int, mode: str = "save"):
    dt = DTYPES[dtype]
    assert mode == "save", mode
    STATE_POLICY = state_policy(K)
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    TC = T.dynamic("TC")  # chunk slots x 64 of gdn_prepare's eg / et tiles

    @T.prim_func
    def gdn_bwd_recompute(
        k: T.Tensor((NT, Hq, K), dt),
        v: T.Tensor((NT, Hv, V), dt),
        agb: T.Tensor((NT, Hv, C), dt),
        eg_t: T.Tensor((Hv, TC), "float32"),
        et_t: T.Tensor((Hv, TC), "float32"),
        h0: T.Tensor((N, Hv, K * V), "float32"),  # a state's floats flat: [K, V], or [V, K] (V_FIRST)
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        ht: T.Tensor((N, Hv, K, V), "float32"),
        hs: T.Tensor((TC // C, Hv, K, V), dt),
        w: T.Tensor((NT, Hv, V), dt),
        vnew: T.Tensor((NT, Hv, V), dt),
        seq_order: T.Tensor((N,), "int32"),
        use_h0: T.int32,
        store_ht: T.int32,
        ordered: T.int32,
        state_mode: T.int32,
    ):
        with T.Kernel(V // BV, Hv, N, threads=THREADS) as (bv, h, nz):
            k_s = T.alloc_shared((C, K), dt)
            v_s = T.alloc_shared((C, BV), dt)
            agb_s = T.alloc_shared((C, C), dt)
            s_s = T.alloc_shared((K, BV), dt)
            w_s = T.alloc_shared((WBUFS[BV], C, BV), dt)
            vn_s = T.alloc_shared((WBUFS[BV], C, BV), dt)
            vd_s = T.alloc_shared((C, BV), dt)
            eg_s = T.alloc_shared((C,), "float32")
            et_s = T.alloc_shared((C,), "float32")
            # read (or written) in the accumulator's row layout by 4-byte accesses, eight rows per instruction:
            # the 128-byte swizzle spreads those rows over the banks (8-way conflicts in the plain layout)
            T.annotate_layout({v_s: make_swizzled_layout(v_s), vn_s: make_swizzled_layout(vn_s)})
            S = T.alloc_fragment((K, BV), "float32")
            ks = T.alloc_fragment((C, BV), "float32")
            vn = T.alloc_fragment((C, BV), "float32")
            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            slot0 = T.alloc_var("int32")
            hk = T.alloc_var("int32")
            n = T.alloc_var("int32")
            c0 = T.alloc_var("int32")
            # CTA z walks sequence seq_order[z] (gdn_plan: longest first) when ordered; CP's segments are equal
            n = T.if_then_else(ordered != 0, seq_order[nz], nz)
            bos = cu_seqlens[n]          # held in registers: an inlined global read would repeat per chunk
            eos = cu_seqlens[n + 1]
            c0 = chunk_offsets[n]
            slot0 = c0 * C
            hk = h // (Hv // Hq)
            v0 = bv * BV
            if use_h0 == 0:
                T.clear(S)
            elif (state_mode & V_FIRST) != 0:
                for kk, d in T.Parallel(K, BV):
                    S[kk, d] = h0[n, h, (v0 + d) * K + kk]
            else:
                for kk, d in T.Parallel(K, BV):
                    S[kk, d] = h0[n, h, kk * V + v0 + d]
            for c in T.Pipelined(T.ceildiv(eos - bos, C), num_stages=STAGES[BV]):
                t0 = bos + c * C
                par = c % WBUFS[BV]
                T.copy(k[t0:t0 + C, hk, :], k_s)
                T.copy(v[t0:t0 + C, h, v0:v0 + BV], v_s)
                T.copy(agb[t0:t0 + C, h, :], agb_s)
                T.copy(eg_t[h, slot0 + c * C:slot0 + c * C + C], eg_s)
                T.copy(et_t[h, slot0 + c * C:slot0 + c * C + C], et_s)
                valid = T.min(eos - t0, C)
                # s_s is free: the previous chunk's hs store finished reading it before that chunk's W barrier
                T.copy(S, s_s)
                T.fence_proxy_async()
                if WBUFS[BV] == 1:
                    # the previous chunk's W and Vnew stores (issued by this thread) have read w_s / vn_s, which are
                    # rewritten after the barrier below
                    T.tma_store_wait()
                T.sync_threads(CHAIN_BARRIER, THREADS)  # s_s published
                T.tma_copy(s_s, hs[c0 + c, h, :, v0:v0 + BV])
                T.gemm(k_s, s_s, ks, clear_accum=True)
                # w_s[par]'s last readers: the Agb W product of chunk c - WBUFS (done before its Vnew barrier) and
                # its W store (waited for before this chunk's first barrier with one buffer, the previous chunk's
                # last with two)
                for i, d in T.Parallel(C, BV):
                    w_s[par, i, d] = T.cast(T.cast(v_s[i, d], "float32") - eg_s[i] * ks[i, d], dt)
                T.fence_proxy_async()
                if WBUFS[BV] == 1:
                    T.tma_store_wait()  # this chunk's hs store has read s_s, which the next chunk rewrites
                T.sync_threads(CHAIN_BARRIER, THREADS)  # w_s[par] published
                T.gemm(agb_s, w_s[par, :, :], vn, clear_accum=True)
                # the recompute stores what the chain used; vd_s's last reader, the previous chunk's state update,
                # was waited for before the first barrier; vn_s[par]'s (its store) as w_s[par]'s
                for i, d in T.Parallel(C, BV):
                    vn_s[par, i, d] = T.cast(vn[i, d], dt)
                    vd_s[i, d] = T.cast(vn[i, d] * et_s[i], dt)
                for kk, d in T.Parallel(K, BV):
                    S[kk, d] = S[kk, d] * eg_s[valid - 1]
                T.fence_proxy_async()
                if WBUFS[BV] == 2:
                    # the chunk's one store wait (the issuing thread's): this chunk's hs store (issued after its
                    # first barrier) and the previous chunk's W and Vnew stores have read s_s, w_s[1 - par] and
                    # vn_s[1 - par], which the next chunk rewrites before its first, second and third barriers.
                    # Here, a chunk's work lies between each store and its wait
                    T.tma_store_wait()
                T.sync_threads(CHAIN_BARRIER, THREADS)  # vn_s[par], vd_s published
                T.wgmma_gemm(k_s, vd_s, S, transpose_A=True, policy=STATE_POLICY)
                # W and Vnew go out while the state update runs: stored before its fence, they held it (the fence
                # waits for the thread's earlier global stores: MEMBAR.ALL.CTA, ncu on gdn_bwd_dh). A whole chunk by
                # TMA; a sequence's partial last chunk by its valid rows (the rows past it are the next sequence's)
                if valid == C:
                    T.tma_copy(w_s[par, :, :], w[t0:t0 + C, h, v0:v0 + BV])
                    T.tma_copy(vn_s[par, :, :], vnew[t0:t0 + C, h, v0:v0 + BV])
                for i, d in T.Parallel(C, BV):
                    if i < valid and valid < C:
                        w[t0 + i, h, v0 + d] = w_s[par, i, d]
                        vnew[t0 + i, h, v0 + d] = vn_s[par, i, d]
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(S, num_regs=K * BV // THREADS)
                # TileLang hands a pipeline stage back to the producer after the last statement that names its
                # tiles, unaware that the product above is asynchronous: this never-taken read names k after the
                # wait, so the producer cannot refill it while the product still reads it
                if valid < 0:
                    w_s[par, 0, 0] = k_s[0, 0]
            T.tma_store_wait()  # the last chunk's stores have read their tiles before the CTA exits
            if store_ht != 0:
                T.copy(S, ht[n, h, :, v0:v0 + BV])

    return gdn_bwd_recompute
