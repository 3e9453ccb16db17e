"""GDN backward state recurrence: one CTA per (sequence, v-head, V-block) walks its chunks last to first.

The forward chain per chunk (gdn_bwd_recompute) is, with S the entering state,
    W = V - diag(eg) K S,   Vnew = Agb W,   O = scale diag(eg) Q S + P Vnew,
    S' = eg_last S + K^T diag(et) Vnew.
Its adjoint, with dS the gradient of the leaving state S' (fp32, K x BV, in registers), is
    X   = P^T dO + diag(et) K dS           (dL/dVnew)
    dW  = Agb^T X                          (= dL/dV)
    dS <- eg_last dS + Q^T (scale diag(eg) dO) - K^T (diag(eg) dW)
Every V column evolves on its own, so V splits across CTAs like the forward. Per chunk the kernel stores
dS' (the chunk's dh, as the GEMMs used it), X and dV; after the first chunk dS is dh0. The chunk-parallel
rest of the backward (dq, dk, dbeta, dg) runs afterwards on these (flash_qla/chunk_grads.py).
Rows past the sequence end: dO is zeroed there (and et = 0), so X and dW vanish on them and the
next sequence's q/k rows that the tile loads contribute nothing.
Backward intra-card CP (flash_qla/cp.py; "chain" then runs the segments as sequences from their leaving-state
gradients): "state" walks the range [cu_seqlens[n + 1], rend[n, h]) (the start of the segment after n) backwards
from dS = 0 and stores the dS it ends with (the gate-bounded warm-up of the gradient leaving segment n);
"trans" walks the same range (all of the next segment, fallback heads only) with dO = 0 from dS = I (V = K):
the range's transposed transition M^T, the adjoint of the forward's "trans" M.
In the chain build dht and dh0 are [N, Hv, K, V], or the caller's V-first [N, Hv, V, K] with state_mode & V_FIRST
(aot/kernels/state_io.py): read and written in place, no transposed copies (CP's per-segment ones stay [.., K, V]).
"""
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from .producer_warp import register as single_warp_producer
from .state_io import V_FIRST
from .state_product import state_policy

C = 64
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128], "V": [64, 128, 256], "BV": [32, 64],
            "mode": ["chain", "state", "trans"]}
# the CP pre-pass builds: one V block (64); trans needs V = K
VARIANT_RULE = "BV <= V and (mode == 'chain' or BV == 64) and (mode != 'trans' or V == K)"
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
THREADS = 256
STAGES = 2
# Every barrier of the chain is written out below: three per chunk (the tiles each one publishes are named there).
# TileLang's own pass put nine in each chunk (two back to back, and one before every rewrite of a tile whose last
# reader had already passed a barrier), all on the chain's critical path.
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}
CHAIN_BARRIER = 1  # a named barrier of the consumer threads only (0 is __syncthreads: the producer warp is not there)
# The backward runs gdn_bwd_recompute's save build and gdn_bwd_dh's chain side by side (their CTAs fit one SM together):
# both ask for the SM's whole shared-memory carveout. Left to the driver, an SM running one of them is split for
# that kernel alone and the other's CTA cannot join it (hk16_hv32 8k_1seq: the chains ran one after the other,
# 1.07 ms; side by side 0.96). Other kernels keep the driver's split (more L1: TP8 forward rows were 1.5% faster).
SHARED_CARVEOUT = 100

# producer warps 1-3 leave at once: a lagging parity wait among them hung the backward (producer_warp.py)
single_warp_producer("gdn_bwd_dh_kernel")


