"""The gated chunk inverse as Agb = (Gamma * A) diag(beta) directly, from 16-bit tiles by ldmatrix and mma.sync.

With G = Gamma * K K^T (strictly lower part read) and L = I + strictLower(diag(beta) G), A = L^-1 and Agb = A diag(beta)
satisfy Agb_rc = -Agb_rr G_rc Agb_cc for the blocks below the diagonal, so the blocked doubling needs only G and the
Agb blocks already made: nothing of A but its diagonal blocks is ever kept. G is stored once in the storage dtype
(stmatrix from the K K^T accumulator), its diagonal blocks once in fp32 (the substitution's input);
every block product loads its operands by ldmatrix (two instructions a thread for a 16 x 16 x 16 product, where
fp32 fragment loads took sixteen) and runs as two m16n8k16 mma with fp32 accumulation; products whose result is the
B operand of the next are made transposed (X^T = Agb^T G^T), whose accumulator is then that operand as it stands.
Operand precision is the storage dtype's, Agb's own rounding. Addresses and C helpers: block_fragments.py.
"""
import tilelang.language as T

from .block_fragments import block_cols, block_rows
from .chunk_inverse import B, C, substitute_diagonal, zero8


@T.macro
def store_gated_kkt(kk, gm_s, kd_s, tid, suffix, row_floats):
    """G = the gated K K^T accumulator (kk, wgmma layout over the warpgroup) into gm_s (storage dtype, by stmatrix) and
    its four diagonal 16 x 16 blocks into kd_s (fp32; warp w stores block w, which it holds)."""
    lane = tid % 32
    warp = tid // 32
    for jj in T.unroll(C // 16):
        row, col = block_rows(lane, warp * 16, jj * 16)
        T.call_extern("handle", "fqla_stsm_" + suffix, T.address_of(gm_s[row, col]), kk.data, jj)
    T.call_extern("handle", "fqla_diag_store", T.address_of(kd_s[warp * 16 + lane // 4, warp * 16 + lane % 4 * 2]),
                  kk.data, warp, row_floats)


@T.macro
def invert_gated(kd_s, gm_s, beta, bi, out, st, x, dot, xt, y, tid, suffix, bar_id, pair_bar):
    """out[st] (64 x 64, storage dtype; its blocks above the diagonal untouched) = Agb, from kd_s / gm_s
    (store_gated_kkt) and beta[bi, :]. tid: 0..127 within the warpgroup, bar_id its named barrier, pair_bar and
    pair_bar + 1 two more (64 threads each); ends with a barrier after the last write. x: 16 fp32 locals, dot: 1,
    xt / y: 8."""
    # the diagonal blocks in fp32 (A_dd), then Agb_dd = A_dd diag(beta)
    if tid < C:
        substitute_diagonal(kd_s, beta, bi, x, dot, tid)
        d0 = (tid // B) * B
        dot[0] = beta[bi, tid]
        for i in T.unroll(B):
            out[st, d0 + i, tid] = T.cast(x[i] * dot[0], out.dtype)
    T.sync_threads(bar_id, 128)
    warp = tid // 32
    lane = tid % 32
    # the two 32 x 32 diagonal blocks: Agb_r,r-1 = -Agb_rr G_r,r-1 Agb_r-1,r-1 for r = 1, 3 (warps 0, 1)
    if warp < 2:
        r = warp * 2 + 1
        zero8(xt)
        ra, ca = block_cols(lane, (r - 1) * B, (r - 1) * B)
        rb, cb = block_cols(lane, r * B, (r - 1) * B)
        T.call_extern("handle", "fqla_inv_abt_" + suffix, xt.data, T.address_of(out[st, ra, ca]),
                      T.address_of(gm_s[rb, cb]), 1)
        zero8(y)
        ra, ca = block_rows(lane, r * B, r * B)
        T.call_extern("handle", "fqla_inv_y_" + suffix, y.data, T.address_of(out[st, ra, ca]), xt.data)
        ra, ca = block_rows(lane, r * B, (r - 1) * B)
        T.call_extern("handle", "fqla_inv_store_neg_" + suffix, T.address_of(out[st, ra, ca]), y.data)
    T.sync_threads(bar_id, 128)
    # the 32 x 32 block below them, a 16 x 16 block (r3, c3) a warp: Agb_r3,c3 = -sum_{m=2..r3} Agb_r3,m X_m,c3 with
    # X_m,c3 = sum_{m'=c3..1} G_m,m' Agb_m',c3; the warp of (2, c3) hands X_2,c3^T to the warp of (3, c3) through G's
    # block (0, 2 + c3) (above the diagonal: never read) on a barrier of the two warps (pair_bar + c3)
    r3 = warp // 2 + 2
    c3 = warp % 2
    zero8(xt)
    for m in T.unroll(2):
        if m >= c3:
            ra, ca = block_cols(lane, m * B, c3 * B)
            rb, cb = block_cols(lane, r3 * B, m * B)
            T.call_extern("handle", "fqla_inv_abt_" + suffix, xt.data, T.address_of(out[st, ra, ca]),
                          T.address_of(gm_s[rb, cb]), 1)
    if r3 == 2:
        ra, ca = block_rows(lane, 0, (2 + c3) * B)
        T.call_extern("handle", "fqla_stsm_" + suffix, T.address_of(gm_s[ra, ca]), xt.data, 0)
    zero8(y)
    ra, ca = block_rows(lane, r3 * B, r3 * B)
    T.call_extern("handle", "fqla_inv_y_" + suffix, y.data, T.address_of(out[st, ra, ca]), xt.data)
    T.sync_threads(pair_bar + c3, 64)
    if r3 == 3:
        ra, ca = block_rows(lane, 3 * B, 2 * B)
        rb, cb = block_cols(lane, 0, (2 + c3) * B)
        T.call_extern("handle", "fqla_inv_abt_" + suffix, y.data, T.address_of(out[st, ra, ca]),
                      T.address_of(gm_s[rb, cb]), 0)
    ra, ca = block_rows(lane, r3 * B, c3 * B)
    T.call_extern("handle", "fqla_inv_store_neg_" + suffix, T.address_of(out[st, ra, ca]), y.data)
    T.sync_threads(bar_id, 128)
