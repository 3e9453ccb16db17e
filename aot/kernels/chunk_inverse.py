"""The inverse of one 64-token chunk on one warpgroup: A = (I + strictLower(diag(beta) L))^-1 for L = K K^T (the
gate-free inverse, gdn_prepare) or Gamma * K K^T (its gated form Gamma * A, gdn_fwd_fused's aux warpgroup).

Blocked: the four 16 x 16 diagonal blocks by forward substitution in parallel (one thread per column, 16 rows
deep, fp32 FMA), then the blocks below the diagonal by recursive doubling, A_rc = -A_rr L_rc A_cc on the two
32 x 32 diagonal blocks and then the 32 x 32 block below them, each product a warp's 16 x 16 tile on the tensor
cores (mma m16n8k8 in 3xTF32, about fp32 accuracy, or one TF32 product): 4 products deep with 4 barriers, on the
CTA's barrier or a named one of the warpgroup's 128 threads.
"""
import tilelang.language as T

C = 64
B = 16            # diagonal block
NB = C // B
SCRATCH_COLS = C + 8  # the fp32 K K^T / inverse tiles' rows (scratch_layout)


def scratch_layout():
    """The layout of the fp32 K K^T and inverse tiles (C x SCRATCH_COLS): rows of 72 floats (rows r .. r + 3 start 8
    banks apart), each 8-float group's halves swapped on rows with r / 4 odd. The accumulator's 8-byte stores (4 rows x
    8 columns a half-warp), the m16n8k8 A-fragment loads (8 rows x 4 columns) and B-fragment loads (4 rows x 8
    columns) each meet 32 distinct banks (rows padded by 4 floats left the stores and B loads 2-way conflicted). The
    swap stays inside 8 columns, so the diagonal blocks' addresses (a thread's block at a multiple of 16) keep
    compile-time offsets."""
    return T.Layout([C, SCRATCH_COLS], lambda i, j: [i, j // 8 * 8 + (j // 4 % 2 ^ i // 4 % 2) * 4 + j % 4])


@T.macro
def split_tf32(x, hi, lo, i):
    """x = hi + lo, both TF32 (the low 13 mantissa bits cleared): three TF32 products then give ~fp32 accuracy."""
    hi[i] = T.reinterpret(T.bitwise_and(T.reinterpret(x, "uint32"), T.uint32(0xFFFFE000)), "float32")
    lo[i] = x - hi[i]


@T.macro
def block_product(acc, ahi, alo, bhi, blo, lane, a, a_row, a_col, b, b_row, b_col, half=None, terms=3):
    """acc (a warp's 16 x 16 tile in the m16n8 accumulator layout: element n * 4 + u is row lane / 4 + u // 2 * 8,
    column n * 8 + lane % 4 * 2 + u % 2) += a[a_row:+16, a_col:+16] @ b[b_row:+16, b_col:+16] on the tensor
    cores, as 3xTF32 (hi hi + hi lo + lo hi: about fp32 accuracy) or, terms = 1, one TF32 product (the operands'
    mantissas cut to 10 bits: ~1e-3 relative). half (0 / 1): only columns half * 8 .. + 8."""
    for kx in T.unroll(2):
        for u in T.unroll(4):
            if terms == 3:
                split_tf32(a[a_row + lane // 4 + u % 2 * 8, a_col + kx * 8 + lane % 4 + u // 2 * 4], ahi, alo, u)
            else:
                ahi[u] = a[a_row + lane // 4 + u % 2 * 8, a_col + kx * 8 + lane % 4 + u // 2 * 4]
        for n in T.unroll(2) if half is None else [half]:
            for u in T.unroll(2):
                if terms == 3:
                    split_tf32(b[b_row + kx * 8 + lane % 4 + u * 4, b_col + n * 8 + lane // 4], bhi, blo, u)
                else:
                    bhi[u] = b[b_row + kx * 8 + lane % 4 + u * 4, b_col + n * 8 + lane // 4]
            if terms == 3:
                T.ptx_mma("float32", "m16n8k8", "row", "col", "tf32", "tf32", "fp32", alo.data, 0, bhi.data, 0,
                          acc.data, n * 4, T.bool(False))
                T.ptx_mma("float32", "m16n8k8", "row", "col", "tf32", "tf32", "fp32", ahi.data, 0, blo.data, 0,
                          acc.data, n * 4, T.bool(False))
            T.ptx_mma("float32", "m16n8k8", "row", "col", "tf32", "tf32", "fp32", ahi.data, 0, bhi.data, 0,
                      acc.data, n * 4, T.bool(False))


@T.macro
def zero8(acc):
    for u in T.unroll(8):
        acc[u] = 0.0


@T.macro
def rows_times_beta(acc, beta, bi, row, lane, half=None):
    """L = diag(beta) K K^T: beta scales the tile's rows after the product."""
    for n in T.unroll(2) if half is None else [half]:
        for u in T.unroll(4):
            acc[n * 4 + u] = acc[n * 4 + u] * beta[bi, row + lane // 4 + u // 2 * 8]


@T.macro
def store_tile(dst, row, col, acc, sign, lane, half=None):
    for n in T.unroll(2) if half is None else [half]:
        for hh in T.unroll(2):
            for u in T.vectorized(2):
                dst[row + lane // 4 + hh * 8, col + n * 8 + lane % 4 * 2 + u] = acc[n * 4 + hh * 2 + u] * sign


@T.macro
def store_scaled(out, out_stage, row, col, acc, beta, bi, lane, half=None):
    """out[out_stage] (the storage dtype) = -acc diag(beta) for a warp's 16 x 16 tile (acc holds -A_rc's negation;
    it is scaled in place)."""
    # every load before the first store (ptxas keeps a shared load behind earlier shared stores)
    for n in T.unroll(2) if half is None else [half]:
        for hh in T.unroll(2):
            for u in T.unroll(2):
                acc[n * 4 + hh * 2 + u] = -acc[n * 4 + hh * 2 + u] * beta[bi, col + n * 8 + lane % 4 * 2 + u]
    for n in T.unroll(2) if half is None else [half]:
        for hh in T.unroll(2):
            for u in T.unroll(2):
                out[out_stage, row + lane // 4 + hh * 8, col + n * 8 + lane % 4 * 2 + u] = T.cast(
                    acc[n * 4 + hh * 2 + u], out.dtype)


@T.macro
def sync(bar_id, nthreads):
    if bar_id is None:
        T.sync_threads()
    else:
        T.sync_threads(bar_id, nthreads)


@T.macro
def invert_chunk(kk_s, beta, bi, ainv, tmp, x, dot, acc, ahi, alo, bhi, blo, tid, bar_id=None, nthreads=None,
                 split_pairs=False, terms=3, out=None, out_stage=None):
    """ainv (64 x 64 fp32, lower triangle and diagonal written) = the inverse, from kk_s = K K^T (fp32, read below
    the diagonal) and beta[bi, :]. tid: 0..127 within the warpgroup; bar_id / nthreads: its named barrier (None:
    the CTA's, for a one-warpgroup CTA). Ends with the barrier after the last write of ainv. x: 16 fp32 locals,
    dot: 1, acc: 8, ahi / alo: 4, bhi / blo: 2. split_pairs: the first two steps on four warps (8 columns each)
    instead of two: shorter when the warpgroup is alone on its critical path (gdn_fwd_fused's aux), 6-7% slower
    where four CTAs share the SM (gdn_prepare, H200 A/B). terms: 3 (3xTF32) or 1 (TF32) products. out (optional,
    [stage, 64, 64] in the storage dtype): also A diag(beta) into out[out_stage] as each block is made (its upper
    blocks are never written: the caller zeroes them once)."""
    # diagonal blocks: thread tid < 64 owns column tid % 16 of block tid // 16,
    # x_i = [i == col] - beta_i sum_{j<i} (K K^T)_ij x_j within the block (0 above the diagonal)
    if tid < C:
        d0 = (tid // B) * B
        for i in T.unroll(B):
            dot[0] = 0.0
            for j in T.unroll(i):
                dot[0] += kk_s[d0 + i, d0 + j] * x[j]
            x[i] = T.if_then_else(i == tid - d0, 1.0, -beta[bi, d0 + i] * dot[0])
        for i in T.unroll(B):
            ainv[d0 + i, tid] = x[i]
        if out is not None:
            dot[0] = beta[bi, tid]  # this column's beta, loaded once before the stores
            for i in T.unroll(B):
                out[out_stage, d0 + i, tid] = T.cast(x[i] * dot[0], out.dtype)
    sync(bar_id, nthreads)
    warp = tid // 32
    lane = tid % 32
    # A_rc = -A_rr (L_rc A_cc): first the two 32 x 32 diagonal blocks (16 x 16 blocks (1, 0) and (3, 2)), then the
    # 32 x 32 block below them (16 x 16 blocks (2..3, 0..1), one warp each)
    if split_pairs:  # trace time: two warps per 16 x 16 block, 8 columns each
        for half in T.unroll(2):
            if warp % 2 == half:
                r = warp // 2 * 2 + 1
                zero8(acc)
                block_product(acc, ahi, alo, bhi, blo, lane, kk_s, r * B, (r - 1) * B, ainv, (r - 1) * B, (r - 1) * B,
                              half, terms)
                rows_times_beta(acc, beta, bi, r * B, lane, half)
                store_tile(tmp, warp // 2 * B, 0, acc, 1.0, lane, half)
        sync(bar_id, nthreads)
        for half in T.unroll(2):
            if warp % 2 == half:
                r = warp // 2 * 2 + 1
                zero8(acc)
                block_product(acc, ahi, alo, bhi, blo, lane, ainv, r * B, r * B, tmp, warp // 2 * B, 0, half, terms)
                store_tile(ainv, r * B, (r - 1) * B, acc, -1.0, lane, half)
                if out is not None:
                    store_scaled(out, out_stage, r * B, (r - 1) * B, acc, beta, bi, lane, half)
        sync(bar_id, nthreads)
    else:  # one warp per 16 x 16 block
        if warp < 2:
            r = warp * 2 + 1
            zero8(acc)
            block_product(acc, ahi, alo, bhi, blo, lane, kk_s, r * B, (r - 1) * B, ainv, (r - 1) * B, (r - 1) * B,
                          None, terms)
            rows_times_beta(acc, beta, bi, r * B, lane)
            store_tile(tmp, warp * B, 0, acc, 1.0, lane)
        sync(bar_id, nthreads)
        if warp < 2:
            r = warp * 2 + 1
            zero8(acc)
            block_product(acc, ahi, alo, bhi, blo, lane, ainv, r * B, r * B, tmp, warp * B, 0, None, terms)
            store_tile(ainv, r * B, (r - 1) * B, acc, -1.0, lane)
            if out is not None:
                store_scaled(out, out_stage, r * B, (r - 1) * B, acc, beta, bi, lane)
        sync(bar_id, nthreads)
    r3 = warp // 2 + 2  # this warp's block (r3, c3) of the lower-left 32 x 32 block
    c3 = warp % 2
    zero8(acc)
    for m in T.unroll(2):  # sum over m = c3..1 of L_r3,m A_m,c3 (A is lower triangular)
        if m >= c3:
            block_product(acc, ahi, alo, bhi, blo, lane, kk_s, r3 * B, m * B, ainv, m * B, c3 * B, None, terms)
    rows_times_beta(acc, beta, bi, r3 * B, lane)
    store_tile(tmp, (r3 - 2) * B, c3 * B, acc, 1.0, lane)
    sync(bar_id, nthreads)
    zero8(acc)
    for m in T.unroll(2, NB):  # sum over m = 2..r3 of A_r3,m tmp_m,c3
        if m <= r3:
            block_product(acc, ahi, alo, bhi, blo, lane, ainv, r3 * B, m * B, tmp, (m - 2) * B, c3 * B, None, terms)
    if out is None:
        store_tile(ainv, r3 * B, c3 * B, acc, -1.0, lane)
    else:  # the last blocks: only the scaled copy is read afterwards
        store_scaled(out, out_stage, r3 * B, c3 * B, acc, beta, bi, lane)
    sync(bar_id, nthreads)
