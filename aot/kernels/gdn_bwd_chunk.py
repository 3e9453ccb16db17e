"""The chunk-parallel half of the GDN backward, fused: dq, dk, dbeta, dg per (chunk, v-head).

Inputs are what the recompute pass (gdn_prepare, gdn_bwd_recompute save build) and the reverse recurrence
(gdn_bwd_dh) left in memory: A (gate-free inverse), gamma, the chunk's entering state S and leaving-state
gradient dS', W, Vnew, X = dL/dVnew, dW = dL/dV and dO. The math is
flash_qla/chunk_grads.py's (the float64-tested specification); per chunk, V in blocks of BV:
    dq  = scale eg * (dO S^T) + dPs K              dPs  = scale Gamma * tril(dO Vnew^T)
    dk  = -eg * (dW S^T) + et * (Vnew dS'^T) + dPs^T Q + dLb K + dLb^T K
    dAgb = tril(X W^T), dA = dAgb Gamma beta_col, dL = -strictLower(A^T dA A^T), dLb = beta_row dL
    dbeta_j = sum_i dAgb Gamma A (col) + sum_j dL K K^T (row)
    dgamma  = the exp factors' row / column sums; gamma_last takes et's and eg_last's; dg = reverse cumsum.
The factors that are exactly 1 (Gamma's diagonal, the last row's et) have no gamma term and stay out of those sums:
summed and cancelled in fp32 they leave an absolute error of the terms' size (~1e-6), which under strong decay
(g of -30 per token and below) is far above dg itself, in FLA's relative measure a 60x error.
Rows past the sequence end hold the next sequence's (finite) rows: every C x C term is masked to the
valid causal pairs and row outputs are stored for valid rows only. Each (chunk, q/k head) item walks the
GVA group's v-heads in order and sums their dq / dk in shared memory, so the group reduction costs no
extra pass over memory and is deterministic.
The kernel is persistent: `ctas` CTAs (one per SM; the host passes min(SMs, items)) walk the (chunk slot, q/k head)
items round-robin. Each item's first two V blocks are loaded under the previous item's epilogue (each head's under the
previous head's), its q / k tiles under its first V blocks (first needed by head 0's epilogue), and the next item's
chunk lookup under its work: as one CTA per item, an SM spent ~2 us between CTAs and ~1.5 us waiting for each CTA's
first tiles (clock stamps, hk16_hv32 32k_1seq: 26 us an item). A whole chunk's dq / dk (no l2norm) are rounded into
q_s / k_s and stored by TMA, which the next item runs beside; a row-store loop there took ~9% of an item (5-6% of
the kernel on an H100). Partial chunks keep the row loop (rows past a sequence end are another item's).
use_qk_l2norm_in_kernel (l2norm != 0): q / k above are the normalised rows y = x r, r = (|x|^2 + eps)^-1/2, and the
epilogue turns the group's summed dy into dx = r (dy - y (y . dy)) = r dy - r^3 x (x . dy) in fp32 before the single
rounding to the input dtype: no separate pass, no autograd. A whole chunk does it in the accumulator layout from y
(still in q_s / k_s) and gdn_prepare's stored r, then takes the TMA store; a partial chunk's row loop does it from
the raw rows (one warp per row, r recomputed).
FLA's gate / beta activations (use_gate_in_kernel, use_beta_sigmoid_in_kernel) stay out of this kernel:
aot/kernels/gdn_gate_bwd.py activates beta before it and turns dg / dbeta into the raw inputs' gradients after it
(inside, at 255 registers with spills, that code cost 11-16% of this kernel on an H100).
"""
import tilelang.language as T

from .block_fragments import block_rows
from .chunk_passes import LOG2E, PRELUDE as PASSES_PRELUDE, block_origin
from .common import L2NORM_EPS
from .fragment_io import PRELUDE as FRAGMENT_PRELUDE
from .fragment_sums import PRELUDE as SUMS_PRELUDE, col_total, row_total
from .workspaces import use_canonical_workspaces

C = 64
BV = 32   # V block: two buffers of its seven tiles fit, so block b + 1 loads while block b computes
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128], "V": [64, 128, 256]}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
THREADS = 256
WARPS = THREADS // 32
# Every CTA barrier is written out below, each naming what it orders. TileLang's own pass put ~30 in each head's
# epilogue (one before and one after every cross-warp reduction, whose own barriers already order its workspace).
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}
PRELUDE = FRAGMENT_PRELUDE + SUMS_PRELUDE + PASSES_PRELUDE