def build(dtype: str, K: int, V: int, BV: int, mode: str = "chain"):
    dt = DTYPES[dtype]
    chain = mode == "chain"  # compile time: only the chain stores per-chunk outputs
    trans = mode == "trans"  # dO = 0 (no q, dO or P read), dS = I
    STATE_POLICY = state_policy(K)
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    TC = T.dynamic("TC")  # chunk slots x 64 (gdn_prepare's eg / et tiles)

    @T.prim_func
    def gdn_bwd_dh(
        q: T.Tensor((NT, Hq, K), dt),
        k: T.Tensor((NT, Hq, K), dt),
        do: T.Tensor((NT, Hv, V), dt),
        agb: T.Tensor((NT, Hv, C), dt),
        p: T.Tensor((NT, Hv, C), dt),
        eg_t: T.Tensor((Hv, TC), "float32"),
        et_t: T.Tensor((Hv, TC), "float32"),
        dht: T.Tensor((N, Hv, K * V), "float32"),  # a state's floats flat: [K, V], or [V, K] (V_FIRST)
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        dhs: T.Tensor((TC // C, Hv, K, V), dt),
        x: T.Tensor((NT, Hv, V), dt),
        dv: T.Tensor((NT, Hv, V), dt),
        dh0: T.Tensor((N, Hv, K * V), "float32"),
        rend: T.Tensor((N, Hv), "int32"),
        rfallback: T.Tensor((N, Hv), "int32"),
        seq_order: T.Tensor((N,), "int32"),
        scale: T.float32,
        use_dht: T.int32,
        store_dh0: T.int32,
        ordered: T.int32,
        state_mode: T.int32,
    ):
        with T.Kernel(V // BV, Hv, N, threads=THREADS) as (bv, h, nz):
            if BV == 32:
                # registers for two CTAs' worth of threads: this chain shares its SM with the save build's CTA
                # (TMA stores beside the partial-chunk fallback had ptxas take 128 registers, too many for that)
                T.annotate_min_blocks_per_sm(2)
            q_s = T.alloc_shared((C, K), dt)
            k_s = T.alloc_shared((C, K), dt)
            do_s = T.alloc_shared((C, BV), dt)
            agb_s = T.alloc_shared((C, C), dt)
            p_s = T.alloc_shared((C, C), dt)
            eg_s = T.alloc_shared((C,), "float32")
            et_s = T.alloc_shared((C,), "float32")
            ds_s = T.alloc_shared((K, BV), dt)
            dos_s = T.alloc_shared((C, BV), dt)   # scale * eg * dO
            x_s = T.alloc_shared((C, BV), dt)
            dwe_s = T.alloc_shared((C, BV), dt)   # -eg * dW
            dv_s = T.alloc_shared((C, BV), dt)    # dW, the stored dV
            # read (or written) in the accumulator's row layout by 4-byte accesses, eight rows per instruction:
            # the 128-byte swizzle spreads those rows over the banks (8-way conflicts in the plain layout)
            T.annotate_layout({do_s: make_swizzled_layout(do_s)})
            dS = T.alloc_fragment((K, BV), "float32")
            xf = T.alloc_fragment((C, BV), "float32")
            xp = T.alloc_fragment((C, BV), "float32")  # P^T dO
            dw = T.alloc_fragment((C, BV), "float32")
            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            slot0 = T.alloc_var("int32")
            c0 = T.alloc_var("int32")
            hk = T.alloc_var("int32")
            n = T.alloc_var("int32")
            nc = T.alloc_var("int32")
            # CTA z walks sequence seq_order[z] (gdn_plan: longest first) when ordered; CP's segments are equal
            n = T.if_then_else(ordered != 0, seq_order[nz], nz)
            if chain:
                bos = cu_seqlens[n]
                eos = cu_seqlens[n + 1]
                c0 = chunk_offsets[n]
            else:  # the range at the start of the next segment (chunk aligned), up to rend
                bos = cu_seqlens[n + 1]
                eos = rend[n, h]
                if trans:
                    if rfallback[n, h] == 0:
                        eos = bos
                c0 = chunk_offsets[n + 1]
            slot0 = c0 * C
            hk = h // (Hv // Hq)
            nc = T.ceildiv(eos - bos, C)
            v0 = bv * BV
            if trans:  # the block's columns of the identity
                for kk, d in T.Parallel(K, BV):
                    dS[kk, d] = T.if_then_else(kk == v0 + d, 1.0, 0.0)
            elif use_dht == 0:
                T.clear(dS)
            elif (state_mode & V_FIRST) != 0:
                for kk, d in T.Parallel(K, BV):
                    dS[kk, d] = dht[n, h, (v0 + d) * K + kk]
            else:
                for kk, d in T.Parallel(K, BV):
                    dS[kk, d] = dht[n, h, kk * V + v0 + d]
            for r in T.Pipelined(nc, num_stages=STAGES):
                c = nc - 1 - r
                t0 = bos + c * C
                if not trans:
                    T.copy(q[t0:t0 + C, hk, :], q_s)
                T.copy(k[t0:t0 + C, hk, :], k_s)
                if not trans:
                    T.copy(do[t0:t0 + C, h, v0:v0 + BV], do_s)
                T.copy(agb[t0:t0 + C, h, :], agb_s)
                if not trans:
                    T.copy(p[t0:t0 + C, h, :], p_s)
                T.copy(eg_t[h, slot0 + c * C:slot0 + c * C + C], eg_s)
                T.copy(et_t[h, slot0 + c * C:slot0 + c * C + C], et_s)
                valid = T.min(eos - t0, C)
                if not trans:
                    if valid < C:
                        # a sequence's partial last chunk: dO's rows past its end (the next sequence's) zeroed in
                        # the stage itself, which the producer refills only after this chunk releases it
                        # (a read of the tile, so TileLang waits for its load first: a bare store it does not wait for)
                        for i, d in T.Parallel(C, BV):
                            do_s[i, d] = T.if_then_else(i < valid, do_s[i, d], T.cast(0, dt))
                # ds_s is free: the previous chunk's dS' store finished reading it before that chunk's X barrier
                T.copy(dS, ds_s)
                T.fence_proxy_async()
                if chain:
                    # the previous chunk's X and dV stores (issued by this thread) have read x_s / dv_s, which are
                    # rewritten after the barrier below
                    T.tma_store_wait()
                # ds_s (and a partial chunk's do_s) published (the stage's tiles came by mbarrier)
                T.sync_threads(CHAIN_BARRIER, THREADS)
                if chain:
                    T.tma_copy(ds_s, dhs[c0 + c, h, :, v0:v0 + BV])
                for kk, d in T.Parallel(K, BV):
                    dS[kk, d] = dS[kk, d] * eg_s[valid - 1]
                # X's products first, on the stage's dO: the scaled dO for dS's own term is made under them, off the
                # chain (it was a pass of its own before the barrier, with a masked copy of dO for P^T dO)
                T.wgmma_gemm(k_s, ds_s, xf, clear_accum=True)
                if not trans:
                    T.wgmma_gemm(p_s, do_s, xp, transpose_A=True, clear_accum=True)
                    # dos_s's last reader, the previous chunk's Q^T dO product, was waited for at its end
                    for i, d in T.Parallel(C, BV):
                        dos_s[i, d] = T.cast(
                            T.cast(do_s[i, d], "float32") * T.if_then_else(i < valid, eg_s[i] * scale, 0.0), dt)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(xf, num_regs=C * BV // THREADS)
                if trans:
                    for i, d in T.Parallel(C, BV):
                        x_s[i, d] = T.cast(xf[i, d] * et_s[i], dt)
                else:
                    T.warpgroup_fence_operand(xp, num_regs=C * BV // THREADS)
                    for i, d in T.Parallel(C, BV):
                        x_s[i, d] = T.cast(xf[i, d] * et_s[i] + xp[i, d], dt)
                T.fence_proxy_async()
                if chain:
                    T.tma_store_wait()  # this chunk's dS' store has read ds_s, which the next chunk rewrites
                T.sync_threads(CHAIN_BARRIER, THREADS)  # x_s, dos_s published (x_s's last reader, the previous chunk's X store, was waited for)
                # dW first; dS's dO term runs under the dW pass (K^T dW's wait covers it)
                T.wgmma_gemm(agb_s, x_s, dw, transpose_A=True, clear_accum=True)
                if not trans:
                    T.wgmma_gemm(q_s, dos_s, dS, transpose_A=True, policy=STATE_POLICY)
                    T.wait_wgmma(1)
                else:
                    T.wait_wgmma(0)
                T.warpgroup_fence_operand(dw, num_regs=C * BV // THREADS)
                # dwe_s's last reader is the previous chunk's K^T dW product, waited for by both warpgroups before
                # the barrier above; dv_s's is the previous chunk's dV store, waited for before the first barrier
                for i, d in T.Parallel(C, BV):
                    dwe_s[i, d] = T.cast(-dw[i, d] * eg_s[i], dt)
                    if chain:
                        dv_s[i, d] = T.cast(dw[i, d], dt)
                T.fence_proxy_async()
                T.sync_threads(CHAIN_BARRIER, THREADS)  # dwe_s, dv_s published
                T.wgmma_gemm(k_s, dwe_s, dS, transpose_A=True, policy=STATE_POLICY)
                # X and dV go out while that product runs: stored before the fence above, they held it (the
                # fence waits for the thread's earlier global stores: MEMBAR.ALL.CTA, ncu). A whole chunk by TMA
                # (the per-element stores were ~16% of the consumers' stall samples); a sequence's partial last
                # chunk by its valid rows (the rows past it are the next sequence's)
                if chain:
                    if valid == C:
                        T.tma_copy(x_s, x[t0:t0 + C, h, v0:v0 + BV])
                        T.tma_copy(dv_s, dv[t0:t0 + C, h, v0:v0 + BV])
                    # a branch of its own: as one predicate per element, ptxas kept the loop's 64-bit addresses and
                    # predicated stores in every chunk (~90 of a warp's ~750 instructions a chunk, ncu); from shared
                    # memory, as dw's registers read there had ptxas serialise the wgmmas (a wait in a divergent path)
                    if valid < C:
                        for i, d in T.Parallel(C, BV):
                            if i < valid:
                                x[t0 + i, h, v0 + d] = x_s[i, d]
                                dv[t0 + i, h, v0 + d] = dv_s[i, d]
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(dS, num_regs=K * BV // THREADS)
                # TileLang hands a pipeline stage back to the producer after the last statement that names its
                # tiles, unaware that the products above are asynchronous: this never-taken read names the tiles
                # they read after the wait, so the producer cannot refill them while a product still reads them
                if valid < 0:
                    if trans:
                        x_s[0, 0] = k_s[0, 0]
                    else:
                        x_s[0, 0] = q_s[0, 0] + k_s[0, 0] + p_s[0, 0] + do_s[0, 0]
            if chain:
                T.tma_store_wait()  # the last chunk's stores have read their tiles before the CTA exits
            if chain and (state_mode & V_FIRST) != 0:
                if store_dh0 != 0:
                    for kk, d in T.Parallel(K, BV):
                        dh0[n, h, (v0 + d) * K + kk] = dS[kk, d]
            elif store_dh0 != 0 or not chain:
                for kk, d in T.Parallel(K, BV):
                    dh0[n, h, kk * V + v0 + d] = dS[kk, d]

    return gdn_bwd_dh
