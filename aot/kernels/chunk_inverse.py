"""The gate-free inverse of one 64-token chunk on a one-warpgroup CTA (gdn_prepare): A = (I + strictLower(diag(beta)
K K^T))^-1 in fp32.

Blocked: the four 16 x 16 diagonal blocks by forward substitution in parallel (one thread per column, 16 rows
deep, fp32 FMA), then the blocks below the diagonal by recursive doubling, A_rc = -A_rr L_rc A_cc on the two
32 x 32 diagonal blocks and then the 32 x 32 block below them, each product a warp's 16 x 16 tile on the tensor
cores (mma m16n8k8 in 3xTF32, about fp32 accuracy): 4 products deep with 4 barriers. gdn_fwd_fused's aux warpgroup
makes its gated, beta-scaled form from 16-bit tiles instead (inverse_mma.py).
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
def block_product(acc, ahi, alo, bhi, blo, lane, a, a_row, a_col, b, b_row, b_col):
    """acc (a warp's 16 x 16 tile in the m16n8 accumulator layout: element n * 4 + u is row lane / 4 + u // 2 * 8,
    column n * 8 + lane % 4 * 2 + u % 2) += a[a_row:+16, a_col:+16] @ b[b_row:+16, b_col:+16] on the tensor
    cores, as 3xTF32 (hi hi + hi lo + lo hi: about fp32 accuracy)."""
    for kx in T.unroll(2):
        for u in T.unroll(4):
            split_tf32(a[a_row + lane // 4 + u % 2 * 8, a_col + kx * 8 + lane % 4 + u // 2 * 4], ahi, alo, u)
        for n in T.unroll(2):
            for u in T.unroll(2):
                split_tf32(b[b_row + kx * 8 + lane % 4 + u * 4, b_col + n * 8 + lane // 4], bhi, blo, u)
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
def rows_times_beta(acc, beta, bi, row, lane):
    """L = diag(beta) K K^T: beta scales the tile's rows after the product."""
    for u in T.unroll(8):
        acc[u] = acc[u] * beta[bi, row + lane // 4 + u % 4 // 2 * 8]


@T.macro
def store_tile(dst, row, col, acc, sign, lane):
    for n in T.unroll(2):
        for hh in T.unroll(2):
            for u in T.vectorized(2):
                dst[row + lane // 4 + hh * 8, col + n * 8 + lane % 4 * 2 + u] = acc[n * 4 + hh * 2 + u] * sign


@T.macro
def substitute_diagonal(kk_s, beta, bi, x, dot, tid):
    """The diagonal 16 x 16 blocks by forward substitution in fp32 (threads tid < 64): x = column tid % 16 of block
    tid // 16's inverse, x_i = [i == col] - beta_i sum_{j<i} kk_s_ij x_j within the block (0 above the diagonal)."""
    d0 = (tid // B) * B
    for i in T.unroll(B):
        dot[0] = 0.0
        for j in T.unroll(i):
            dot[0] += kk_s[d0 + i, d0 + j] * x[j]
        x[i] = T.if_then_else(i == tid - d0, 1.0, -beta[bi, d0 + i] * dot[0])


@T.macro
def invert_chunk(kk_s, beta, bi, ainv, tmp, x, dot, acc, ahi, alo, bhi, blo, tid):
    """ainv (64 x 64 fp32, lower triangle and diagonal written) = the inverse, from kk_s = K K^T (fp32, read below
    the diagonal) and beta[bi, :], on a one-warpgroup CTA (its barriers are the CTA's). tid: 0..127. Ends with the
    barrier after the last write of ainv. x: 16 fp32 locals, dot: 1, acc: 8, ahi / alo: 4, bhi / blo: 2."""
    if tid < C:
        substitute_diagonal(kk_s, beta, bi, x, dot, tid)
        d0 = (tid // B) * B
        for i in T.unroll(B):
            ainv[d0 + i, tid] = x[i]
    T.sync_threads()
    warp = tid // 32
    lane = tid % 32
    # A_rc = -A_rr (L_rc A_cc): first the two 32 x 32 diagonal blocks (16 x 16 blocks (1, 0) and (3, 2), one warp
    # each), then the 32 x 32 block below them (16 x 16 blocks (2..3, 0..1), one warp each)
    if warp < 2:
        r = warp * 2 + 1
        zero8(acc)
        block_product(acc, ahi, alo, bhi, blo, lane, kk_s, r * B, (r - 1) * B, ainv, (r - 1) * B, (r - 1) * B)
        rows_times_beta(acc, beta, bi, r * B, lane)
        store_tile(tmp, warp * B, 0, acc, 1.0, lane)
    T.sync_threads()
    if warp < 2:
        r = warp * 2 + 1
        zero8(acc)
        block_product(acc, ahi, alo, bhi, blo, lane, ainv, r * B, r * B, tmp, warp * B, 0)
        store_tile(ainv, r * B, (r - 1) * B, acc, -1.0, lane)
    T.sync_threads()
    r3 = warp // 2 + 2  # this warp's block (r3, c3) of the lower-left 32 x 32 block
    c3 = warp % 2
    zero8(acc)
    for m in T.unroll(2):  # sum over m = c3..1 of L_r3,m A_m,c3 (A is lower triangular)
        if m >= c3:
            block_product(acc, ahi, alo, bhi, blo, lane, kk_s, r3 * B, m * B, ainv, m * B, c3 * B)
    rows_times_beta(acc, beta, bi, r3 * B, lane)
    store_tile(tmp, (r3 - 2) * B, c3 * B, acc, 1.0, lane)
    T.sync_threads()
    zero8(acc)
    for m in T.unroll(2, NB):  # sum over m = 2..r3 of A_r3,m tmp_m,c3
        if m <= r3:
            block_product(acc, ahi, alo, bhi, blo, lane, ainv, r3 * B, m * B, tmp, (m - 2) * B, c3 * B)
    store_tile(ainv, r3 * B, c3 * B, acc, -1.0, lane)
    T.sync_threads()