def build(dtype: str, K: int, V: int):
    # seven reductions share out seven workspaces in an order TileLang 0.1.15 does not keep from one lowering to the
    # next: put in a canonical order, every build of this source gives the same cubin (aot/kernels/workspaces.py)
    use_canonical_workspaces()
    dt = DTYPES[dtype]
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")
    Hv = T.dynamic("Hv")
    TC = T.dynamic("TC")

    @T.macro
    def load_block(do, w, vnew, x, dv, hs, dhs, do_s, w_s, vn_s, x_s, dw_s, h_s, dh_s, loaded, b, t0, bc, h, v0):
        """The seven tiles of v-head h's V block at v0 into buffer b, by TMA on its mbarrier loaded[b] (arrival left
        to the caller)."""
        T.tma_copy(do[t0:t0 + C, h, v0:v0 + BV], do_s[b, :, :], barrier=loaded[b])
        T.tma_copy(w[t0:t0 + C, h, v0:v0 + BV], w_s[b, :, :], barrier=loaded[b])
        T.tma_copy(vnew[t0:t0 + C, h, v0:v0 + BV], vn_s[b, :, :], barrier=loaded[b])
        T.tma_copy(x[t0:t0 + C, h, v0:v0 + BV], x_s[b, :, :], barrier=loaded[b])
        T.tma_copy(dv[t0:t0 + C, h, v0:v0 + BV], dw_s[b, :, :], barrier=loaded[b])
        T.tma_copy(hs[bc, h, :, v0:v0 + BV], h_s[b, :, :], barrier=loaded[b])
        T.tma_copy(dhs[bc, h, :, v0:v0 + BV], dh_s[b, :, :], barrier=loaded[b])

    @T.macro
    def load_qk(q, k, rn, q_s, k_s, rq_s, rk_s, qk_bar, t0, bc, hk, l2norm):
        """The item's q / k tiles (with l2norm, their rows' factors too) by TMA on qk_bar (arrival left to the
        caller)."""
        T.tma_copy(q[t0:t0 + C, hk, :], q_s, barrier=qk_bar[0])
        T.tma_copy(k[t0:t0 + C, hk, :], k_s, barrier=qk_bar[0])
        if l2norm != 0:
            T.tma_copy(rn[0, hk, bc * C:bc * C + C], rq_s, barrier=qk_bar[0])
            T.tma_copy(rn[1, hk, bc * C:bc * C + C], rk_s, barrier=qk_bar[0])

    @T.macro
    def l2norm_backward(grad, y_s, r_s, scratch, rowsum):
        """grad (the group's dL/dy, accumulator layout) becomes dL/dx = r (dy - y (y . dy)), with y the normalised
        rows the products used (y_s) and r gdn_prepare's factors (r_s); scratch and rowsum are free fragments."""
        for i, d in T.Parallel(C, K):
            scratch[i, d] = grad[i, d] * y_s[i, d]
        T.reduce_sum(scratch, rowsum, dim=1, batch=2)
        for i, d in T.Parallel(C, K):
            grad[i, d] = r_s[i] * (grad[i, d] - T.cast(y_s[i, d], "float32") * rowsum[i])

    E = K // 32  # a warp's lanes cover a row of K: E consecutive elements each

    @T.macro
    def store_rows(grad_s, raw_s, out, t0, hk, valid, l2norm, warp, lane, xr, gv, ov, red):
        """out's valid rows from the fp32 sums in grad_s; with l2norm, through the l2norm backward: grad_s holds
        dL/dy for y = x r (the normalised row the products used), out gets dL/dx = r dy - r^3 x (x . dy), with x the
        raw row (from raw_s: the tile came by TMA, where a global load a row had put one latency on each row) and
        r = (|x|^2 + eps)^-1/2 recomputed in fp32 (one warp per row; the row is warp-uniform, so the shuffles see
        every lane)."""
        for it in T.serial(C // WARPS):
            row = it * WARPS + warp
            if row < valid:
                for u in T.vectorized(E):
                    gv[u] = grad_s[row, lane * E + u]
                if l2norm != 0:
                    for u in T.vectorized(E):
                        xr[u] = raw_s[row, lane * E + u]
                    red[0] = 0.0  # |x|^2, then r
                    red[1] = 0.0  # x . dy, then r^3 (x . dy)
                    for u in T.unroll(E):
                        red[0] += T.cast(xr[u], "float32") * T.cast(xr[u], "float32")
                        red[1] += T.cast(xr[u], "float32") * gv[u]
                    red[0] = T.rsqrt(T.warp_reduce_sum(red[0]) + L2NORM_EPS)
                    red[1] = T.warp_reduce_sum(red[1]) * red[0] * red[0] * red[0]
                    for u in T.unroll(E):
                        ov[u] = T.cast(gv[u] * red[0] - T.cast(xr[u], "float32") * red[1], dt)
                else:
                    for u in T.unroll(E):
                        ov[u] = T.cast(gv[u], dt)
                for u in T.vectorized(E):
                    out[t0 + row, hk, lane * E + u] = ov[u]

    def fold_product(a, b, s, i, j):
        """sum over kk = i (mod C) of a[s, kk, j] * b[s, kk, j], in fp32 (K is a multiple of C)."""
        total = T.cast(a[s, i, j], "float32") * T.cast(b[s, i, j], "float32")
        for r in range(1, K // C):
            total = total + T.cast(a[s, r * C + i, j], "float32") * T.cast(b[s, r * C + i, j], "float32")
        return total

    @T.prim_func
    def gdn_bwd_chunk(
        q: T.Tensor((NT, Hq, K), dt),
        k: T.Tensor((NT, Hq, K), dt),
        A: T.Tensor((NT, Hv, C), dt),
        beta: T.Tensor((NT, Hv), "float32"),
        gam_t: T.Tensor((Hv, TC), "float32"),
        do: T.Tensor((NT, Hv, V), dt),
        w: T.Tensor((NT, Hv, V), dt),
        vnew: T.Tensor((NT, Hv, V), dt),
        x: T.Tensor((NT, Hv, V), dt),
        dv: T.Tensor((NT, Hv, V), dt),
        hs: T.Tensor((TC // C, Hv, K, V), dt),
        dhs: T.Tensor((TC // C, Hv, K, V), dt),
        slot_rows: T.Tensor((TC // C, 2), "int32"),
        dq: T.Tensor((NT, Hq, K), dt),
        dk: T.Tensor((NT, Hq, K), dt),
        dbeta: T.Tensor((NT, Hv), "float32"),
        dg: T.Tensor((NT, Hv), "float32"),
        q_raw: T.Tensor((NT, Hq, K), dt),
        k_raw: T.Tensor((NT, Hq, K), dt),
        # l2norm: the q (0) / k (1) rows' factors as gdn_prepare stored them, by chunk slot (slot * 64 + row): a
        # chunk's 64 are one TMA box whose start is 256-byte aligned (a box at token t0 is not, and TMA faults)
        rn: T.Tensor((2, Hq, TC), "float32"),
        scale: T.float32,
        l2norm: T.int32,
        ctas: T.int32,
    ):
        # items: every (chunk slot, q/k head), slot-major (TC / 64 = ceil(T / 64) + N slots)
        with T.Kernel(ctas, threads=THREADS, prelude=PRELUDE) as pid:
            q_s = T.alloc_shared((C, K), dt)
            rq_s = T.alloc_shared((C,), "float32")  # l2norm: the chunk's q rows' factors r (with the q / k tiles)
            rk_s = T.alloc_shared((C,), "float32")
            k_s = T.alloc_shared((C, K), dt)
            a_s = T.alloc_shared((C, C), dt)
            m_s = T.alloc_shared((C, C), dt)
            t_s = T.alloc_shared((C, C), dt)
            do_s = T.alloc_shared((2, C, BV), dt)
            w_s = T.alloc_shared((2, C, BV), dt)
            vn_s = T.alloc_shared((2, C, BV), dt)
            x_s = T.alloc_shared((2, C, BV), dt)
            dw_s = T.alloc_shared((2, C, BV), dt)
            h_s = T.alloc_shared((2, K, BV), dt)
            dh_s = T.alloc_shared((2, K, BV), dt)
            gam_s = T.alloc_shared((C,), "float32")
            eg_s = T.alloc_shared((C,), "float32")  # exp(gamma)
            # exp(gamma_last - gamma) on the valid rows, 0 past them (etd_s); et_s is 1 on the rows before the last
            # valid one and 0 from it on: the last row's et is exp(0) = 1, with no gamma term (see the state terms)
            et_s = T.alloc_shared((C,), "float32")
            etd_s = T.alloc_shared((C,), "float32")
            b_s = T.alloc_shared((C,), "float32")
            dg_s = T.alloc_shared((C,), "float32")
            # the epilogue's sums as parts (fragment_sums.py), added up by the row's thread after a barrier of the
            # epilogue's own: T.reduce_sum's butterflies across warps put 14 CTA barriers in each head's epilogue
            cpp_s = T.alloc_shared((4 * C,), "float32")   # the P part's column sums, by warp
            dbcp_s = T.alloc_shared((4 * C,), "float32")  # the A part's column sums, by warp
            rap_s = T.alloc_shared((2 * C,), "float32")   # both parts' row sums, by warpgroup
            r23p_s = T.alloc_shared((2 * C,), "float32")  # the state terms' row sums through q and k, by warpgroup
            dbrp_s = T.alloc_shared((2 * C,), "float32")  # dL K K^T's row sums (dbeta), by warpgroup
            hd_s = T.alloc_shared((C,), "float32")   # diag(S^T dS') of this V-block loop
            # dq, dk summed over the GVA group's v-heads, added from the accumulator layout (float2 per thread,
            # eight rows per instruction): rows padded by 32 bytes, conflict-free (8-way without, ncu)
            dqa_s = T.alloc_shared((C, K + 8), "float32")
            dka_s = T.alloc_shared((C, K + 8), "float32")
            dqf = T.alloc_fragment((C, K), "float32")
            dkf = T.alloc_fragment((C, K), "float32")
            dks = T.alloc_fragment((C, K), "float32")
            dP = T.alloc_fragment((C, C), "float32")
            dAgb = T.alloc_fragment((C, C), "float32")
            cc = T.alloc_fragment((C, C), "float32")
            # its own fragment (spread over all threads): on cc's columns only the first warpgroup would fold, a
            # divergent branch between the wgmmas' issue and wait, which makes ptxas serialise them
            hf = T.alloc_fragment((C, BV), "float32")
            l2_rows = T.alloc_fragment((C,), "float32")  # l2norm's row sums
            rp = T.alloc_fragment((C,), "float32")
            etw_s = T.alloc_shared((WARPS,), "float32")  # each warp's share of the et part's total
            db_s = T.alloc_shared((C,), "float32")
            dd_s = T.alloc_shared((C,), "float32")  # the A part's diagonal dAgb_ii A_ii (dbeta's; no gamma term)
            acc = T.alloc_var("float32")
            hh = T.alloc_var("float32")
            t0 = T.alloc_var("int32")
            valid = T.alloc_var("int32")
            bc = T.alloc_var("int32")
            hk = T.alloc_var("int32")
            nt0 = T.alloc_var("int32")     # the next item's chunk lookup, read under this item's work
            nvalid = T.alloc_var("int32")
            nbc = T.alloc_var("int32")
            nhk = T.alloc_var("int32")
            blocks = T.alloc_var("int32")  # V blocks this CTA has loaded before this item: buffer parities
            heads = T.alloc_var("int32")   # v-heads done before this item: the A tile's parity
            items = T.alloc_var("int32")   # valid items done before this one: the q / k tiles' parity
            raws = T.alloc_var("int32")    # raw q / k tiles loaded before (l2norm, row path): raw_bar's parity
            ahead = T.alloc_var("int32")   # this item's first two V blocks were issued by the previous item
            whole = T.alloc_var("int32")   # a whole chunk: dq / dk stored from q_s / k_s by TMA
            xr = T.alloc_local((E,), dt)
            gv = T.alloc_local((E,), "float32")
            ov = T.alloc_local((E,), dt)
            red = T.alloc_local((2,), "float32")
            scan = T.alloc_local((2,), "float32")   # warp 0's dg scan: rows lane and lane + 32
            et_part = T.alloc_local((1,), "float32")
            moved = T.alloc_local((2,), "float32")
            rowv = T.alloc_local((3,), "float32")  # a head's gamma, gamma_last, beta for row tid
            loaded = T.alloc_barrier([THREADS, THREADS])  # the two V-block buffers
            qk_bar = T.alloc_barrier(THREADS)
            a_bar = T.alloc_barrier(THREADS)  # each head's A tile
            raw_bar = T.alloc_barrier(THREADS)  # l2norm, row path: the raw q / k tiles
            R = Hv // Hq
            NB = V // BV
            n_items = (TC // C) * Hq
            tid = T.get_thread_binding()
            ln, wwg, wg = tid % 32, tid % 128 // 32, tid // 128  # lane, warp in its warpgroup, warpgroup
            blocks = 0
            heads = 0
            items = 0
            raws = 0
            ahead = 0
            nbc = pid // Hq
            nhk = pid % Hq
            nt0 = slot_rows[nbc, 0]
            nvalid = slot_rows[nbc, 1]

            for it in T.serial(T.ceildiv(n_items - pid, ctas)):
                # the chunk's first row and valid rows, as gdn_prepare found them (its binary search over the
                # sequences was a chain of dependent loads ahead of every tile load here); the next item's, early
                bc = nbc
                hk = nhk
                t0 = nt0
                valid = nvalid
                if pid + (it + 1) * ctas < n_items:
                    nbc = (pid + (it + 1) * ctas) // Hq
                    nhk = (pid + (it + 1) * ctas) % Hq
                    nt0 = slot_rows[nbc, 0]
                    nvalid = slot_rows[nbc, 1]
                else:
                    nvalid = 0
                whole = T.if_then_else(valid == C, 1, 0)
                if valid > 0:
                    # Every tile arrives by TMA on an mbarrier (one elected thread issues, all threads wait): the
                    # per-thread copies with bounds checks were ~45% of the stall samples (long scoreboard, ncu)
                    if ahead == 0:
                        # the last TMA stores of dq / dk (issued by this same elected thread) have read q_s / k_s;
                        # with l2norm, so have every thread's reads of the raw rows there (the row path)
                        T.tma_store_wait()
                        if l2norm != 0:
                            T.fence_proxy_async()
                            T.sync_threads()
                        load_qk(q, k, rn, q_s, k_s, rq_s, rk_s, qk_bar, t0, bc, hk, l2norm)
                        load_block(do, w, vnew, x, dv, hs, dhs, do_s, w_s, vn_s, x_s, dw_s, h_s, dh_s, loaded,
                                   blocks % 2, t0, bc, hk * R, 0)
                    for r in T.serial(R):  # the group's v-heads in order: deterministic sums
                        h = hk * R + r
                        # the previous head's reads of a_s (generic and tensor-core) before the TMA overwrites it
                        T.fence_proxy_async()
                        T.sync_threads()
                        T.tma_copy(A[t0:t0 + C, h, :], a_s, barrier=a_bar[0])
                        # this head's row scalars into registers now, into shared memory after the V blocks: the
                        # epilogue is their first use, so the V blocks' products hide the global-load latency (as a
                        # load-then-store loop here, two warps held every warp's next barrier for it: ncu)
                        rowv[0] = 0.0
                        rowv[1] = 0.0
                        rowv[2] = 0.0
                        if tid < C:
                            rowv[0] = gam_t[h, bc * C + tid]
                            rowv[1] = gam_t[h, bc * C + valid - 1]
                            if tid < valid:
                                rowv[2] = beta[t0 + tid, h]
                        T.clear(dqf)
                        T.clear(dkf)
                        T.clear(dks)
                        T.clear(dP)
                        T.clear(dAgb)
                        T.clear(hf)  # sum(S * dS') over the V blocks (eg_last's factor), folded onto C x BV
                        # T.Pipelined here (warp-specialised) broke dg and ran slower on the H200
                        for vb in T.serial(NB):
                            nxt = r * NB + vb + 1  # the item's next block
                            blk = blocks + nxt - 1  # the CTA's running block count: buffer blk % 2, its use blk // 2
                            b = blk % 2
                            if nxt < R * NB and vb == 0 and (r > 0 or ahead != 0):
                                # a head's second block left under the previous head's (item's) epilogue
                                if r == 0:
                                    # the previous item's dq / dk TMA stores read q_s / k_s: the elected thread
                                    # waits for those reads, then issues this item's q / k (first waited for at
                                    # head 0's epilogue)
                                    T.tma_store_wait()
                                    load_qk(q, k, rn, q_s, k_s, rq_s, rk_s, qk_bar, t0, bc, hk, l2norm)
                            elif nxt < R * NB:  # the next block (of this head or the next) into the other buffer
                                T.fence_proxy_async()
                                T.sync_threads()  # block blk - 1's products and folds are done with that buffer
                                load_block(do, w, vnew, x, dv, hs, dhs, do_s, w_s, vn_s, x_s, dw_s, h_s, dh_s,
                                           loaded, 1 - b, t0, bc, hk * R + nxt // NB, (nxt % NB) * BV)
                            elif nvalid > 0:  # the next item's first block, under this item's last epilogue
                                T.fence_proxy_async()
                                T.sync_threads()
                                load_block(do, w, vnew, x, dv, hs, dhs, do_s, w_s, vn_s, x_s, dw_s, h_s, dh_s,
                                           loaded, 1 - b, nt0, nbc, nhk * R, 0)
                            T.barrier_arrive(loaded[b])
                            T.mbarrier_wait_parity(loaded[b], (blk // 2) % 2)
                            # the five products issued back to back, one wait (each T.gemm waited for its own)
                            T.wgmma_gemm(do_s[b, :, :], h_s[b, :, :], dqf, transpose_B=True)
                            T.wgmma_gemm(dw_s[b, :, :], h_s[b, :, :], dkf, transpose_B=True)
                            T.wgmma_gemm(vn_s[b, :, :], dh_s[b, :, :], dks, transpose_B=True)
                            T.wgmma_gemm(do_s[b, :, :], vn_s[b, :, :], dP, transpose_B=True)
                            T.wgmma_gemm(x_s[b, :, :], w_s[b, :, :], dAgb, transpose_B=True)
                            # sum(S * dS') meanwhile on the CUDA cores, its K rows folded onto hf's C (formerly a
                            # K-deep product S^T dS' whose trace was taken)
                            for i, j in T.Parallel(C, BV):
                                hf[i, j] += fold_product(h_s, dh_s, b, i, j)
                            T.wait_wgmma(0)
                            # no use of an accumulator may move above the wait
                            T.warpgroup_fence_operand(dqf, num_regs=C * K // THREADS)
                            T.warpgroup_fence_operand(dkf, num_regs=C * K // THREADS)
                            T.warpgroup_fence_operand(dks, num_regs=C * K // THREADS)
                            T.warpgroup_fence_operand(dP, num_regs=C * C // THREADS)
                            T.warpgroup_fence_operand(dAgb, num_regs=C * C // THREADS)
                        # the last block's buffer is free once every thread is past its products and fold: the next
                        # head's (item's) second block goes there now, so two blocks load under the epilogue, where
                        # one left the next V loop waiting on its second block's loads (long scoreboard, ncu)
                        freed = (blocks + (r + 1) * NB - 1) % 2  # the buffer of the head's last block
                        if r < R - 1 or nvalid > 0:
                            T.fence_proxy_async()
                            T.sync_threads()
                            if r < R - 1:
                                load_block(do, w, vnew, x, dv, hs, dhs, do_s, w_s, vn_s, x_s, dw_s, h_s, dh_s,
                                           loaded, freed, t0, bc, hk * R + r + 1, BV)
                            else:
                                load_block(do, w, vnew, x, dv, hs, dhs, do_s, w_s, vn_s, x_s, dw_s, h_s, dh_s,
                                           loaded, freed, nt0, nbc, nhk * R, BV)
                        if tid < C:
                            gam_s[tid] = rowv[0]
                            # the state terms' row factors, once per head (not one exp2 per C x K element)
                            eg_s[tid] = T.exp2(rowv[0] * LOG2E)
                            etd_s[tid] = T.if_then_else(tid < valid, T.exp2((rowv[1] - rowv[0]) * LOG2E), 0.0)
                            et_s[tid] = T.if_then_else(tid < valid - 1, 1.0, 0.0)
                            b_s[tid] = rowv[2]
                        # Q K^T (cc is free until its first use below) runs under the state terms' passes
                        if r == 0:  # q / k's first use in this item
                            T.barrier_arrive(qk_bar[0])
                            T.mbarrier_wait_parity(qk_bar[0], items % 2)
                        T.wgmma_gemm(q_s, k_s, cc, transpose_B=True, clear_accum=True)
                        T.barrier_arrive(a_bar[0])
                        T.mbarrier_wait_parity(a_bar[0], (heads + r) % 2)
                        T.reduce_sum(hf, rp, dim=1)
                        for i in T.Parallel(C):  # summed by warp 0 in dg's scan, after its barrier
                            hd_s[i] = rp[i]

                        # state terms: dq = scale eg (dO S^T); dk = -eg (dW S^T) + et (Vnew dS'^T); eg = exp(gamma),
                        # et = exp(gamma_last - gamma) on valid rows (computed in place: no shared staging to sync)
                        # dgamma's row sums q.dq - k.(W term) - k.(et part) in one reduction (dks is scratch once
                        # dk has its et part); gamma_last takes the et part's total: each thread's sum, then one
                        # shuffle reduction per warp. The last valid row's et is exp(0) = 1, a constant: its et part
                        # enters neither that row's sum nor the total (et_s is 0 there; as a + and a - of one O(1)
                        # value summed in two orders it left dg an absolute error ~1e-6 under strong decay, where dg
                        # is ~1e-13) but joins dk (etd_s is 1 there). A row mask multiplies it out of the sums: a
                        # per-element select of dk's extra term on row valid - 1 instead cost the chunk kernel ~2%
                        et_part[0] = 0.0
                        for i, d in T.Parallel(C, K):
                            dqf[i, d] = dqf[i, d] * (scale * eg_s[i])
                            dks[i, d] = dks[i, d] * etd_s[i]
                            wk = dkf[i, d] * eg_s[i]
                            kt = dks[i, d] * k_s[i, d] * et_s[i]
                            et_part[0] += kt
                            dkf[i, d] = dks[i, d] - wk
                            dks[i, d] = dqf[i, d] * q_s[i, d] - wk * k_s[i, d] - kt
                        # into dg_s with the C x C parts' sums, after their barrier
                        T.call_extern("handle", "fqla_row_part", dks.data, T.address_of(r23p_s[0]), K // 16)
                        et_part[0] = T.warp_reduce_sum(et_part[0])
                        if T.get_thread_binding() % 32 == 0:  # read by warp 0 in dg's scan, after its barrier
                            etw_s[T.get_thread_binding() // 32] = et_part[0]

                        # P = scale Gamma tril(Q K^T) and Agb = Gamma A beta_col in one pass (Gamma computed once):
                        # dPs into m_s, dA = dAgb Gamma beta_col into t_s; then gamma's row / column sums of
                        # dPs * QK^T and dAgb * Gamma * A beta_col, and dbeta's column sums
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(cc, num_regs=C * C // THREADS)
                        # Gamma_ii = 1 has no gamma term: the diagonal stays out of gamma's row and column sums, which
                        # would cancel it only up to rounding (the floor above); dbeta takes the A part's diagonal
                        # from dd_s
                        # (chunk_passes.py: Gamma_ij = exp2((gamma_i - gamma_j) log2 e) on the valid lower triangle)
                        for jj in T.unroll(C // 32):
                            row, col = block_rows(ln, *block_origin(wwg, wg, C // 16, jj))
                            T.call_extern("handle", "fqla_gate_pass_" + dtype, T.address_of(a_s[row, col]),
                                          T.address_of(m_s[row, col]), T.address_of(t_s[row, col]), dP.data,
                                          dAgb.data, cc.data, T.address_of(gam_s[0]), T.address_of(b_s[0]),
                                          T.address_of(dd_s[0]), jj, valid, scale)
                        T.fence_proxy_async()  # m_s and t_s are read by the tensor cores next
                        T.sync_threads()  # m_s, t_s
                        T.wgmma_gemm(m_s, k_s, dqf)
                        T.wgmma_gemm(m_s, q_s, dkf, transpose_A=True)
                        # no wait: nothing below reads dqf / dkf before the last products, and the next T.gemm's wait
                        # (before m_s is rewritten) covers these reads of m_s
                        T.call_extern("handle", "fqla_col_part", cc.data, T.address_of(cpp_s[0]))  # P's column sums
                        # the A part's column sums are beta_j times dP's, which dbeta takes as they are (with dd_s)
                        T.call_extern("handle", "fqla_col_part", dP.data, T.address_of(dbcp_s[0]))
                        for i, j in T.Parallel(C, C):
                            cc[i, j] += dP[i, j] * b_s[j]
                        T.call_extern("handle", "fqla_row_part", cc.data, T.address_of(rap_s[0]), C // 16)
                        # dg_s / db_s are made from the parts by the row's thread after dL's barrier below, which
                        # publishes them too (no barrier of their own)
                        # dL = -strictLower(A^T dA A^T)
                        T.gemm(a_s, t_s, dAgb, transpose_A=True, clear_accum=True)
                        # both warpgroups' products that read m_s (dPs K, dPs^T Q) are done: this T.gemm waited for them
                        T.sync_threads()
                        for i, j in T.Parallel(C, C):
                            m_s[i, j] = T.cast(dAgb[i, j], dt)
                        T.fence_proxy_async()
                        T.sync_threads()  # m_s
                        T.wgmma_gemm(m_s, a_s, dP, transpose_B=True, clear_accum=True)
                        T.wgmma_gemm(k_s, k_s, cc, transpose_B=True, clear_accum=True)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(dP, num_regs=C * C // THREADS)
                        T.warpgroup_fence_operand(cc, num_regs=C * C // THREADS)
                        for jj in T.unroll(C // 32):  # dL = -strictLower(...) on valid rows (chunk_passes.py)
                            row, col = block_rows(ln, *block_origin(wwg, wg, C // 16, jj))
                            T.call_extern("handle", "fqla_dl_pass_" + dtype, T.address_of(t_s[row, col]), dP.data,
                                          cc.data, T.address_of(b_s[0]), jj, valid)
                        T.fence_proxy_async()  # t_s is read by the tensor cores below
                        T.call_extern("handle", "fqla_row_part", cc.data, T.address_of(dbrp_s[0]), C // 16)
                        # t_s (its last readers, the A^T dA product, were waited for); the parts (cpp_s, dbcp_s, rap_s,
                        # r23p_s, dbrp_s) and dd_s
                        T.sync_threads()
                        if tid < C:
                            acc = col_total(dbcp_s, tid)
                            dg_s[tid] = (row_total(r23p_s, tid) + row_total(rap_s, tid) - col_total(cpp_s, tid)
                                         - acc * b_s[tid])
                            db_s[tid] = (acc + dd_s[tid]) + row_total(dbrp_s, tid)
                        T.wgmma_gemm(t_s, k_s, dkf)
                        T.wgmma_gemm(t_s, k_s, dkf, transpose_A=True)
                        # (waited for before the group's running sums: dgamma's scan and stores run meanwhile)

                        # dgamma, then dg = its reverse cumsum inside the chunk, by warp 0 alone (rows lane and
                        # lane + 32 in registers, the scan by shuffles: no CTA barrier and no scan buffer; the other
                        # warps go on to the running sums). gamma_last also takes the et terms' total and
                        # eg_last * sum(S * dS')
                        T.sync_threads()  # dg_s, db_s, etw_s, hd_s (their last writers are other threads)
                        if T.get_thread_binding() < 32:
                            lane = T.get_thread_binding()
                            acc = T.warp_reduce_sum(T.if_then_else(lane < WARPS, etw_s[lane % WARPS], 0.0))
                            hh = T.warp_reduce_sum(hd_s[lane] + hd_s[lane + 32])  # sum(S * dS')
                            acc = acc + eg_s[valid - 1] * hh
                            scan[0] = (T.if_then_else(lane < valid, dg_s[lane], 0.0)
                                       + T.if_then_else(lane == valid - 1, acc, 0.0))
                            scan[1] = (T.if_then_else(lane + 32 < valid, dg_s[lane + 32], 0.0)
                                       + T.if_then_else(lane + 32 == valid - 1, acc, 0.0))
                            # suffix sums of each half (every lane shuffles; only lanes with a source add)
                            for sh in T.unroll(5):
                                moved[0] = T.shfl_down(scan[0], 1 << sh)
                                moved[1] = T.shfl_down(scan[1], 1 << sh)
                                scan[0] = scan[0] + T.if_then_else(lane + (1 << sh) < 32, moved[0], 0.0)
                                scan[1] = scan[1] + T.if_then_else(lane + (1 << sh) < 32, moved[1], 0.0)
                            scan[0] = scan[0] + T.shfl_sync(scan[1], 0)  # the upper half's total
                            if lane < valid:
                                dg[t0 + lane, h] = scan[0]
                                dbeta[t0 + lane, h] = db_s[lane]
                            if lane + 32 < valid:
                                dg[t0 + lane + 32, h] = scan[1]
                                dbeta[t0 + lane + 32, h] = db_s[lane + 32]
                        # the group's running sums: each thread reads and writes only its own fragment elements. As
                        # one read-modify-write loop TileLang could not prove that and put a CTA barrier in each of its
                        # 16 unrolled steps; a read loop, then a write loop, have none inside
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(dqf, num_regs=C * K // THREADS)
                        T.warpgroup_fence_operand(dkf, num_regs=C * K // THREADS)
                        if r == R - 1 and whole != 0:
                            # a whole chunk: the group's sums rounded straight into q_s / k_s (free once both
                            # warpgroups' last products, which read k_s, are done) and stored by TMA, which the next
                            # item's work runs beside (a row-store loop cost ~9% of an item)
                            T.sync_threads()
                            if r > 0:
                                for i, d in T.Parallel(C, K):
                                    dqf[i, d] += dqa_s[i, d]
                                    dkf[i, d] += dka_s[i, d]
                            if l2norm != 0:
                                # y is still in q_s / k_s, r in rq_s / rk_s (loaded with them); dks and l2_rows are
                                # since the state terms
                                l2norm_backward(dqf, q_s, rq_s, dks, l2_rows)
                                l2norm_backward(dkf, k_s, rk_s, dks, l2_rows)
                                T.sync_threads()  # every thread's reads of y before q_s / k_s take the results
                            for i, d in T.Parallel(C, K):
                                q_s[i, d] = T.cast(dqf[i, d], dt)
                                k_s[i, d] = T.cast(dkf[i, d], dt)
                        else:
                            if r > 0:
                                for i, d in T.Parallel(C, K):
                                    dqf[i, d] += dqa_s[i, d]
                                    dkf[i, d] += dka_s[i, d]
                            for i, d in T.Parallel(C, K):
                                dqa_s[i, d] = dqf[i, d]
                                dka_s[i, d] = dkf[i, d]
                    # generic writes of q_s / k_s (TMA-stored) or of dqa_s / dka_s (read across threads) published
                    T.fence_proxy_async()
                    T.sync_threads()
                    if whole != 0:
                        T.tma_copy(q_s, dq[t0:t0 + C, hk, :])
                        T.tma_copy(k_s, dk[t0:t0 + C, hk, :])
                    else:
                        if l2norm != 0:  # the raw rows into q_s / k_s, free since the barrier above
                            T.tma_copy(q_raw[t0:t0 + C, hk, :], q_s, barrier=raw_bar[0])
                            T.tma_copy(k_raw[t0:t0 + C, hk, :], k_s, barrier=raw_bar[0])
                            T.barrier_arrive(raw_bar[0])
                            T.mbarrier_wait_parity(raw_bar[0], raws % 2)
                            raws += 1
                        warp = T.get_thread_binding() // 32
                        lane = T.get_thread_binding() % 32
                        store_rows(dqa_s, q_s, dq, t0, hk, valid, l2norm, warp, lane, xr, gv, ov, red)
                        store_rows(dka_s, k_s, dk, t0, hk, valid, l2norm, warp, lane, xr, gv, ov, red)
                    blocks += R * NB
                    heads += R
                    items += 1
                    ahead = T.if_then_else(nvalid > 0, 1, 0)
            T.tma_store_wait()  # the last item's dq / dk stores have read q_s / k_s before the CTA exits

    return gdn_bwd_chunk
