"""The whole GDN forward of one (sequence, v-head, V block) chain in one CTA: nothing but q, k, v, g, beta read
and o (and the final state) written. use_qk_l2norm_in_kernel is applied algebraically (no pass over the tiles).

gdn_prepare + gdn_fwd_chain materialise Agb and P (256 bytes per token and v-head, written once and read back): on
the rows where sequences x heads fill the GPU that round trip and the extra pass cost as much as the chain itself.
Here what gdn_prepare writes to memory is made in shared memory, one to two chunks ahead of the chain: Agb =
Gamma * A * beta_col (the inverse of the gated K K^T is Gamma * A, made by inverse_mma.py) and P = scale * Gamma *
tril(Q K^T) by an aux warpgroup; gamma (the chunk-local cumsum of g), eg = exp(gamma) and et = exp(gamma_last -
gamma) (0 past the end) by the producer warp.
Warpgroups (threads):
  consumers  BV / 64 warpgroups, each the transposed-state chain of gdn_fwd_chain's out build on 64 V columns. BV = 64:
             the bf16 state copy (A operand of K S and Q S) in registers; BV = 128: in shared memory, which frees the
             32 registers a thread that let the aux fit beside two consumers;
  aux        one warpgroup: the chunk-local products and the inverse for the chunks ahead (BV = 128: one product
             accumulator at a time);
  producer   one warp: q, k, v by TMA, g / beta by plain loads (0 past the sequence end; FLA's gate / beta
             activations applied there with gate_mode, aot/kernels/gate_act.py), gamma, eg, et.
Stage s (chunk c, s = c % STAGES): full[s] (producer -> aux: inputs landed), ready[s] (aux -> consumers: Agb, P
written), empty[s] (consumers -> producer: the stage may be refilled). The aux writes a stage's Agb / P only after
full[s], which the producer signals only after empty[s]: the consumers are done with that stage's previous chunk.
Rows past the sequence end: beta = 0 and g = 0 there (gamma stays at its last value), so every product stays
finite, Agb has zero columns there and et = 0: they reach no valid row; they are not stored.
State I/O as gdn_fwd_chain's out build: [.., K, V] or V-first states, read from / written to a pool's rows through
state_idx (state_mode, aot/kernels/state_io.py).
Persistent CTAs: at most max_ctas CTAs (a launch parameter), each walking the items (sequence, v-head, V block)
cta, cta + ctas, ... one after the other through the same stages, so the producer and the aux warpgroup run ahead
into the next item's chunks while the consumers finish one; the consumers start each item by asking L2 for the next
item's initial state (cp.async.bulk.prefetch; not for a K-first state of one V block, which loads faster without), so
on batches of short sequences an item's state load is an L2 hit and the state bytes stream while the chains compute.
Built with order = 1 (for batches of up to ORDER_MAX sequences whose lengths are out of order) the walk takes the
sequences longest first, ranked in shared memory by every CTA, so the short ones fill in behind the long ones (a long
sequence late in the batch otherwise starts late and sets the kernel's time). With one item a CTA it is the
one-CTA-per-item kernel.
Intra-card CP's pre-pass builds (mode "state" / "trans", flash_qla/fused_cp.py; one V block of 64, no order build):
the items are (segment, v-head, V block) with N the segment count; each walks the chunk range that ENDS where segment n
begins (cu_seqlens[n]) from start[n, h], gdn_cp_plan's warm-up start: "state" from S = 0 into ht[n] (the warm-up state
Z), "trans" with V = K from S = I and v unread (its stages stay zero), only where fallback[n, h] (the exact transition
M; the other heads run no chunk and store nothing). Neither loads q nor makes P or O; ht is [S, Hv, K, V] (K-first).
"""
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from .chunk_inverse import SCRATCH_COLS, scratch_layout
from .fragment_io import PRELUDE as FRAGMENT_PRELUDE
from .block_fragments import PRELUDE as BLOCK_PRELUDE, block_cols, block_rows
from .inverse_mma import invert_gated, store_gated_kkt
from .common import L2NORM_EPS
from .gate_act import BETA_SIGMOID, GATE, beta_act, gate_decay, head_bias, neg_rate
from .state_io import READ_INDEXED, V_FIRST, WRITE_INDEXED

