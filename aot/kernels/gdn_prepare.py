"""Everything of the GDN forward that depends on neither V nor the state, once per (chunk, v-head).

Per 64-token chunk with gamma the chunk-local cumsum of g, Gamma_ij = exp(gamma_i - gamma_j) (i >= j):
  A    = (I + strictLower(diag(beta) K K^T))^-1, the gate-free inverse (FlashQLA's A; stored on request, or
         read instead of solved when the caller has it: the A = "read" builds),
  Agb  = Gamma * A * beta_col                       (the gate re-applied elementwise: never overflows),
  P    = scale * Gamma * tril(Q K^T),
  eg   = exp(gamma_i), et = exp(gamma_last - gamma_i) (0 past the sequence end), gamma itself (the cumsum of g,
         or g itself when the caller passes the cumsum: g_is_cumsum) and
  the chunk's largest beta_i |k_i|^2 (the diagonal of diag(beta) K K^T; 3 for a negative beta: intra-card
  CP's warm-up bound needs every token's 0 <= beta |k|^2 <= 2).
The recurrence kernel (gdn_fwd_chain) then keeps only the state-dependent chain. One CTA of one warpgroup per
(chunk, group of up to four v-heads reading the same q / k head: the chunk lookup, the q / k tiles (TMA), the
optional l2norm of their rows, g / beta and both 64 x 64 x K products are shared by the group; beta scales
K K^T's rows per head). Chunks are numbered across the packed batch (chunk_offsets[n] = first chunk of
sequence n, a device-side cumsum of ceil(len / 64)); nothing is read on the host.
gate_mode (aot/kernels/gate_act.py): FLA's use_gate_in_kernel / use_beta_sigmoid_in_kernel applied to g / beta as they
are loaded, before everything above (the backward's recompute runs this kernel with the same mode).
Layouts: Agb, P, A are [T, Hv, 64] (rows of each chunk); eg, et, gamma live head-major in 256-byte-aligned
64-slot tiles per chunk, [Hv, chunk slot * 64 + row], so the forward streams each as one TMA tile.

The inverse: chunk_inverse.py (blocked, 3xTF32 tensor-core products, one warpgroup). The "read" builds (the
backward given the forward's A) have no solve and keep only K K^T's diagonal (35 KB of shared memory instead of
52), and each thread's A rows for a head are loaded at once: one at a time, each waited for by its own stores,
the stage ran at ~2.4 TB/s (hk16_hv32 32k: 0.282 -> 0.231 ms, H200).
"""
import tilelang.language as T

from .chunk_inverse import SCRATCH_COLS, invert_chunk, scratch_layout
from .common import L2NORM_EPS, last_at_most
from .gate_act import BETA_SIGMOID, GATE, beta_act, gate_log
from .tile_rows import l2norm_row

C = 64
B = 16            # diagonal block of the blocked inverse (chunk_inverse.py)
HPC_MAX = 4       # v-heads per CTA at most (flash_qla/planner.py picks how many, a divisor of Hv / Hq)
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128], "A": ["solve", "read"]}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
THREADS = 128     # one warpgroup: the two 64 x 64 x K products are single wgmmas
# Liveness-based shared-memory reuse (the q / k tiles give way to K K^T, Q K^T and the inverse): 52 KB instead
# of 85 KB, four CTAs per SM instead of two. Safe here because every buffer that takes another's place is
# first written in a statement after a CTA barrier that follows the last read of the other (unlike a
# warp-specialised pipeline, where the producer writes while consumers read: gdn_bwd_recompute must not use it).
PASS_CONFIGS = {"tl.enable_aggressive_shared_memory_merge": True,
                # Every CTA barrier is written out below. TileLang's own pass added three more per head where it
                # could not prove disjoint blocks of one buffer disjoint, two of them 64-thread named barriers
                # inside warp-divergent branches (compute-sanitizer racecheck then reported false hazards
                # between the two halves of the warpgroup)
                "tl.disable_thread_storage_sync": True}
