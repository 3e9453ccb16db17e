"""GDN forward recurrence with the transposed state in registers: o and the final state (mode "out"), and
the intra-card CP pre-pass chains (modes "state" and "trans", flash_qla/cp.py).

The chain of gdn_bwd_recompute's out build, written on S^T (BV x K, fp32) so that every product takes its state-side
operand from registers (wgmma's A operand may be a register fragment; B must be shared memory):
    (K S)^T = S^T K^T,  (Q S)^T = S^T Q^T                     A = S^T (bf16 copy), B = k / q tiles
    W^T     = V^T - (K S)^T diag(eg)
    Vnew^T  = W^T Agb^T                                        A = W^T,  B = Agb tile
    O^T     = scale (Q S)^T diag(eg) + Vnew^T P^T              A = Vnew^T, B = P tile
    S^T     = eg_last S^T + (diag(et) Vnew)^T K                A = Vd^T, B = k tile
Nothing of the chain goes through shared memory (gdn_bwd_recompute round-trips S, W, Vnew and Vd through it every
chunk, and its ncu profile shows the shared-memory pipe as the limiter); only O^T is staged there to leave
as rows. One consumer warpgroup per 64 V columns (each owns 64 rows of S^T), a producer warpgroup streams
q, k, v, Agb, P, eg, et by TMA two or three chunks deep.
Measured on the H200 (TP1 4096x8, forward-kernel time): ~0.80 ms at BV = 128 vs ~1.36 ms for gdn_bwd_recompute's
shared-memory-staged out build at its best block; one chain's chunk ~2.5 us (BV = 64) / ~3.1 us (BV = 128).
Rows past the sequence end: et = 0 there and Agb / P are causal, so they reach no valid row; they are not
stored. eg_last is the last valid row's.
State I/O (mode "out"): h0 and ht are [N, Hv, K, V], or [N, Hv, V, K] with state_mode & V_FIRST (FLA's and FlashInfer's
layout); with state_mode & READ_INDEXED sequence n starts from h0[state_idx[n]] (a state pool; a negative slot starts
from zero) and with WRITE_INDEXED its final state goes to ht[state_idx[n]] (nothing for a negative slot): serving
engines' pools are read and written in place, with no gather or scatter around the call. S^T's accumulator layout
meets both layouts in full 32-byte sectors (a quad's two-column pairs; a warp's eight rows).
CP pre-pass builds (no q, P or output): "state" runs the state-only chain from S = 0 over the chunk range that
ENDS where segment n begins (cu_seqlens[n]) and starts at start[n, h] (the gate-driven warm-up), into ht[n];
"trans" the same range with V = 0 and S = I (V = K), the range's exact transition M, for the heads whose
decay does not bound the warm-up (fallback[n, h] != 0; other heads run no chunk).
Multi-GPU CP's head window ("window", flash_qla/distributed.py): the output pass from S = I with V = 0 (V = K) over
sequence n, o being q carried back to the sequence's start and the final state the transition. With stop > 0 each
(n, h) first walks its first `stop` chunks' totals (gdn_prepare's gamma at row 63 and bkk_max, as gdn_cp_plan's
warm-ups) and, where their g sums to <= decay_bound with every walked chunk's beta |k|^2 <= 2, runs only the fewest
leading chunks that get there (the rest of its o is written as zeros: beyond them q carried back is below the
bound); fallback[n, h] (an output here) = 1 where it ran the whole sequence, whose transition the caller measures.
"""
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from .block_fragments import block_cols
from .fragment_io import PRELUDE
from .state_io import READ_INDEXED, V_FIRST, WRITE_INDEXED
from .producer_warp import register as single_warp_producer

C = 64
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128], "V": [64, 128, 256], "BV": [64, 128],
            "mode": ["out", "state", "trans", "window"]}