C = 64
# BV = 128 (two consumer warpgroups) took 4.5 us a chunk while the state copy lived in registers (the aux got 72 and
# spilled); with it in shared memory 3.44 us (H200)
# l2norm (use_qk_l2norm_in_kernel) is a build of its own: its branch in the plain build cost ~6% (ptxas scheduling);
# BV = 128 makes |q_i|^2 by a row sum where BV = 64 takes Q Q^T's diagonal (the aux's registers)
# order: 1 walks the sequences longest first (a build of its own: the ranking and the table look-ups in the plain
# build cost 1-3% on one-item CTAs, H100 kernel_ab, whatever the batch's order)
# mode: "out", the forward; "state" / "trans", intra-card CP's pre-pass builds (docstring, one V block of 64)
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128], "V": [64, 128, 256], "BV": [64, 128], "l2norm": [0, 1],
            "order": [0, 1], "mode": ["out", "state", "trans"]}
VARIANT_RULE = ("BV <= V and (mode == 'out' or (BV == 64 and order == 0)) "
                "and (mode != 'trans' or V == K)")
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
# Every barrier is written out below (TileLang's pass would put CTA-wide ones between warpgroups that never meet)
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}
OUT_ROWS_PER_PASS = 16   # a sequence's last, partial chunk: 64 O columns stored as 8 threads x 16 bytes per row
OUT_BARRIER = 8          # + consumer warpgroup: its O staging
AUX_BARRIER = 12         # the aux warpgroup's own
PAIR_BARRIER = 13        # + 0 / 1: two of the aux's warps (inverse_mma.invert_gated)
LOG2E = 1.4426950408889634
FULL_MASK = 0xFFFFFFFF
# registers per thread (setmaxnreg): sum over warpgroups <= 512 (64K registers / 128 threads)
REGS = {64: (32, 240, 232), 128: (24, 176, 136)}   # BV: (producer, consumer, aux)
# Stages of the inputs: the aux warpgroup can start chunk c only when the stage of chunk c - STAGES is free, so
# load + aux time must fit in (STAGES - 1) chain steps; shared memory allows three at BV = 64, two at BV = 128
STAGES = {64: 3, 128: 2}
STATE_BARRIER = 10       # + consumer warpgroup: its bf16 state copy written to shared memory (BV = 128)
# the host's default cap of the persistent grid: four per SM of a 132-SM card (one CTA fits an SM), so that a card
# with fewer SMs (114, 78) still ends within one partial round of the balanced split (8% / 3% over its ideal)
PERSISTENT_CTAS = 528
ORDER_MAX = 128  # the order build's largest batch (planner.FUSED_ORDER_MAX): N loads and N^2 / threads compares a CTA
PREFETCH_NEXT_STATE = True  # the consumers ask L2 for the next item's initial state (False: A/B builds)
# fqla_prefetch_l2: an initial state asked of L2 ahead of its load (16-byte aligned, a multiple of 16 bytes); the
# accumulator helpers of fragment_io.py (O^T and P by stmatrix, W^T by ldmatrix)
PRELUDE = r"""
__device__ __forceinline__ void fqla_prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}
""" + FRAGMENT_PRELUDE + BLOCK_PRELUDE


@T.macro
def order_by_length(cu_seqlens, N, tx, order_s):
    """order_s[:N] = the sequences longest first (ties in batch order), N <= ORDER_MAX: thread tx < N ranks
    sequence tx against every length (order_s[ORDER_MAX:]), then writes it at its rank. Two CTA barriers."""
    if tx < N:
        order_s[ORDER_MAX + tx] = cu_seqlens[tx + 1] - cu_seqlens[tx]
    T.sync_threads()
    if tx < N:
        rank = T.alloc_var("int32")
        rank = 0
        for j in T.serial(N):
            rank += T.if_then_else(order_s[ORDER_MAX + j] > order_s[ORDER_MAX + tx] or
                                   (order_s[ORDER_MAX + j] == order_s[ORDER_MAX + tx] and j < tx), 1, 0)
        order_s[rank] = tx
    T.sync_threads()


