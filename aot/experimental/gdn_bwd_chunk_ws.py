"""gdn_bwd_chunk with its work split by role over warpgroups (an experiment; same signature and outputs).

Why: in gdn_bwd_chunk every head's C x C epilogue (~40% of the kernel) runs with no load or product beside it,
and the V-block loop's and the epilogue's accumulators do not fit one register file together
(bench/results/experiments/gdn_bwd_chunk_bv16_4stages_h200.md). Here each role holds only its own accumulators,
so the epilogue of v-head r (PA) runs while Q and K stream v-head r + 1's V blocks.

Warpgroups (128 threads each):
  Q   dq of the whole GVA group in one accumulator: its V-loop operand is dO pre-scaled by scale * eg (per head), so
      heads add up without a running sum in shared memory; also dP = dO Vnew^T and dAgb = X W^T, handed to PA.
  K   dk of the group likewise, from -eg * dW (scaled in place: only K reads dW) and et * Vnew (a scaled copy);
      also the folds sum(S * dS') and sum(Vnew * X) per row.
  PA  the C x C epilogue of gdn_bwd_chunk (P and A parts, dbeta, the dg scan) from the handed-off dP / dAgb; it
      hands dPs (to Q and K) and beta * dL (to K) back through shared memory, double-buffered by head.
  P   one producer warp: q / k per item, gamma and A per head, the seven tiles per V block, all by TMA.
The products that need PA's dPs / dL of head r are added by Q and K after their V loop of head r + 1 (the
accumulators are linear), so Q and K never wait for the current head's epilogue; only an item's last head waits.
dgamma's row sums of the state terms come from the accumulators as differences of row sums before and after a
head's V loop; the et part's row sums, which the K accumulator mixes with the W part, come from
X = P^T dO + et K dS': sum_v Vnew X - colsum(P * dO Vnew^T).
Rows past a sequence end: as gdn_bwd_chunk (masked C x C terms, row outputs stored for valid rows only).
l2norm is not supported here (gdn_bwd_chunk would stay for it).

Status (eighteenth session, H200, bf16 K = V = 128 only; bench/results/experiments/gdn_bwd_chunk_warp_specialised_h200.md):
correct (the 96 non-l2norm backward / CP GPU tests pass with it in place of gdn_bwd_chunk, repeats bit-identical) but
7-8% slower than gdn_bwd_chunk on every row timed (hk16_hv32 32k_8seq 1.408 vs 1.311 ms). With PA's work skipped
(timing-only) it takes 0.913 ms against 1.350: PA's 128-thread epilogue (~11 us a v-head) sets the pace. dq differs from
gdn_bwd_chunk's by 2.5e-3 relative L2: the pre-scaled dO operand is rounded to bf16 once more. Build it with
  python scripts/experiment_kernel_dir.py .exp/ws aot.experimental.gdn_bwd_chunk_ws gdn_bwd_chunk "{'dtype': 'bf16', 'K': 128, 'V': 128}"
and time it with scripts/chunk_kernel_compare.py (NAME=dir:.exp/ws).
"""
import os

import tilelang.language as T

C = 64
BV = 32
VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128], "V": [64, 128, 256]}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
THREADS = 512
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}
LOG2E = 1.4426950408889634
# named barriers of one warpgroup each; 1 and 2 are taken by TileLang's cross-warp reductions (tl::AllReduce's
# NamedBarrier<128> syncs on ids 1 and 2), which PA's column sums use
Q_BAR, K_BAR, PA_BAR = 5, 6, 7
QK_BAR = 8  # Q and K at an item's end: both tails done before either overwrites q_s / k_s with its result
# setmaxnreg per warpgroup (producer, Q, K, PA): their sum times 128 is the launch's pool (128 x 512 threads)
REGS = (24, 168, 152, 168)
# timing-only ablations for the experiment (outputs wrong): "pa" skips PA's C x C work (its waits and arrivals
# stay), "pass" drops Q's and K's per-block operand scaling, "snap" drops the row-sum snapshots
ABLATE = set(filter(None, os.environ.get("FLASH_QLA_WS_ABLATE", "").split(",")))