H = C // 2        # a warp's lanes: bkk_max reduces the 64 rows as two per lane of warp 0
ROWS_PER_PASS = THREADS // 8   # output stores: 8 threads cover a row (8 columns, 16 bytes each)
LOG2E = 1.4426950408889634


@T.macro
def load_a_rows(A, avs, t0, h, valid, c0):
    """avs[ps] = the caller's A, head h, row ps * ROWS_PER_PASS + tid / 8, columns c0..c0+7 (valid rows only)."""
    for ps in T.unroll(C // ROWS_PER_PASS):
        row = ps * ROWS_PER_PASS + T.get_thread_binding() // 8
        if row < valid:
            for u in T.vectorized(8):
                avs[ps, u] = A[t0 + row, h, c0 + u]


def build(dtype: str, K: int, A: str = "solve"):
    dt = DTYPES[dtype]
    read = A == "read"  # compile time: the caller's A is read, nothing solved
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")
    Hv = T.dynamic("Hv")
    N = T.dynamic("N")
    TC = T.dynamic("TC")  # chunk slots x 64

    @T.prim_func
    def gdn_prepare(
        q: T.Tensor((NT, Hq, K), dt),
        k: T.Tensor((NT, Hq, K), dt),
        g: T.Tensor((NT, Hv), "float32"),
        beta: T.Tensor((NT, Hv), "float32"),
        # gate_mode's per-head parameters (aot/kernels/gate_act.py; unread without GATE / GATE_BIAS)
        A_log: T.Tensor((Hv,), "float32"),
        dt_bias: T.Tensor((Hv,), "float32"),
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        A: T.Tensor((NT, Hv, C), dt),
        agb: T.Tensor((NT, Hv, C), dt),
        p: T.Tensor((NT, Hv, C), dt),
        qn: T.Tensor((NT, Hq, K), dt),
        kn: T.Tensor((NT, Hq, K), dt),
        # with l2norm: each q (0) / k (1) row's factor (|x|^2 + eps)^-1/2, at its chunk slot's row (slot * 64 + row)
        rn: T.Tensor((2, Hq, TC), "float32"),
        eg_t: T.Tensor((Hv, TC), "float32"),
        et_t: T.Tensor((Hv, TC), "float32"),
        gam_t: T.Tensor((Hv, TC), "float32"),
        bkk_max: T.Tensor((Hv, TC // C), "float32"),
        slot_rows: T.Tensor((TC // C, 2), "int32"),
        # store_beta (the backward's recompute under BETA_SIGMOID): each valid row's activated beta, which
        # gdn_bwd_chunk then reads (its plain build applies no activation)
        beta_out: T.Tensor((NT, Hv), "float32"),
        scale: T.float32,
        write_a: T.int32,
        hpc: T.int32,
        l2norm: T.int32,
        g_is_cumsum: T.int32,
        gate_mode: T.int32,
        store_beta: T.int32,
    ):
        # grid x covers an upper bound of the chunk count (ceil(T / 64) + N); extra CTAs exit.
        # grid y: groups of hpc consecutive v-heads, all reading the same q / k head
        with T.Kernel(T.ceildiv(NT, C) + N, Hv // hpc, threads=THREADS) as (bc, hg):
            # four CTAs per SM (shared memory allows four; reading A, 35 KB, up to six with the whole carveout): at
            # most 128 registers per thread. Five reading A (102 registers) spilled and ran 2-6% slower than four
            # (H200)
            T.annotate_min_blocks_per_sm(4)
            q_s = T.alloc_shared((C, K), dt)
            k_s = T.alloc_shared((C, K), dt)
            kk = T.alloc_fragment((C, C), "float32")
            qk = T.alloc_fragment((C, C), "float32")
            # K K^T and scale Q K^T, shared by the group's heads: beta scales K K^T's rows and the gate
            # multiplies both per head. Padded rows: the MMA-layout stores hit 4-8-way bank conflicts without (ncu);
            # K K^T and the inverse in chunk_inverse.scratch_layout (reading A: only K K^T's diagonal |k_i|^2, for
            # bkk_max)
            kk_s = T.alloc_shared((C, 1) if read else (C, SCRATCH_COLS), "float32")
            qk_s = T.alloc_shared((C, C + 8), dt)
            if not read:
                ainv = T.alloc_shared((C, SCRATCH_COLS), "float32")
                T.annotate_layout({kk_s: scratch_layout(), ainv: scratch_layout()})
                # L_rc A_cc of the current step, read as the products' B operand: rows padded to 40 words, so the
                # fragment loads (4 rows x 8 columns per instruction) hit 32 different banks
                tmp = T.alloc_shared((2 * B, 2 * B + 8), "float32")
            graw = T.alloc_shared((HPC_MAX, C), "float32")
            gam = T.alloc_shared((HPC_MAX, C), "float32")
            b_s = T.alloc_shared((HPC_MAX, C), "float32")
            x = T.alloc_local((B,), "float32")
            out = T.alloc_local((2,), "float32")
            acc = T.alloc_local((8,), "float32")  # a warp's 16 x 16 product tile (m16n8 accumulator layout)
            ahi = T.alloc_local((4,), "float32")
            alo = T.alloc_local((4,), "float32")
            bhi = T.alloc_local((2,), "float32")
            blo = T.alloc_local((2,), "float32")
            csum = T.alloc_local((HPC_MAX // 2,), "float32")
            vals = T.alloc_local((8,), dt)
            pvals = T.alloc_local((8,), dt)
            qv = T.alloc_local((8,), dt)
            a8 = T.alloc_local((8,), "float32")
            # reading A: this thread's row segments of the caller's A for one head, all four passes' loads issued
            # together (one at a time, each waited for by its pass's stores, left ~8 KB in flight per SM)
            avs = T.alloc_local((C // ROWS_PER_PASS, 8), dt)
            l2n = T.alloc_local((8,), dt)
            nrm = T.alloc_local((2,), "float32")
            gcol = T.alloc_local((8,), "float32")
            bcol = T.alloc_local((8,), "float32")
            gb = T.alloc_local((2,), "float32")  # a loaded g, beta (activated in registers with gate_mode)
            gp = T.alloc_local((2,), "float32")  # its head's A_log, dt_bias (GATE)
            loaded = T.alloc_barrier(THREADS)
            seq = T.alloc_local((2,), "int32")  # the binary search's bounds; seq[0]: this chunk's sequence
            t0 = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            hk = T.alloc_var("int32")
            dot = T.alloc_local((1,), "float32")
            wmax = T.alloc_var("float32")

            seq[1] = N
            last_at_most(chunk_offsets, bc, seq)  # this chunk's sequence
            if bc < chunk_offsets[N]:
                t0 = cu_seqlens[seq[0]] + (bc - chunk_offsets[seq[0]]) * C
                eos = cu_seqlens[seq[0] + 1]
                hk = hg * hpc // (Hv // Hq)  # in a register: inlined, the division repeats per loaded element
                valid = T.min(eos - t0, C)
                tid = T.get_thread_binding()
                if hg == 0 and tid == 0:
                    # the chunk's first row and valid rows, for gdn_bwd_chunk (one load instead of this search)
                    slot_rows[bc, 0] = t0
                    slot_rows[bc, 1] = valid
                # Unmasked q / k tiles: rows past the sequence end (the next sequence's, or zero past T) only
                # reach rows >= valid of K K^T, Q K^T and A, which are never stored nor read by valid rows.
                # Both tiles by TMA (one elected thread; rows past T arrive as zeros) while every thread
                # fetches beta and g: the per-thread copy with bounds checks was ~19% of the instructions (ncu)
                T.tma_copy(k[t0:t0 + C, hk, :], k_s, barrier=loaded[0])
                T.tma_copy(q[t0:t0 + C, hk, :], q_s, barrier=loaded[0])
                T.barrier_arrive(loaded[0])
                # the group's beta and g, [head, row]; neighbouring threads read neighbouring heads of a row
                for it in T.serial(T.ceildiv(C * hpc, THREADS)):
                    idx = it * THREADS + tid
                    if idx < C * hpc:
                        row = idx // hpc
                        hj = idx % hpc
                        gb[0] = T.if_then_else(row < valid, g[t0 + row, hg * hpc + hj], 0.0)
                        gb[1] = T.if_then_else(row < valid, beta[t0 + row, hg * hpc + hj], 0.0)
                        # the head's parameters in the same round trip (as a load behind the mode's branch they
                        # were a second one; their stand-in addresses are valid in every mode)
                        gp[0] = A_log[hg * hpc + hj]
                        gp[1] = dt_bias[hg * hpc + hj]
                        # FLA's activations (gate_act.py) before gamma's cumsum, the inverse and bkk_max: beta is
                        # then in (0, 2), inside the CP bound's range; rows past the end stay 0
                        if (gate_mode & GATE) != 0 and row < valid:
                            gb[0] = gate_log(gb[0], gp[0], gp[1], gate_mode)
                        if (gate_mode & BETA_SIGMOID) != 0 and row < valid:
                            gb[1] = beta_act(gb[1], gate_mode)
                        b_s[hj, row] = gb[1]
                        graw[hj, row] = gb[0]
                        if store_beta != 0 and row < valid:
                            beta_out[t0 + row, hg * hpc + hj] = gb[1]
                T.mbarrier_wait_parity(loaded[0], 0)
                if l2norm != 0:
                    # use_qk_l2norm_in_kernel: x / sqrt(sum x^2 + eps) per row, in fp32, rounded to the input dtype
                    # in place (threads 0-63: k rows, 64-127: q rows); the k-head's first CTA of the chunk also
                    # stores the valid rows for the recurrence kernels, so no separate pass reads q / k
                    row = tid % C
                    store = hg * hpc % (Hv // Hq) == 0 and row < valid
                    if tid < C:
                        l2norm_row(k_s, row, K, L2NORM_EPS, l2n, nrm, kn, t0 + row, hk, store, rn, 1, bc * C + row)
                    else:
                        l2norm_row(q_s, row, K, L2NORM_EPS, l2n, nrm, qn, t0 + row, hk, store, rn, 0, bc * C + row)
                    T.fence_proxy_async()  # generic-proxy writes, then the tensor cores' (async proxy) reads
                    T.sync_threads()
                # both products on the tensor cores while the CUDA cores sum gamma (waited for below)
                T.wgmma_gemm(k_s, k_s, kk, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(q_s, k_s, qk, transpose_B=True, clear_accum=True)
                T.sync_threads()  # beta / g in shared memory
                # gamma_i: thread (tid % 64) sums its prefix in order (the serial cumsum's rounding, no 64-step
                # chain through shared memory), the two halves of the warpgroup take alternate heads;
                # past the end gamma stays at the last value. g_is_cumsum: g already is the chunk-local cumsum
                # (FlashQLA's low-level backward passes it so), taken as it is
                for jj in T.unroll(HPC_MAX // 2):
                    hj = jj * 2 + tid // C
                    csum[jj] = 0.0
                    if hj < hpc:
                        if g_is_cumsum != 0:
                            csum[jj] = graw[hj, T.min(tid % C, valid - 1)]
                        else:
                            for j in T.unroll(C):
                                if j <= tid % C:
                                    csum[jj] += graw[hj, j]
                # every read of graw before any write of gam (the shared-memory merge may let gam take its place)
                T.sync_threads()
                for jj in T.unroll(HPC_MAX // 2):
                    hj = jj * 2 + tid // C
                    if hj < hpc:
                        gam[hj, tid % C] = csum[jj]
                T.wait_wgmma(0)
                # no use of the accumulators may move above the wait (C * C / THREADS registers each)
                T.warpgroup_fence_operand(kk, num_regs=C * C // THREADS)
                T.warpgroup_fence_operand(qk, num_regs=C * C // THREADS)
                # every warp's products done before kk_s / qk_s (which may take q_s / k_s's place) are written
                T.sync_threads()
                # Unmasked: the solve reads K K^T only below the diagonal (the diagonal, |k|^2, rides along for
                # bkk_max), and the upper triangles are zeroed on the way out
                for i, j in T.Parallel(C, C):
                    if read:
                        if i == j:
                            kk_s[i, 0] = kk[i, j]
                    else:
                        kk_s[i, j] = kk[i, j]
                    qk_s[i, j] = T.cast(qk[i, j] * scale, dt)
                c0 = tid % 8 * 8     # output columns of this thread
                T.sync_threads()
                for hj in T.serial(hpc):
                    h = hg * hpc + hj
                    # reading A: the forward's gate-free inverse (FlashQLA's low-level backward passes it in) is
                    # read row by row below instead of solved again
                    if read:
                        load_a_rows(A, avs, t0, h, valid, c0)
                    else:
                        invert_chunk(kk_s, b_s, hj, ainv, tmp, x, dot, acc, ahi, alo, bhi, blo, tid)
                    # outputs: 8 threads per row, 16 bytes each, so a warp stores four whole 128-byte rows
                    # (the former 2-threads-per-row order used half of every stored sector, ncu)
                    for u in T.unroll(8):
                        gcol[u] = gam[hj, c0 + u]
                        bcol[u] = b_s[hj, c0 + u]
                    for ps in T.unroll(C // ROWS_PER_PASS):
                        row = ps * ROWS_PER_PASS + tid // 8
                        if row < valid:
                            gr = gam[hj, row]
                            if read:
                                for u in T.unroll(8):
                                    a8[u] = T.cast(avs[ps, u], "float32")
                            else:
                                for half in T.unroll(2):
                                    for u in T.vectorized(4):
                                        a8[half * 4 + u] = ainv[row, c0 + half * 4 + u]
                            for u in T.vectorized(8):
                                qv[u] = qk_s[row, c0 + u]
                            for u in T.unroll(8):
                                # Gamma_ij (upper triangle possibly inf: never selected)
                                gate = T.exp2((gr - gcol[u]) * LOG2E)
                                vals[u] = T.if_then_else(row >= c0 + u, T.cast(a8[u] * gate * bcol[u], dt), T.cast(0, dt))
                                pvals[u] = T.if_then_else(row >= c0 + u, T.cast(T.cast(qv[u], "float32") * gate, dt),
                                                          T.cast(0, dt))
                            for u in T.vectorized(8):
                                agb[t0 + row, h, c0 + u] = vals[u]
                            for u in T.vectorized(8):
                                p[t0 + row, h, c0 + u] = pvals[u]
                            if not read and write_a != 0:
                                for u in T.unroll(8):
                                    vals[u] = T.if_then_else(row >= c0 + u, T.cast(a8[u], dt), T.cast(0, dt))
                                for u in T.vectorized(8):
                                    A[t0 + row, h, c0 + u] = vals[u]
                    # every slot of the chunk's tile is written: the forward reads all 64
                    if tid < C:
                        eg_t[h, bc * C + tid] = T.exp2(gam[hj, tid] * LOG2E)
                        et_t[h, bc * C + tid] = T.if_then_else(
                            tid < valid, T.exp2((gam[hj, valid - 1] - gam[hj, tid]) * LOG2E), 0.0)
                        gam_t[h, bc * C + tid] = gam[hj, tid]
                    # beta |k|^2 per token, reduced to the chunk's largest by one warp (two rows per lane): whether a
                    # token's factor (I - beta k k^T) can expand the state (flash_qla/cp.py); 3 for a negative beta,
                    # -1 past the end. (No shared scratch: the merge placed a former one on a live buffer.)
                    if tid < H:
                        for u in T.unroll(2):
                            out[u] = T.if_then_else(
                                tid + u * H < valid,
                                T.if_then_else(b_s[hj, tid + u * H] < 0, 3.0,
                                               b_s[hj, tid + u * H]
                                               * kk_s[tid + u * H, 0 if read else tid + u * H]), -1.0)
                        wmax = T.warp_reduce_max(T.max(out[0], out[1]))
                        if tid == 0:
                            bkk_max[h, bc] = wmax
                    # the next head's solve overwrites ainv
                    T.sync_threads()
            elif hg == 0 and T.get_thread_binding() == 0:  # a slot past the last chunk: no rows
                slot_rows[bc, 0] = 0
                slot_rows[bc, 1] = 0

    return gdn_prepare