def build(dtype: str, K: int, V: int, BV: int, l2norm: int = 0, order: int = 0, mode: str = "out"):
    dt = DTYPES[dtype]
    output = mode == "out"  # compile time: the pre-pass builds read no q and compute neither P nor O
    trans = mode == "trans"
    NC = BV // 64            # consumer warpgroups, 64 rows of S^T each
    NB = V // BV             # V blocks of a (sequence, v-head)
    AUX0 = 128 * NC          # first aux thread
    PRODUCER_REGS, CONSUMER_REGS, AUX_REGS = REGS[BV]
    PROD0 = AUX0 + 128       # first producer thread
    THREADS = PROD0 + 128
    # setmaxnreg.inc waits until the CTA's pool (the launch's per-thread registers, a multiple of 8, times the threads)
    # can grant the request: asking for more than the pool holds hangs the kernel
    pool = min(255, 65536 // THREADS) // 8 * 8 * THREADS
    assert (PRODUCER_REGS + NC * CONSUMER_REGS + AUX_REGS) * 128 <= pool, "setmaxnreg requests exceed the pool"
    stages = STAGES[BV]
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    H0R = T.dynamic("h0_rows")  # h0's rows: N, or the pool's slots (a slot past them reads as zero)
    HTR = T.dynamic("ht_rows")  # ht's rows: N, or the pool's slots (a slot past them is not written)

    def seq_at(order_s, i):
        """The batch's sequence at position i of the CTAs' walk."""
        return order_s[T.min(i, ORDER_MAX - 1)] if order else i

    def item_start(cu_seqlens, start, fallback, n, h):
        """The first token of item (n, h)'s chain: its sequence's, or for the pre-pass builds the warm-up's start
        (trans: the whole range for a fallback head, none for the others)."""
        if output:
            return cu_seqlens[n]
        if trans:
            return T.if_then_else(fallback[n, h] != 0, start[n, h], cu_seqlens[n])
        return start[n, h]

    def item_end(cu_seqlens, n):
        """The token past item n's chain: its sequence's end, or for the pre-pass builds segment n's start."""
        return cu_seqlens[n + 1] if output else cu_seqlens[n]

    @T.prim_func
    def gdn_fwd_fused(
        q: T.Tensor((NT, Hq, K), dt),
        k: T.Tensor((NT, Hq, K), dt),
        v: T.Tensor((NT, Hv, V), dt),
        g: T.Tensor((NT, Hv), "float32"),
        beta: T.Tensor((NT, Hv), "float32"),
        A_log: T.Tensor((Hv,), "float32"),    # gate_mode's per-head parameters (gate_act.py)
        dt_bias: T.Tensor((Hv,), "float32"),
        # a state's K x V floats flat ([K, V], or [V, K] with state_mode & V_FIRST); rows: sequences or pool slots
        h0: T.Tensor((H0R, Hv, K * V), "float32"),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        o: T.Tensor((NT, Hv, V), dt),
        ht: T.Tensor((HTR, Hv, K * V), "float32"),
        state_idx: T.Tensor((N,), "int32"),
        # the pre-pass builds' tables (gdn_cp_plan; N = segments): each (segment, v-head)'s warm-up start and whether
        # its decay leaves it to the exact transition (unread by the out build)
        start: T.Tensor((N, Hv), "int32"),
        fallback: T.Tensor((N, Hv), "int32"),
        scale: T.float32,
        use_h0: T.int32,
        store_ht: T.int32,
        state_mode: T.int32,
        gate_mode: T.int32,
        max_ctas: T.int32,         # the persistent grid's size cap (the host's: PERSISTENT_CTAS or one per SM)
    ):
        with T.Kernel(T.min(N * Hv * NB, max_ctas), threads=THREADS, prelude=PRELUDE) as (cta,):
            q_s = T.alloc_shared((stages, C, K), dt)
            k_s = T.alloc_shared((stages, C, K), dt)
            v_s = T.alloc_shared((stages, C, BV), dt)
            g_s = T.alloc_shared((stages, C), "float32")  # gamma (the chunk-local cumsum of g) in log2 units
            b_s = T.alloc_shared((stages, C), "float32")
            agb_s = T.alloc_shared((stages, C, C), dt)
            p_s = T.alloc_shared((stages, C, C), dt)
            # per-token factors of the chain: eg (times 1 / |k_i| with l2norm) for W, egq (eg, times 1 / |q_i|) for
            # (Q S)^T, et (times 1 / |k_i|) for the state update
            eg_s = T.alloc_shared((stages, C), "float32")
            egq_s = T.alloc_shared((stages, C), "float32") if l2norm else eg_s
            et_s = T.alloc_shared((stages, C), "float32")
            rn_s = T.alloc_shared((2, C), "float32")  # the aux's 1 / |k_i|, 1 / |q_i| (use_qk_l2norm_in_kernel)
            # O staged for its TMA store: warpgroup wg's 64 x 64 box at rows wg * C (swizzled: the transposed
            # stmatrix rows land in distinct banks)
            o_s = T.alloc_shared((NC * C, 64), dt)
            # the aux warpgroup's scratch (inverse_mma.py): the gated K K^T in the storage dtype (the block products'
            # operand) and its diagonal blocks in fp32 (the substitution's; chunk_inverse.scratch_layout: conflict-free
            # for the accumulator's stores and the substitution's reads)
            gm_s = T.alloc_shared((C, C), dt)
            kk_s = T.alloc_shared((C, SCRATCH_COLS), "float32")
            stb_s = T.alloc_shared((BV, K), dt) if NC > 1 else None
            T.annotate_layout({v_s: make_swizzled_layout(v_s), o_s: make_swizzled_layout(o_s),
                               gm_s: make_swizzled_layout(gm_s), kk_s: scratch_layout()})
            if NC > 1:
                T.annotate_layout({stb_s: make_swizzled_layout(stb_s)})
            full = T.alloc_barrier([32] * stages)
            ready = T.alloc_barrier([128] * stages)
            empty = T.alloc_barrier([128 * NC] * stages)
            # this CTA's items: cta, cta + ctas, ... in the order (sequence, v-head, V block), the V block fastest;
            # the order build takes the sequences longest first (order_s), so the short ones fill in behind the long
            # ones instead of a long one starting last and setting the kernel's time
            order_s = T.alloc_shared((2 * ORDER_MAX,), "int32") if order else None  # the order, then the lengths
            if order:  # compile time
                order_by_length(cu_seqlens, N, T.get_thread_binding(), order_s)
            ctas = T.min(N * Hv * NB, max_ctas)
            items = T.ceildiv(N * Hv * NB - cta, ctas)
            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            hk = T.alloc_var("int32")
            h = T.alloc_var("int32")
            n = T.alloc_var("int32")
            # the item's V block: its columns start at vb * BV, an expression the vectoriser can prove a multiple of
            # 8 (a variable holding the product could not be, and the O store fell back to scalar stores)
            vb = T.alloc_var("int32")
            it = T.alloc_var("int32")      # the item of the producer's chunk
            cb = T.alloc_var("int32")      # its first chunk among the CTA's
            chunks = T.alloc_var("int32")  # the CTA's chunks, over all its items
            chunks = 0
            for ii in T.serial(items):
                n = seq_at(order_s, (cta + ii * ctas) // (Hv * NB))
                if not output:  # compile time: the pre-pass's ranges are per (segment, v-head)
                    h = (cta + ii * ctas) // NB % Hv
                chunks = chunks + T.ceildiv(item_end(cu_seqlens, n) - item_start(cu_seqlens, start, fallback, n, h), C)
            if trans:  # compile time: v is unread (V = 0); its zero stages stand in, written once before any read
                for st_, i, j in T.Parallel(stages, C, BV):
                    v_s[st_, i, j] = T.cast(0, dt)
                T.sync_threads()
            tx = T.get_thread_binding()
            if tx >= PROD0:
                T.set_max_nreg(PRODUCER_REGS, 0)
                if tx < PROD0 + 32:
                    lane = tx - PROD0
                    gv = T.alloc_local((2,), "float32")
                    bv_ = T.alloc_local((2,), "float32")
                    up = T.alloc_local((1,), "float32")
                    last = T.alloc_local((1,), "float32")
                    it = 0
                    cb = 0
                    n = seq_at(order_s, cta // (Hv * NB))
                    h = cta // NB % Hv
                    vb = cta % NB
                    bos = item_start(cu_seqlens, start, fallback, n, h)
                    eos = item_end(cu_seqlens, n)
                    hk = h // (Hv // Hq)
                    # the item's head's -exp(A_log), dt_bias (gate_mode's GATE; made again when the item changes)
                    hp = T.alloc_local((2,), "float32")
                    hp[0] = 0.0
                    hp[1] = 0.0
                    if (gate_mode & GATE) != 0:
                        hp[0] = neg_rate(A_log[h])
                        hp[1] = head_bias(dt_bias[h], gate_mode)
                    for c in T.serial(chunks):
                        # the item that holds the CTA's chunk c (an item of no chunk is passed over)
                        while c - cb >= T.ceildiv(eos - bos, C):
                            cb = cb + T.ceildiv(eos - bos, C)
                            it = it + 1
                            n = seq_at(order_s, (cta + it * ctas) // (Hv * NB))
                            h = (cta + it * ctas) // NB % Hv
                            vb = (cta + it * ctas) % NB
                            bos = item_start(cu_seqlens, start, fallback, n, h)
                            eos = item_end(cu_seqlens, n)
                            hk = h // (Hv // Hq)
                            if (gate_mode & GATE) != 0:
                                hp[0] = neg_rate(A_log[h])
                                hp[1] = head_bias(dt_bias[h], gate_mode)
                        s = c % stages
                        t0 = bos + (c - cb) * C
                        # g / beta (strided: one 4-byte load per token) fetched before the wait for the stage
                        for u in T.unroll(2):
                            row = lane + u * 32
                            gv[u] = T.if_then_else(t0 + row < eos, g[t0 + row, h], 0.0)
                            bv_[u] = T.if_then_else(t0 + row < eos, beta[t0 + row, h], 0.0)
                            # FLA's activations (gate_act.py; a CTA-uniform branch), valid rows only
                            if (gate_mode & GATE) != 0 and t0 + row < eos:
                                gv[u] = gate_decay(gv[u], hp[0], hp[1])
                            if (gate_mode & BETA_SIGMOID) != 0 and t0 + row < eos:
                                bv_[u] = beta_act(bv_[u], gate_mode)
                        # gamma = the chunk-local cumsum of g (0 past the end, so it stays at the last value), in log2
                        # units: a scan across the lanes of each half, then the first half's total onto the second.
                        # The producer warp waits most of the time; the aux warpgroup's chunk is the critical path.
                        for u in T.unroll(2):
                            for d in T.unroll(5):
                                up[0] = T.tvm_warp_shuffle_up(FULL_MASK, gv[u], 1 << d, 32, 32)
                                if lane >= (1 << d):
                                    gv[u] = gv[u] + up[0]
                        gv[1] = gv[1] + T.tvm_warp_shuffle(FULL_MASK, gv[0], 31, 32, 32)
                        valid = T.min(eos - t0, C)
                        last[0] = T.tvm_warp_shuffle(FULL_MASK, T.if_then_else(valid > 32, gv[1], gv[0]),
                                                     (valid - 1) % 32, 32, 32)
                        T.barrier_wait(empty[s], (c // stages + 1) % 2)
                        # rows past T arrive as zeros; rows of the next sequence are never stored nor reach a valid row
                        if output:
                            T.tma_copy(q[t0:t0 + C, hk, :], q_s[s, :, :], barrier=full[s])
                        T.tma_copy(k[t0:t0 + C, hk, :], k_s[s, :, :], barrier=full[s])
                        if not trans:
                            T.tma_copy(v[t0:t0 + C, h, vb * BV:vb * BV + BV], v_s[s, :, :], barrier=full[s])
                        for u in T.unroll(2):
                            row = lane + u * 32
                            g_s[s, row] = gv[u] * LOG2E
                            b_s[s, row] = bv_[u]
                            eg_s[s, row] = T.exp2(gv[u] * LOG2E)
                            et_s[s, row] = T.if_then_else(row < valid, T.exp2((last[0] - gv[u]) * LOG2E), 0.0)
                        T.barrier_arrive(full[s])
            elif tx >= AUX0:
                T.set_max_nreg(AUX_REGS, int(AUX_REGS > 65536 // THREADS))
                tid = tx - AUX0
                kk = T.alloc_fragment((C, C), "float32")
                # Q K^T's accumulator (BV = 128: K K^T's, one at a time); none in the pre-pass builds
                qk = (T.alloc_fragment((C, C), "float32") if NC == 1 else kk) if output else None
                x = T.alloc_local((16,), "float32")
                dot = T.alloc_local((1,), "float32")
                xt = T.alloc_local((8,), "float32")
                yacc = T.alloc_local((8,), "float32")
                # |q_i|^2: Q Q^T's diagonal at BV = 64; at BV = 128 the aux has no registers for that accumulator, and a
                # row sum of q's tile (one thread a row, on the aux's critical path: ~15% slower at BV = 64) takes
                # its place
                qq = T.alloc_fragment((C, C), "float32") if l2norm and output and NC == 1 else None
                qv = T.alloc_local((8,), dt) if l2norm and output and NC > 1 else None
                gate = T.alloc_fragment((C, C), "float32")
                # Agb's blocks above the diagonal blocks are never written by the inverse: zero, once per stage
                for st_, i, j in T.Parallel(stages, C, C):
                    agb_s[st_, i, j] = T.cast(0, dt)
                for c in T.serial(chunks):
                    s = c % stages
                    T.barrier_wait(full[s], (c // stages) % 2)
                    T.wgmma_gemm(k_s[s, :, :], k_s[s, :, :], kk, transpose_B=True, clear_accum=True)
                    if NC == 1 and output:  # compile time
                        T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], qk, transpose_B=True, clear_accum=True)
                    # Gamma (lower triangle and diagonal) in the products' accumulator layout, into registers before
                    # any shared-memory store (ptxas keeps loads behind earlier stores: element by element otherwise)
                    # (unconditional loads, then a select on the exponent: exp2(-inf) = 0 above the diagonal)
                    for i, j in T.Parallel(C, C):
                        gate[i, j] = g_s[s, i] - g_s[s, j]
                    for i, j in T.Parallel(C, C):
                        gate[i, j] = T.exp2(T.if_then_else(i >= j, gate[i, j], -T.infinity("float32")))
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(kk, num_regs=C * C // 128)
                    if NC == 1 and output:
                        T.warpgroup_fence_operand(qk, num_regs=C * C // 128)
                    if l2norm:  # compile time
                        # use_qk_l2norm_in_kernel without a pass over the tiles: |k_i|^2 is K K^T's diagonal, |q_i|^2
                        # Q Q^T's (BV = 64) or a row sum of q's tile (BV = 128); the products take the factors as row /
                        # column scalings and the chain as per-token ones (eg, et by 1 / |k_i|, egq by 1 / |q_i|),
                        # exactly the normalised rows' algebra. The pre-pass builds need only |k_i|.
                        if output and NC == 1:  # compile time
                            T.wgmma_gemm(q_s[s, :, :], q_s[s, :, :], qq, transpose_B=True, clear_accum=True)
                            T.wait_wgmma(0)
                            T.warpgroup_fence_operand(qq, num_regs=C * C // 128)
                        if output and NC > 1:  # compile time
                            if tid < C:
                                dot[0] = 0.0
                                for d0 in T.serial(K // 8):
                                    for u in T.vectorized(8):
                                        qv[u] = q_s[s, tid, d0 * 8 + u]
                                    for u in T.unroll(8):
                                        dot[0] += T.cast(qv[u], "float32") * T.cast(qv[u], "float32")
                                rn_s[1, tid] = T.rsqrt(dot[0] + L2NORM_EPS)
                        for i, j in T.Parallel(C, C):
                            if i == j:
                                rn_s[0, i] = T.rsqrt(kk[i, j] + L2NORM_EPS)
                                if output and NC == 1:  # compile time
                                    rn_s[1, i] = T.rsqrt(qq[i, j] + L2NORM_EPS)
                        T.sync_threads(AUX_BARRIER, 128)
                        # every load before the stores below: row and column factors into the accumulators (Q K^T's,
                        # at BV = 128 made after K K^T's store in the same accumulator, where it is gated)
                        for i, j in T.Parallel(C, C):
                            kk[i, j] = kk[i, j] * (rn_s[0, i] * rn_s[0, j])
                            if output and NC == 1:  # compile time
                                qk[i, j] = qk[i, j] * (rn_s[1, i] * rn_s[0, j])
                        if tid < C:
                            if output:  # compile time
                                egq_s[s, tid] = eg_s[s, tid] * rn_s[1, tid]
                            eg_s[s, tid] = eg_s[s, tid] * rn_s[0, tid]
                            et_s[s, tid] = et_s[s, tid] * rn_s[0, tid]
                    # The gated K K^T: the inverse of I + strictLower(diag(beta) (Gamma * K K^T)) is Gamma * A (the
                    # gate-free inverse, gated), so Agb below is one column scaling; Gamma <= 1 below the diagonal (no
                    # overflow). The solve never reads the diagonal. P = scale * Gamma * tril(Q K^T), rounded once.
                    for i, j in T.Parallel(C, C):
                        kk[i, j] = kk[i, j] * gate[i, j]
                    store_gated_kkt(kk, gm_s, kk_s, tid, dtype, SCRATCH_COLS)
                    if NC > 1:  # the accumulator stored, then reused for Q K^T
                        T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], qk, transpose_B=True, clear_accum=True)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(qk, num_regs=C * C // 128)
                    if output:  # compile time
                        if l2norm and NC > 1:  # compile time
                            for i, j in T.Parallel(C, C):
                                qk[i, j] = qk[i, j] * gate[i, j] * (scale * rn_s[1, i] * rn_s[0, j])
                        else:
                            for i, j in T.Parallel(C, C):
                                qk[i, j] = qk[i, j] * gate[i, j] * scale
                        # P rounded and stored by stmatrix (four a thread where 4-byte stores took sixteen)
                        for jj in T.unroll(C // 16):
                            row, col = block_rows(tid % 32, 16 * (tid // 32), 16 * jj)
                            T.call_extern("handle", "fqla_stsm_" + dtype, T.address_of(p_s[s, row, col]), qk.data,
                                          jj)
                    T.sync_threads(AUX_BARRIER, 128)  # gm_s, kk_s
                    # Agb = (Gamma * A) diag(beta) made block by block from G and the Agb blocks before it
                    invert_gated(kk_s, gm_s, b_s, s, agb_s, s, x, dot, xt, yacc, tid, dtype, AUX_BARRIER,
                                 PAIR_BARRIER)
                    T.fence_proxy_async()  # generic-proxy writes, then the consumers' tensor-core (async proxy) reads
                    T.barrier_arrive(ready[s])
            else:
                T.set_max_nreg(CONSUMER_REGS, 1)
                ct = tx
                wg = ct // 128 if NC > 1 else 0
                st = T.alloc_fragment((BV, K), "float32")
                # the bf16 state, the A operand of K S and Q S: registers at BV = 64, shared memory at BV = 128 (the
                # 32 registers it frees leave the aux warpgroup enough)
                st_b = T.alloc_fragment((BV, K), dt) if NC == 1 else stb_s
                kst = T.alloc_fragment((BV, C), "float32")
                qst = T.alloc_fragment((BV, C), "float32") if output else None
                wt = T.alloc_fragment((BV, C), dt)
                vnt = T.alloc_fragment((BV, C), "float32")
                vnt_b = T.alloc_fragment((BV, C), dt) if output else None
                vdt_b = T.alloc_fragment((BV, C), dt)

                egl = T.alloc_local((1,), "float32")
                srow = T.alloc_var("int32")  # h0's / ht's row: the sequence, or its pool slot (negative: none)
                cc = T.alloc_var("int32")    # the CTA's chunks done: stage and barrier phase
                cc = 0
                for ci in T.serial(items):
                    n = seq_at(order_s, (cta + ci * ctas) // (Hv * NB))
                    h = (cta + ci * ctas) // NB % Hv
                    vb = (cta + ci * ctas) % NB
                    bos = item_start(cu_seqlens, start, fallback, n, h)
                    eos = item_end(cu_seqlens, n)
                    if PREFETCH_NEXT_STATE and output and use_h0 != 0 and ci + 1 < items:
                        # the next item's initial state into L2 while this one runs (its load then hits L2). Not for
                        # a K-first state that is one 64 x 64 or 128 x 128 block (one V block): there about a third of
                        # the prefetched bytes were read from DRAM twice and the short batches ran 7-10% slower with
                        # it (H100); K-first V blocks (K rows of BV floats) and V-first states ran 2-19% slower without
                        nxt = cta + (ci + 1) * ctas
                        nn = seq_at(order_s, nxt // (Hv * NB))
                        prow = T.if_then_else((state_mode & READ_INDEXED) != 0, state_idx[nn], nn)
                        if prow >= 0 and prow < H0R:
                            if (state_mode & V_FIRST) != 0:  # its rows are one contiguous block
                                if ct == 0:
                                    T.call_extern("handle", "fqla_prefetch_l2",
                                                  T.address_of(h0[prow, nxt // NB % Hv, nxt % NB * BV * K]),
                                                  BV * K * 4)
                            elif NB > 1 and ct < K:  # [K, V] with V blocks: K rows of BV floats
                                T.call_extern("handle", "fqla_prefetch_l2",
                                              T.address_of(h0[prow, nxt // NB % Hv, ct * V + nxt % NB * BV]), BV * 4)
                    srow = T.if_then_else((state_mode & READ_INDEXED) != 0, state_idx[n], n)
                    if trans:  # compile time: S = I (V = K), S^T's rows the block's columns of the identity
                        for d, kk_ in T.Parallel(BV, K):
                            st[d, kk_] = T.if_then_else(kk_ == vb * BV + d, 1.0, 0.0)
                    elif not output or use_h0 == 0 or srow < 0:
                        T.clear(st)
                    elif (state_mode & V_FIRST) != 0:
                        for d, kk_ in T.Parallel(BV, K):
                            st[d, kk_] = h0[srow, h, (vb * BV + d) * K + kk_]
                    else:
                        for d, kk_ in T.Parallel(BV, K):
                            st[d, kk_] = h0[srow, h, kk_ * V + vb * BV + d]
                    for c in T.serial(T.ceildiv(eos - bos, C)):
                        s = cc % stages
                        t0 = bos + c * C
                        valid = T.min(eos - t0, C)
                        T.copy(st, st_b)
                        if NC > 1:  # this warpgroup's rows of st_b, then its tensor-core (async proxy) reads
                            T.fence_proxy_async()
                            T.sync_threads(STATE_BARRIER + wg, 128)
                        T.barrier_wait(ready[s], (cc // stages) % 2)
                        # S K^T and S Q^T together: the second runs while W is made from the first
                        T.wgmma_gemm(st_b, k_s[s, :, :], kst, transpose_B=True, clear_accum=True,
                                     policy=T.GemmWarpPolicy.FullRow)
                        if output:  # compile time
                            T.wgmma_gemm(st_b, q_s[s, :, :], qst, transpose_B=True, clear_accum=True,
                                         policy=T.GemmWarpPolicy.FullRow)
                            T.wait_wgmma(1)
                        else:
                            T.wait_wgmma(0)
                        T.warpgroup_fence_operand(kst, num_regs=C // 2)
                        lane = ct % 32
                        for jj in T.unroll(C // 16):
                            row, col = block_cols(lane, 16 * jj, 16 * (ct % 128 // 32))
                            T.call_extern("handle", "fqla_wt_" + dtype, T.address_of(v_s[s, row, wg * 64 + col]),
                                          T.address_of(eg_s[s, 0]), kst.data, wt.data, jj, lane)
                        T.wgmma_gemm(wt, agb_s[s, :, :], vnt, transpose_B=True, clear_accum=True,
                                     policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(vnt, num_regs=C // 2)
                        for d, i in T.Parallel(BV, C):
                            if output:
                                vnt_b[d, i] = T.cast(vnt[d, i], dt)
                            vdt_b[d, i] = T.cast(vnt[d, i] * et_s[s, i], dt)
                        if l2norm:  # the chunk's total decay (eg_s carries 1 / |k|)
                            egl[0] = T.exp2(g_s[s, valid - 1])
                        else:
                            egl[0] = eg_s[s, valid - 1]
                        for d, kk_ in T.Parallel(BV, K):
                            st[d, kk_] = st[d, kk_] * egl[0]
                        if output:  # compile time
                            T.warpgroup_fence_operand(qst, num_regs=C // 2)
                            for d, i in T.Parallel(BV, C):
                                qst[d, i] = qst[d, i] * (egq_s[s, i] * scale)
                            # O's product first: O leaves while the state update runs
                            T.wgmma_gemm(vnt_b, p_s[s, :, :], qst, transpose_B=True,
                                         policy=T.GemmWarpPolicy.FullRow)
                            T.wgmma_gemm(vdt_b, k_s[s, :, :], st, policy=T.GemmWarpPolicy.FullRow)
                            T.wait_wgmma(1)
                            T.warpgroup_fence_operand(qst, num_regs=C // 2)
                            # O staged in o_s and stored by one TMA store a warpgroup (its own 64 columns); a
                            # sequence's partial last chunk by 16-byte stores of its valid rows (a box would write the
                            # next sequence's). At BV = 128 the barrier below also orders the chunk's tensor-core reads
                            # of st_b before the next chunk's writes.
                            if cc > 0:
                                if ct % 128 == 0:  # the previous chunk's TMA store has read its rows
                                    T.tma_store_wait(0)
                                T.sync_threads(OUT_BARRIER + wg, 128)  # the previous chunk's O rows have left o_s
                            # O^T's blocks stored transposed: o_s's rows are O's (tokens)
                            for jj in T.unroll(C // 16):
                                row, col = block_cols(lane, 16 * jj, 16 * (ct % 128 // 32))
                                T.call_extern("handle", "fqla_stsm_t_" + dtype,
                                              T.address_of(o_s[wg * C + row, col]), qst.data, jj)
                            T.fence_proxy_async()
                            T.sync_threads(OUT_BARRIER + wg, 128)
                            if valid == C:
                                if ct % 128 < 32:  # one elected thread, the one that waits for it above
                                    T.tma_copy(o_s[wg * C:wg * C + C, :],
                                               o[t0:t0 + C, h, vb * BV + wg * 64:vb * BV + wg * 64 + 64],
                                               leader_scope_threads=32)
                            else:
                                col = ct % 8 * 8
                                for ps in T.unroll(C // OUT_ROWS_PER_PASS):
                                    row = ps * OUT_ROWS_PER_PASS + (ct % 128 if NC > 1 else ct) // 8
                                    if row < valid:
                                        for u in T.vectorized(8):
                                            o[t0 + row, h, vb * BV + wg * 64 + col + u] = o_s[wg * C + row,
                                                                                                col + u]
                        else:  # the pre-pass builds: the state update alone
                            T.wgmma_gemm(vdt_b, k_s[s, :, :], st, policy=T.GemmWarpPolicy.FullRow)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(st, num_regs=K // 2)
                        T.barrier_arrive(empty[s])  # every read of the stage is done (the products waited for)
                        cc = cc + 1
                    if not output:  # compile time: the pre-pass's per-segment results, internal [S, Hv, K, V]
                        if not trans or fallback[n, h] != 0:  # (gdn_cp_combine reads no other head's transition)
                            for d, kk_ in T.Parallel(BV, K):
                                ht[n, h, kk_ * V + vb * BV + d] = st[d, kk_]
                    srow = T.if_then_else((state_mode & WRITE_INDEXED) != 0, state_idx[n], n)
                    if output and store_ht != 0 and srow >= 0:
                        if (state_mode & V_FIRST) != 0:
                            for d, kk_ in T.Parallel(BV, K):
                                ht[srow, h, (vb * BV + d) * K + kk_] = st[d, kk_]
                        else:
                            for d, kk_ in T.Parallel(BV, K):
                                ht[srow, h, kk_ * V + vb * BV + d] = st[d, kk_]
                if output and ct % 128 == 0:  # o_s stays until the last TMA store has read it
                    T.tma_store_wait(0)

    return gdn_fwd_fused