# the CP pre-pass builds: one V block (64: they are never the only work on the GPU); trans and window need V = K;
# the window runs beside a main pass: one V block of 64 (its few chains hold as few SMs as they can)
VARIANT_RULE = "BV <= V and (mode == 'out' or BV == 64) and (mode not in ('trans', 'window') or V == K)"
WALK_GROUP = 16  # the window's chunk totals loaded this many at a time (a producer thread has few registers)
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
# The O staging's barriers are written out below, one named barrier per consumer warpgroup: TileLang's pass put
# three 256-thread barriers around it each chunk, holding both warpgroups in lockstep (ncu: barrier stalls)
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}
OUT_ROWS_PER_PASS = 16   # a warpgroup stores its 64 O columns (128 bytes a row) as 8 threads x 16 bytes per row
OUT_BARRIER = 8          # named barrier ids 8, 9 (0 is __syncthreads)
TURN_BARRIER = 10        # 10: warpgroup 0 has issued its product, 11: warpgroup 1 has

# producer warps 1-3 leave at once: a lagging parity wait among them hung the backward (producer_warp.py)
single_warp_producer("gdn_fwd_chain_kernel")


def build(dtype: str, K: int, V: int, BV: int, mode: str = "out"):
    dt = DTYPES[dtype]
    window = mode == "window"
    output = mode in ("out", "window")
    cp = mode in ("state", "trans")  # CP pre-pass: the range from start[n, h] to cu_seqlens[n], no output
    trans = mode == "trans"
    homogeneous = mode in ("trans", "window")  # V = 0 from S = I: the chain's transition
    # one warpgroup (BV = 64) leaves shared memory for a third stage: 2-5% faster chains (H200, TP8 1x32768 /
    # TP2 1x8192); with two (BV = 128) the third stage measured 1-3% slower
    stages = 3 if BV == 64 else 2
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    TC = T.dynamic("TC")
    H0R = T.dynamic("h0_rows")  # h0's rows: N, or the pool's slots (a slot past them reads as zero)
    HTR = T.dynamic("ht_rows")  # ht's rows: N, or the pool's slots (a slot past them is not written)

    @T.macro
    def take_turn(wg, first):
        """Two consumer warpgroups issue their products in turn (warpgroup 0 first), so that one's products queue on
        the tensor cores behind the other's and its element-wise steps overlap them (1-8% on the BV = 128 rows,
        H200)."""
        if BV == 128:
            if wg == 1:
                T.sync_threads(TURN_BARRIER, 256)
            elif not first:
                T.sync_threads(TURN_BARRIER + 1, 256)

    @T.macro
    def pass_turn(wg):
        if BV == 128:
            T.named_barrier_arrive(TURN_BARRIER + wg, 256)

    @T.macro
    def drain_turns(wg, chunks):
        """Warpgroup 0 takes warpgroup 1's last turn, so that the barrier ends drained."""
        if BV == 128:
            if wg == 0 and chunks > 0:
                T.sync_threads(TURN_BARRIER + 1, 256)

    @T.prim_func
    def gdn_fwd_chain(
        q: T.Tensor((NT, Hq, K), dt),
        k: T.Tensor((NT, Hq, K), dt),
        v: T.Tensor((NT, Hv, V), dt),
        agb: T.Tensor((NT, Hv, C), dt),
        p: T.Tensor((NT, Hv, C), dt),
        eg_t: T.Tensor((Hv, TC), "float32"),
        et_t: T.Tensor((Hv, TC), "float32"),
        # a state's K x V floats flat: [K, V] or, with state_mode & V_FIRST, [V, K]; rows are sequences, or pool
        # slots through state_idx
        h0: T.Tensor((H0R, Hv, K * V), "float32"),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        o: T.Tensor((NT, Hv, V), dt),
        ht: T.Tensor((HTR, Hv, K * V), "float32"),
        start: T.Tensor((N, Hv), "int32"),
        fallback: T.Tensor((N, Hv), "int32"),
        state_idx: T.Tensor((N,), "int32"),
        gam_t: T.Tensor((Hv, TC), "float32"),
        bkk_max: T.Tensor((Hv, TC // C), "float32"),
        scale: T.float32,
        use_h0: T.int32,
        store_ht: T.int32,
        state_mode: T.int32,
        stop: T.int32,
        decay_bound: T.float32,
    ):
        with T.Kernel(V // BV, Hv, N, threads=128 * (BV // 64), prelude=PRELUDE) as (bv, h, n):
            if BV > 64:  # the producer needs few registers; two consumer warpgroups hold 64 x K of S^T each
                T.annotate_producer_reg_dealloc(24)
                T.annotate_consumer_reg_alloc(232)
            q_s = T.alloc_shared((C, K), dt)
            k_s = T.alloc_shared((C, K), dt)
            v_s = T.alloc_shared((C, BV), dt)
            agb_s = T.alloc_shared((C, C), dt)
            p_s = T.alloc_shared((C, C), dt)
            eg_s = T.alloc_shared((C,), "float32")
            et_s = T.alloc_shared((C,), "float32")
            # O^T leaves the accumulator by stmatrix .trans into o_s's rows: rows padded by 16 bytes, so the eight
            # rows of one 8 x 8 block land in different banks
            o_s = T.alloc_shared((2, C, BV + 8), dt)  # double-buffered: one warpgroup barrier per chunk
            # v is read down its columns (ldmatrix .trans into W^T's accumulator layout), 16 bytes a row of a block
            T.annotate_layout({v_s: make_swizzled_layout(v_s)})
            st = T.alloc_fragment((BV, K), "float32")
            st_b = T.alloc_fragment((BV, K), dt)
            kst = T.alloc_fragment((BV, C), "float32")
            qst = T.alloc_fragment((BV, C), "float32")
            wt = T.alloc_fragment((BV, C), dt)
            vnt = T.alloc_fragment((BV, C), "float32")
            vnt_b = T.alloc_fragment((BV, C), dt)
            vdt_b = T.alloc_fragment((BV, C), dt)
            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            slot0 = T.alloc_var("int32")
            hk = T.alloc_var("int32")
            c0 = T.alloc_var("int32")
            srow = T.alloc_var("int32")  # h0's / ht's row: the sequence, or its pool slot
            if window:
                seq_end = T.alloc_var("int32")  # the sequence's end; the chain's (eos) may come before it
                g_sum = T.alloc_var("float32")  # the walk's summed g, largest beta |k|^2, and chunks to the bound
                bk_max = T.alloc_var("float32")
                reach = T.alloc_var("int32")
                tot = T.alloc_local((WALK_GROUP,), "float32")
                big = T.alloc_local((WALK_GROUP,), "float32")
            if cp:  # compile time: the chain ends where segment n begins, chunk aligned
                eos = cu_seqlens[n]
                bos = start[n, h]
                if trans:
                    if fallback[n, h] == 0:
                        bos = eos
                c0 = chunk_offsets[n] - (eos - bos) // C
            else:
                bos = cu_seqlens[n]
                eos = cu_seqlens[n + 1]
                c0 = chunk_offsets[n]
                if window:  # producer and consumers walk alike: both need the chain's chunk count
                    seq_end = eos
                    # the first `stop` chunks' totals, WALK_GROUP loads in flight at a time (the loop's extent is
                    # the parameter's: warp specialisation copies this walk into the producer's code and the
                    # consumers', which must agree on their loops)
                    g_sum = 0.0
                    bk_max = -1.0
                    reach = 0
                    for g0 in T.serial(T.ceildiv(stop, WALK_GROUP)):
                        for u in T.unroll(WALK_GROUP):
                            tot[u] = T.if_then_else(g0 * WALK_GROUP + u < stop,
                                                    gam_t[h, (c0 + g0 * WALK_GROUP + u) * C + C - 1], 0.0)
                            big[u] = T.if_then_else(g0 * WALK_GROUP + u < stop,
                                                    bkk_max[h, c0 + g0 * WALK_GROUP + u], -1.0)
                        for u in T.unroll(WALK_GROUP):
                            if g0 * WALK_GROUP + u < stop:
                                g_sum += tot[u]
                                if reach == 0 and g_sum <= decay_bound:
                                    reach = g0 * WALK_GROUP + u + 1
                                bk_max = T.max(bk_max, big[u])
                    if reach > 0 and bk_max <= 2.0:
                        eos = T.min(bos + reach * C, seq_end)
            slot0 = c0 * C
            hk = h // (Hv // Hq)
            v0 = bv * BV
            ct = T.get_thread_binding()  # in the consumer code, consumer threads count from 0 (warp specialisation)
            wg = ct // 128
            if homogeneous:  # S = I (V = K): S^T's rows are the block's columns of the identity
                for d, kk in T.Parallel(BV, K):
                    st[d, kk] = T.if_then_else(kk == v0 + d, 1.0, 0.0)
            elif use_h0 != 0:
                srow = T.if_then_else((state_mode & READ_INDEXED) != 0, state_idx[n], n)
                if srow < 0:  # a padding entry of the pool's index table: zero state
                    T.clear(st)
                elif (state_mode & V_FIRST) != 0:
                    for d, kk in T.Parallel(BV, K):
                        st[d, kk] = h0[srow, h, (v0 + d) * K + kk]
                else:
                    for d, kk in T.Parallel(BV, K):
                        st[d, kk] = h0[srow, h, kk * V + v0 + d]
            else:
                T.clear(st)
            for c in T.Pipelined(T.ceildiv(eos - bos, C), num_stages=stages):
                t0 = bos + c * C
                if output:  # compile time: only the output pass needs q, P, (Q S)^T and O
                    T.copy(q[t0:t0 + C, hk, :], q_s)
                T.copy(k[t0:t0 + C, hk, :], k_s)
                if not homogeneous:
                    T.copy(v[t0:t0 + C, h, v0:v0 + BV], v_s)
                T.copy(agb[t0:t0 + C, h, :], agb_s)
                if output:
                    T.copy(p[t0:t0 + C, h, :], p_s)
                T.copy(eg_t[h, slot0 + c * C:slot0 + c * C + C], eg_s)
                T.copy(et_t[h, slot0 + c * C:slot0 + c * C + C], et_s)
                valid = T.min(eos - t0, C)
                T.copy(st, st_b)
                if output:
                    # (K S)^T is the chain's; (Q S)^T, needed only for O, is issued behind Agb W (it no longer delays
                    # Agb W; the state update, issued after it, still waits for it)
                    take_turn(wg, c == 0)
                    T.wgmma_gemm(st_b, k_s, kst, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    pass_turn(wg)
                    T.wait_wgmma(0)
                    # no use of (K S)^T may move above the wait (a consumer thread holds 32 of its registers)
                    T.warpgroup_fence_operand(kst, num_regs=C // 2)
                else:
                    T.gemm(st_b, k_s, kst, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                if homogeneous:  # V = 0: the homogeneous chain
                    for d, i in T.Parallel(BV, C):
                        wt[d, i] = T.cast(-eg_s[i] * kst[d, i], dt)
                else:  # fragment_io.py's W^T step: V^T's 8 x 8 blocks by ldmatrix .trans
                    for jj in T.unroll(C // 16):
                        row, col = block_cols(ct % 32, 16 * jj, 16 * (ct % 128 // 32))
                        T.call_extern("handle", "fqla_wt_" + dtype, T.address_of(v_s[row, wg * 64 + col]),
                                      T.address_of(eg_s[0]), kst.data, wt.data, jj, ct % 32)
                if output:
                    take_turn(wg, False)
                    T.wgmma_gemm(wt, agb_s, vnt, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    T.wgmma_gemm(st_b, q_s, qst, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    pass_turn(wg)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(vnt, num_regs=C // 2)
                    for d, i in T.Parallel(BV, C):
                        vnt_b[d, i] = T.cast(vnt[d, i], dt)
                        vdt_b[d, i] = T.cast(vnt[d, i] * et_s[i], dt)
                else:
                    T.gemm(wt, agb_s, vnt, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    for d, i in T.Parallel(BV, C):
                        vdt_b[d, i] = T.cast(vnt[d, i] * et_s[i], dt)
                for d, kk in T.Parallel(BV, K):
                    st[d, kk] = st[d, kk] * eg_s[valid - 1]
                if output:
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(qst, num_regs=C // 2)
                    for d, i in T.Parallel(BV, C):
                        qst[d, i] = qst[d, i] * (eg_s[i] * scale)
                    # the state update and O's intra-chunk product issued back to back, one wait
                    take_turn(wg, False)
                    T.wgmma_gemm(vdt_b, k_s, st, policy=T.GemmWarpPolicy.FullRow)
                    T.wgmma_gemm(vnt_b, p_s, qst, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    pass_turn(wg)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(st, num_regs=K // 2)  # nor of the state (K / 2 per thread)
                    T.warpgroup_fence_operand(qst, num_regs=C // 2)  # or of O^T above this one
                    # TileLang hands a pipeline stage back to the producer after the last statement that names its
                    # tiles, unaware that the products above are asynchronous: this never-taken read names q, k
                    # and P after the wait, so the producer cannot refill them while a product still reads them
                    if valid < 0:
                        o_s[0, 0, 0] = q_s[0, 0] + k_s[0, 0] + p_s[0, 0]
                    # Each consumer warpgroup stages and stores its own 64 columns of O (its rows of O^T): with two
                    # buffers, the barrier after this chunk's staging also orders the previous chunk's reads of
                    # the other buffer before the next chunk's writes to it
                    for jj in T.unroll(C // 16):  # fragment_io.py's transposed store: O's rows from O^T's blocks
                        row, col = block_cols(ct % 32, 16 * jj, 16 * (ct % 128 // 32))
                        T.call_extern("handle", "fqla_stsm_t_" + dtype, T.address_of(o_s[c % 2, row, wg * 64 + col]),
                                      qst.data, jj)
                    T.sync_threads(OUT_BARRIER + wg, 128)
                    col = wg * 64 + ct % 8 * 8
                    for ps in T.unroll(C // OUT_ROWS_PER_PASS):
                        row = ps * OUT_ROWS_PER_PASS + ct % 128 // 8
                        if row < valid:
                            for u in T.vectorized(8):
                                o[t0 + row, h, v0 + col + u] = o_s[c % 2, row, col + u]
                else:
                    T.gemm(vdt_b, k_s, st, policy=T.GemmWarpPolicy.FullRow)
            if output:
                drain_turns(wg, T.ceildiv(eos - bos, C))
            if window:  # past the chain's end, q carried back is below the bound: zeros
                for c2 in T.serial(T.ceildiv(seq_end - eos, C)):
                    for i, d in T.Parallel(C, BV):
                        if eos + c2 * C + i < seq_end:
                            o[eos + c2 * C + i, h, v0 + d] = T.cast(0.0, dt)
                if bv == 0 and ct == 0:
                    fallback[n, h] = T.if_then_else(eos == seq_end, 1, 0)
            if cp:  # the pre-pass's per-segment results: internal, [S, Hv, K, V]
                for d, kk in T.Parallel(BV, K):
                    ht[n, h, kk * V + v0 + d] = st[d, kk]
            elif store_ht != 0:
                srow = T.if_then_else((state_mode & WRITE_INDEXED) != 0, state_idx[n], n)
                if srow >= 0:  # a padding entry writes nothing
                    if (state_mode & V_FIRST) != 0:
                        for d, kk in T.Parallel(BV, K):
                            ht[srow, h, (v0 + d) * K + kk] = st[d, kk]
                    else:
                        for d, kk in T.Parallel(BV, K):
                            ht[srow, h, kk * V + v0 + d] = st[d, kk]

    return gdn_fwd_chain