def build(dtype: str, K: int, V: int):
    dt = DTYPES[dtype]
    NT = T.dynamic("T")
    Hq = T.dynamic("Hq")
    Hv = T.dynamic("Hv")
    TC = T.dynamic("TC")
    P_REGS, Q_REGS, K_REGS, PA_REGS = REGS
    assert P_REGS + Q_REGS + K_REGS + PA_REGS <= 512
    NB = V // BV

    def fold_product(a, b, s, i, j):
        """sum over kk = i (mod C) of a[s, kk, j] * b[s, kk, j], in fp32 (K is a multiple of C)."""
        total = T.cast(a[s, i, j], "float32") * T.cast(b[s, i, j], "float32")
        for r in range(1, K // C):
            total = total + T.cast(a[s, r * C + i, j], "float32") * T.cast(b[s, r * C + i, j], "float32")
        return total

    @T.macro
    def row_sums(acc, x_s, tmp, out):
        """out[i] = sum_d acc[i, d] * x_s[i, d] (the dgamma snapshots of an accumulator against q or k)."""
        for i, d in T.Parallel(C, K):
            tmp[i, d] = acc[i, d] * x_s[i, d]
        T.reduce_sum(tmp, out, dim=1)

    @T.macro
    def store_whole_chunk(acc, x_s, out, t0, hk, bar):
        """A whole chunk's dq or dk: rounded into x_s (q_s / k_s), whose last readers among Q and K are behind the
        QK barrier, and stored by TMA. Every thread issues: TileLang elects the lane (elect.sync is warp-collective;
        under a tid == 0 branch it hung), and only that lane has a store to wait for before x_s goes back."""
        T.sync_threads(QK_BAR, 256)
        for i, d in T.Parallel(C, K):
            x_s[i, d] = T.cast(acc[i, d], dt)
        T.fence_proxy_async()
        T.sync_threads(bar, 128)
        T.tma_copy(x_s, out[t0:t0 + C, hk, :])
        T.tma_store_wait()
        T.sync_threads(bar, 128)

    @T.macro
    def store_valid_rows(acc, outb, out, t0, hk, valid):
        """A partial chunk's dq or dk: rounded in registers, then 4-byte stores of the valid rows."""
        T.copy(acc, outb)
        for i, d in T.Parallel(C, K):
            if i < valid:
                out[t0 + i, hk, d] = outb[i, d]

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
        rn: T.Tensor((2, Hq, TC), "float32"),
        scale: T.float32,
        l2norm: T.int32,
        ctas: T.int32,
    ):
        with T.Kernel(ctas, threads=THREADS) as pid:
            q_s = T.alloc_shared((C, K), dt)
            k_s = T.alloc_shared((C, K), dt)
            do_s = T.alloc_shared((2, C, BV), dt)
            w_s = T.alloc_shared((2, C, BV), dt)
            vn_s = T.alloc_shared((2, C, BV), dt)
            x_s = T.alloc_shared((2, C, BV), dt)
            dw_s = T.alloc_shared((2, C, BV), dt)
            h_s = T.alloc_shared((2, K, BV), dt)
            dh_s = T.alloc_shared((2, K, BV), dt)
            sdo_s = T.alloc_shared((2, C, BV), dt)   # Q: scale * eg * dO
            svn_s = T.alloc_shared((2, C, BV), dt)   # K: et * Vnew
            gam_s = T.alloc_shared((2, C), "float32")  # gamma of a head (ring by head)
            a_s = T.alloc_shared((2, C, C), dt)      # A of a head (ring by head)
            m_s = T.alloc_shared((2, C, C), dt)      # PA -> Q, K: dPs (ring by head)
            l_s = T.alloc_shared((2, C, C), dt)      # PA -> K: beta_row * dL (ring by head)
            t_s = T.alloc_shared((C, C), dt)         # PA's own: dA, then A^T dA
            hp_s = T.alloc_shared((C, C + 8), "float32")  # Q -> PA: dO Vnew^T of a head
            ha_s = T.alloc_shared((C, C + 8), "float32")  # Q -> PA: X W^T of a head
            rq_s = T.alloc_shared((C,), "float32")   # Q -> PA: row sums q . (state term of dq)
            rk_s = T.alloc_shared((C,), "float32")   # K -> PA: row sums k . (state terms of dk)
            vx_s = T.alloc_shared((C,), "float32")   # K -> PA: row sums Vnew . X
            hd_s = T.alloc_shared((C,), "float32")   # K -> PA: sum(S * dS') folded onto rows
            egq_s = T.alloc_shared((C,), "float32")  # Q: scale * eg
            egk_s = T.alloc_shared((C,), "float32")  # K: -eg
            etk_s = T.alloc_shared((C,), "float32")  # K: et (0 past the end)
            b_s = T.alloc_shared((C,), "float32")    # PA: beta
            cp_s = T.alloc_shared((C,), "float32")
            dbc_s = T.alloc_shared((C,), "float32")
            ra_s = T.alloc_shared((C,), "float32")
            dbr_s = T.alloc_shared((C,), "float32")
            dg_s = T.alloc_shared((C,), "float32")
            db_s = T.alloc_shared((C,), "float32")
            full = T.alloc_barrier([32, 32])
            empty = T.alloc_barrier([256, 256])       # Q and K read the V-block tiles
            qk_full = T.alloc_barrier(32)
            qk_empty = T.alloc_barrier(384)
            g_full = T.alloc_barrier([32, 32])
            g_empty = T.alloc_barrier([384, 384])
            a_full = T.alloc_barrier([32, 32])
            a_empty = T.alloc_barrier([128, 128])
            hand_ready = T.alloc_barrier(128)         # Q's dP / dAgb / rq
            hand_free = T.alloc_barrier(128)
            ksum_ready = T.alloc_barrier(128)         # K's rk / vx / hd
            ksum_free = T.alloc_barrier(128)
            m_ready = T.alloc_barrier([128, 128])
            m_free = T.alloc_barrier([256, 256])      # Q and K done with m_s (K also with l_s)
            l_ready = T.alloc_barrier([128, 128])
            R = Hv // Hq
            n_items = (TC // C) * Hq
            tx = T.get_thread_binding()

            if tx >= 384:
                # ---------------- producer ----------------
                T.set_max_nreg(P_REGS, 0)
                if tx < 416:
                    nit = T.alloc_var("int32")
                    nh = T.alloc_var("int32")
                    bc = T.alloc_var("int32")
                    hk = T.alloc_var("int32")
                    t0 = T.alloc_var("int32")
                    valid = T.alloc_var("int32")
                    nb = T.alloc_var("int32")
                    nit = 0
                    nh = 0
                    nb = 0
                    for it in T.serial(T.ceildiv(n_items - pid, ctas)):
                        item = pid + it * ctas
                        bc = item // Hq
                        hk = item % Hq
                        t0 = slot_rows[bc, 0]
                        valid = slot_rows[bc, 1]
                        if valid > 0:
                            for r in T.serial(R):
                                h = hk * R + r
                                gs = nh % 2
                                T.barrier_wait(g_empty[gs], (nh // 2 + 1) % 2)
                                T.tma_copy(gam_t[h, bc * C:bc * C + C], gam_s[gs, :], barrier=g_full[gs])
                                T.barrier_arrive(g_full[gs])
                                T.barrier_wait(a_empty[gs], (nh // 2 + 1) % 2)
                                T.tma_copy(A[t0:t0 + C, h, :], a_s[gs, :, :], barrier=a_full[gs])
                                T.barrier_arrive(a_full[gs])
                                for vb in T.serial(NB):
                                    b = nb % 2
                                    v0 = vb * BV
                                    T.barrier_wait(empty[b], (nb // 2 + 1) % 2)
                                    T.tma_copy(do[t0:t0 + C, h, v0:v0 + BV], do_s[b, :, :], barrier=full[b])
                                    T.tma_copy(w[t0:t0 + C, h, v0:v0 + BV], w_s[b, :, :], barrier=full[b])
                                    T.tma_copy(vnew[t0:t0 + C, h, v0:v0 + BV], vn_s[b, :, :], barrier=full[b])
                                    T.tma_copy(x[t0:t0 + C, h, v0:v0 + BV], x_s[b, :, :], barrier=full[b])
                                    T.tma_copy(dv[t0:t0 + C, h, v0:v0 + BV], dw_s[b, :, :], barrier=full[b])
                                    T.tma_copy(hs[bc, h, :, v0:v0 + BV], h_s[b, :, :], barrier=full[b])
                                    T.tma_copy(dhs[bc, h, :, v0:v0 + BV], dh_s[b, :, :], barrier=full[b])
                                    T.barrier_arrive(full[b])
                                    nb += 1
                                if r == 0:  # the item's q / k once every role is done with the previous item's
                                    T.barrier_wait(qk_empty[0], (nit + 1) % 2)
                                    T.tma_copy(q[t0:t0 + C, hk, :], q_s, barrier=qk_full[0])
                                    T.tma_copy(k[t0:t0 + C, hk, :], k_s, barrier=qk_full[0])
                                    T.barrier_arrive(qk_full[0])
                                nh += 1
                            nit += 1
            elif tx < 128:
                # ---------------- Q: dq, dP, dAgb ----------------
                T.set_max_nreg(Q_REGS, 1)
                tid = tx
                dqf = T.alloc_fragment((C, K), "float32")
                outb = T.alloc_fragment((C, K), dt)
                tmp = T.alloc_fragment((C, K), "float32")
                dP = T.alloc_fragment((C, C), "float32")
                dAgb = T.alloc_fragment((C, C), "float32")
                s0 = T.alloc_fragment((C,), "float32")
                s1 = T.alloc_fragment((C,), "float32")
                nit = T.alloc_var("int32")
                nh = T.alloc_var("int32")
                bc = T.alloc_var("int32")
                hk = T.alloc_var("int32")
                t0 = T.alloc_var("int32")
                valid = T.alloc_var("int32")
                nb = T.alloc_var("int32")
                nit = 0
                nh = 0
                nb = 0
                for it in T.serial(T.ceildiv(n_items - pid, ctas)):
                    bc = (pid + it * ctas) // Hq
                    hk = (pid + it * ctas) % Hq
                    t0 = slot_rows[bc, 0]
                    valid = slot_rows[bc, 1]
                    if valid > 0:
                        T.clear(dqf)
                        T.clear(s0)
                        T.clear(s1)
                        for r in T.serial(R):
                            gs = nh % 2
                            T.barrier_wait(g_full[gs], (nh // 2) % 2)
                            if tid < C:
                                egq_s[tid] = T.exp2(gam_s[gs, tid] * LOG2E) * scale
                            T.barrier_arrive(g_empty[gs])
                            T.sync_threads(Q_BAR, 128)  # egq_s, read by every thread's pass below
                            T.clear(dP)
                            T.clear(dAgb)
                            for vb in T.serial(NB):
                                b = nb % 2
                                T.barrier_wait(full[b], (nb // 2) % 2)
                                if "pass" not in ABLATE:
                                    for i, d in T.Parallel(C, BV):
                                        sdo_s[b, i, d] = T.cast(T.cast(do_s[b, i, d], "float32") * egq_s[i], dt)
                                    T.fence_proxy_async()
                                    T.sync_threads(Q_BAR, 128)  # sdo_s published
                                T.wgmma_gemm(do_s[b, :, :] if "pass" in ABLATE else sdo_s[b, :, :], h_s[b, :, :],
                                             dqf, transpose_B=True)
                                T.wgmma_gemm(do_s[b, :, :], vn_s[b, :, :], dP, transpose_B=True)
                                T.wgmma_gemm(x_s[b, :, :], w_s[b, :, :], dAgb, transpose_B=True)
                                T.wait_wgmma(0)
                                T.warpgroup_fence_operand(dqf, num_regs=C * K // 128)
                                T.warpgroup_fence_operand(dP, num_regs=C * C // 128)
                                T.warpgroup_fence_operand(dAgb, num_regs=C * C // 128)
                                T.barrier_arrive(empty[b])
                                nb += 1
                            # hand dP, dAgb and the state term's row sums to PA (after it read the previous ones)
                            T.barrier_wait(hand_free[0], (nh + 1) % 2)
                            for i, j in T.Parallel(C, C):
                                hp_s[i, j] = dP[i, j]
                                ha_s[i, j] = dAgb[i, j]
                            if r == 0:
                                T.barrier_wait(qk_full[0], nit % 2)
                            if "snap" not in ABLATE:
                                row_sums(dqf, q_s, tmp, s1)
                            for i in T.Parallel(C):
                                rq_s[i] = s1[i] - s0[i]
                            T.barrier_arrive(hand_ready[0])
                            if r > 0:  # the previous head's dPs K
                                ps = (nh - 1) % 2
                                T.barrier_wait(m_ready[ps], ((nh - 1) // 2) % 2)
                                T.wgmma_gemm(m_s[ps, :, :], k_s, dqf)
                                T.wait_wgmma(0)
                                T.warpgroup_fence_operand(dqf, num_regs=C * K // 128)
                                T.barrier_arrive(m_free[ps])
                                if "snap" not in ABLATE:
                                    row_sums(dqf, q_s, tmp, s0)
                            else:
                                for i in T.Parallel(C):
                                    s0[i] = s1[i]
                            nh += 1
                        # the item's last head: its dPs K, then dq out (valid rows)
                        ps = (nh - 1) % 2
                        T.barrier_wait(m_ready[ps], ((nh - 1) // 2) % 2)
                        T.wgmma_gemm(m_s[ps, :, :], k_s, dqf)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(dqf, num_regs=C * K // 128)
                        T.barrier_arrive(m_free[ps])
                        if valid == C:
                            store_whole_chunk(dqf, q_s, dq, t0, hk, Q_BAR)
                            T.barrier_arrive(qk_empty[0])
                        else:
                            T.barrier_arrive(qk_empty[0])
                            store_valid_rows(dqf, outb, dq, t0, hk, valid)
                        nit += 1
            elif tx < 256:
                # ---------------- K: dk, sum(S * dS'), sum(Vnew * X) ----------------
                T.set_max_nreg(K_REGS, 1)
                tid = tx - 128
                dkf = T.alloc_fragment((C, K), "float32")
                outb = T.alloc_fragment((C, K), dt)
                tmp = T.alloc_fragment((C, K), "float32")
                hf = T.alloc_fragment((C, BV), "float32")
                vxf = T.alloc_fragment((C, BV), "float32")
                s0 = T.alloc_fragment((C,), "float32")
                s1 = T.alloc_fragment((C,), "float32")
                hr = T.alloc_fragment((C,), "float32")
                vr = T.alloc_fragment((C,), "float32")
                nit = T.alloc_var("int32")
                nh = T.alloc_var("int32")
                bc = T.alloc_var("int32")
                hk = T.alloc_var("int32")
                t0 = T.alloc_var("int32")
                valid = T.alloc_var("int32")
                nb = T.alloc_var("int32")
                nit = 0
                nh = 0
                nb = 0
                for it in T.serial(T.ceildiv(n_items - pid, ctas)):
                    bc = (pid + it * ctas) // Hq
                    hk = (pid + it * ctas) % Hq
                    t0 = slot_rows[bc, 0]
                    valid = slot_rows[bc, 1]
                    if valid > 0:
                        T.clear(dkf)
                        T.clear(s0)
                        T.clear(s1)
                        for r in T.serial(R):
                            gs = nh % 2
                            T.barrier_wait(g_full[gs], (nh // 2) % 2)
                            if tid < C:
                                egk_s[tid] = -T.exp2(gam_s[gs, tid] * LOG2E)
                                etk_s[tid] = T.if_then_else(
                                    tid < valid, T.exp2((gam_s[gs, valid - 1] - gam_s[gs, tid]) * LOG2E), 0.0)
                            T.barrier_arrive(g_empty[gs])
                            T.sync_threads(K_BAR, 128)  # egk_s / etk_s, read by every thread's pass below
                            T.clear(hf)
                            T.clear(vxf)
                            for vb in T.serial(NB):
                                b = nb % 2
                                T.barrier_wait(full[b], (nb // 2) % 2)
                                # -eg * dW in place (only K reads dW), et * Vnew into a copy (Q reads Vnew)
                                if "pass" not in ABLATE:
                                    for i, d in T.Parallel(C, BV):
                                        dw_s[b, i, d] = T.cast(T.cast(dw_s[b, i, d], "float32") * egk_s[i], dt)
                                        svn_s[b, i, d] = T.cast(T.cast(vn_s[b, i, d], "float32") * etk_s[i], dt)
                                    T.fence_proxy_async()
                                    T.sync_threads(K_BAR, 128)
                                T.wgmma_gemm(dw_s[b, :, :], h_s[b, :, :], dkf, transpose_B=True)
                                T.wgmma_gemm(vn_s[b, :, :] if "pass" in ABLATE else svn_s[b, :, :], dh_s[b, :, :],
                                             dkf, transpose_B=True)
                                if "fold" not in ABLATE:
                                    for i, j in T.Parallel(C, BV):
                                        hf[i, j] += fold_product(h_s, dh_s, b, i, j)
                                        vxf[i, j] += (T.cast(vn_s[b, i, j], "float32")
                                                      * T.cast(x_s[b, i, j], "float32"))
                                T.wait_wgmma(0)
                                T.warpgroup_fence_operand(dkf, num_regs=C * K // 128)
                                T.fence_proxy_async()  # the in-place dW writes before the next TMA into dw_s
                                T.barrier_arrive(empty[b])
                                nb += 1
                            T.reduce_sum(hf, hr, dim=1)
                            T.reduce_sum(vxf, vr, dim=1)
                            if r == 0:
                                T.barrier_wait(qk_full[0], nit % 2)
                            if "snap" not in ABLATE:
                                row_sums(dkf, k_s, tmp, s1)
                            T.barrier_wait(ksum_free[0], (nh + 1) % 2)
                            for i in T.Parallel(C):
                                rk_s[i] = s1[i] - s0[i]
                            for i in T.Parallel(C):
                                vx_s[i] = vr[i]
                            for i in T.Parallel(C):
                                hd_s[i] = hr[i]
                            T.barrier_arrive(ksum_ready[0])
                            if r > 0:  # the previous head's dPs^T Q, dLb K, dLb^T K
                                ps = (nh - 1) % 2
                                T.barrier_wait(m_ready[ps], ((nh - 1) // 2) % 2)
                                T.wgmma_gemm(m_s[ps, :, :], q_s, dkf, transpose_A=True)
                                T.barrier_wait(l_ready[ps], ((nh - 1) // 2) % 2)
                                T.wgmma_gemm(l_s[ps, :, :], k_s, dkf)
                                T.wgmma_gemm(l_s[ps, :, :], k_s, dkf, transpose_A=True)
                                T.wait_wgmma(0)
                                T.warpgroup_fence_operand(dkf, num_regs=C * K // 128)
                                T.barrier_arrive(m_free[ps])
                                if "snap" not in ABLATE:
                                    row_sums(dkf, k_s, tmp, s0)
                            else:
                                for i in T.Parallel(C):
                                    s0[i] = s1[i]
                            nh += 1
                        ps = (nh - 1) % 2
                        T.barrier_wait(m_ready[ps], ((nh - 1) // 2) % 2)
                        T.wgmma_gemm(m_s[ps, :, :], q_s, dkf, transpose_A=True)
                        T.barrier_wait(l_ready[ps], ((nh - 1) // 2) % 2)
                        T.wgmma_gemm(l_s[ps, :, :], k_s, dkf)
                        T.wgmma_gemm(l_s[ps, :, :], k_s, dkf, transpose_A=True)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(dkf, num_regs=C * K // 128)
                        T.barrier_arrive(m_free[ps])
                        if valid == C:
                            store_whole_chunk(dkf, k_s, dk, t0, hk, K_BAR)
                            T.barrier_arrive(qk_empty[0])
                        else:
                            T.barrier_arrive(qk_empty[0])
                            store_valid_rows(dkf, outb, dk, t0, hk, valid)
                        nit += 1
            else:
                # ---------------- PA: the C x C epilogue ----------------
                T.set_max_nreg(PA_REGS, 1)
                tid = tx - 256
                cc = T.alloc_fragment((C, C), "float32")
                dP = T.alloc_fragment((C, C), "float32")
                dAgb = T.alloc_fragment((C, C), "float32")
                cp = T.alloc_fragment((C,), "float32")
                ra = T.alloc_fragment((C,), "float32")
                dbc = T.alloc_fragment((C,), "float32")
                dbr = T.alloc_fragment((C,), "float32")
                bet = T.alloc_local((1,), "float32")
                scan = T.alloc_local((2,), "float32")
                moved = T.alloc_local((2,), "float32")
                acc = T.alloc_local((2,), "float32")
                nit = T.alloc_var("int32")
                nh = T.alloc_var("int32")
                bc = T.alloc_var("int32")
                hk = T.alloc_var("int32")
                t0 = T.alloc_var("int32")
                valid = T.alloc_var("int32")
                nit = 0
                nh = 0
                for it in T.serial(T.ceildiv(n_items - pid, ctas)):
                    bc = (pid + it * ctas) // Hq
                    hk = (pid + it * ctas) % Hq
                    t0 = slot_rows[bc, 0]
                    valid = slot_rows[bc, 1]
                    if valid > 0:
                        for r in T.serial(R):
                            h = hk * R + r
                            gs = nh % 2
                            bet[0] = 0.0
                            if tid < valid:
                                bet[0] = beta[t0 + tid, h]
                            if r == 0:
                                T.barrier_wait(qk_full[0], nit % 2)
                            T.wgmma_gemm(q_s, k_s, cc, transpose_B=True, clear_accum=True)
                            T.barrier_wait(g_full[gs], (nh // 2) % 2)
                            T.barrier_wait(a_full[gs], (nh // 2) % 2)
                            T.barrier_wait(hand_ready[0], nh % 2)
                            if tid < C:
                                b_s[tid] = bet[0]
                            for i, j in T.Parallel(C, C):
                                dP[i, j] = hp_s[i, j]
                                dAgb[i, j] = ha_s[i, j]
                            # m_s / l_s of this slot were last read by Q and K two heads ago
                            T.barrier_wait(m_free[gs], (nh // 2 + 1) % 2)
                            if "pa" not in ABLATE:
                                T.sync_threads(PA_BAR, 128)  # b_s
                                T.wait_wgmma(0)
                                T.warpgroup_fence_operand(cc, num_regs=C * C // 128)
                                for i, j in T.Parallel(C, C):
                                    gm = T.if_then_else(i >= j and i < valid,
                                                        T.exp2((gam_s[gs, i] - gam_s[gs, j]) * LOG2E), 0.0)
                                    dP[i, j] = dP[i, j] * gm * scale
                                    m_s[gs, i, j] = T.cast(dP[i, j], dt)
                                    cc[i, j] = dP[i, j] * cc[i, j]
                                    dAgb[i, j] = dAgb[i, j] * gm
                                    t_s[i, j] = T.cast(dAgb[i, j] * b_s[j], dt)
                                    dP[i, j] = dAgb[i, j] * T.cast(a_s[gs, i, j], "float32")
                                T.fence_proxy_async()
                                T.sync_threads(PA_BAR, 128)  # m_s, t_s
                                T.barrier_arrive(m_ready[gs])
                                if "red" not in ABLATE:
                                    T.reduce_sum(cc, cp, dim=0)   # colsum(P * dO Vnew^T)
                                    T.reduce_sum(dP, dbc, dim=0)
                                for i, j in T.Parallel(C, C):
                                    cc[i, j] += dP[i, j] * b_s[j]
                                T.reduce_sum(cc, ra, dim=1)
                                for i in T.Parallel(C):
                                    cp_s[i] = cp[i]
                                for i in T.Parallel(C):
                                    dbc_s[i] = dbc[i]
                                for i in T.Parallel(C):
                                    ra_s[i] = ra[i]
                                # dL = -strictLower(A^T dA A^T)
                                if "dl" not in ABLATE:
                                    T.gemm(a_s[gs, :, :], t_s, dAgb, transpose_A=True, clear_accum=True)
                                    T.sync_threads(PA_BAR, 128)  # every thread's A^T dA product has read t_s
                                    for i, j in T.Parallel(C, C):
                                        t_s[i, j] = T.cast(dAgb[i, j], dt)
                                    T.fence_proxy_async()
                                    T.sync_threads(PA_BAR, 128)
                                    T.wgmma_gemm(t_s, a_s[gs, :, :], dP, transpose_B=True, clear_accum=True)
                                    T.wgmma_gemm(k_s, k_s, cc, transpose_B=True, clear_accum=True)
                                    T.wait_wgmma(0)
                                    T.warpgroup_fence_operand(dP, num_regs=C * C // 128)
                                    T.warpgroup_fence_operand(cc, num_regs=C * C // 128)
                                T.barrier_arrive(a_empty[gs])
                                if "dl" not in ABLATE:
                                    for i, j in T.Parallel(C, C):
                                        dP[i, j] = T.if_then_else(i > j and i < valid, -dP[i, j], 0.0)
                                        cc[i, j] = dP[i, j] * cc[i, j]
                                        l_s[gs, i, j] = T.cast(dP[i, j] * b_s[i], dt)
                                    T.fence_proxy_async()
                                    T.reduce_sum(cc, dbr, dim=1)
                                    for i in T.Parallel(C):
                                        dbr_s[i] = dbr[i]
                                T.sync_threads(PA_BAR, 128)  # l_s, the sums' vectors
                                T.barrier_arrive(l_ready[gs])
                                T.barrier_wait(ksum_ready[0], nh % 2)
                                if tid < C:
                                    # the et part's row sums: sum_v Vnew X - colsum(P * dO Vnew^T) (X's own algebra)
                                    etr = T.if_then_else(tid < valid, vx_s[tid] - cp_s[tid], 0.0)
                                    dg_s[tid] = (rk_s[tid] + rq_s[tid] - 2.0 * etr + ra_s[tid] - cp_s[tid]
                                                 - dbc_s[tid] * b_s[tid])
                                    db_s[tid] = dbc_s[tid] + dbr_s[tid]
                                    vx_s[tid] = etr  # reused: the et part's total is summed in the scan below
                                T.sync_threads(PA_BAR, 128)
                                if tid < 32:
                                    lane = tid
                                    acc[0] = T.warp_reduce_sum(vx_s[lane] + vx_s[lane + 32])
                                    acc[1] = T.warp_reduce_sum(hd_s[lane] + hd_s[lane + 32])  # sum(S * dS')
                                    acc[0] = acc[0] + T.exp2(gam_s[gs, valid - 1] * LOG2E) * acc[1]
                                    scan[0] = (T.if_then_else(lane < valid, dg_s[lane], 0.0)
                                               + T.if_then_else(lane == valid - 1, acc[0], 0.0))
                                    scan[1] = (T.if_then_else(lane + 32 < valid, dg_s[lane + 32], 0.0)
                                               + T.if_then_else(lane + 32 == valid - 1, acc[0], 0.0))
                                    for sh in T.unroll(5):
                                        moved[0] = T.shfl_down(scan[0], 1 << sh)
                                        moved[1] = T.shfl_down(scan[1], 1 << sh)
                                        scan[0] = scan[0] + T.if_then_else(lane + (1 << sh) < 32, moved[0], 0.0)
                                        scan[1] = scan[1] + T.if_then_else(lane + (1 << sh) < 32, moved[1], 0.0)
                                    scan[0] = scan[0] + T.shfl_sync(scan[1], 0)
                                    if lane < valid:
                                        dg[t0 + lane, h] = scan[0]
                                        dbeta[t0 + lane, h] = db_s[lane]
                                    if lane + 32 < valid:
                                        dg[t0 + lane + 32, h] = scan[1]
                                        dbeta[t0 + lane + 32, h] = db_s[lane + 32]
                            else:  # timing-only: PA's protocol without its work
                                T.wait_wgmma(0)
                                T.barrier_arrive(m_ready[gs])
                                T.barrier_arrive(a_empty[gs])
                                T.barrier_arrive(l_ready[gs])
                                T.barrier_wait(ksum_ready[0], nh % 2)
                            T.sync_threads(PA_BAR, 128)  # every read of the handed-off vectors and gamma
                            T.barrier_arrive(hand_free[0])
                            T.barrier_arrive(ksum_free[0])
                            T.barrier_arrive(g_empty[gs])
                            nh += 1
                        T.barrier_arrive(qk_empty[0])
                        nit += 1

    return gdn_bwd_chunk
