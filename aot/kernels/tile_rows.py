"""use_qk_l2norm_in_kernel on a shared-memory tile: one thread normalises one row in place (gdn_prepare)."""
import tilelang.language as T


@T.macro
def l2norm_row(tile, row, K, eps, l2n, nrm, out, out_row, out_head, store, r_out, r_which, r_row):
    """Row `row` of a (64, K) tile becomes x / sqrt(sum x^2 + eps): the sum in fp32, one rounding to the tile's
    dtype; where `store` holds, the row also goes to out[out_row, out_head, :] and its factor
    r = (sum x^2 + eps)^-1/2 to r_out[r_which, out_head, r_row] (r_row: the row's chunk-slot index, so the
    backward's l2norm epilogue loads a chunk's factors as one aligned TMA box; r_out None: no factors). l2n: 8 locals
    of the tile's dtype, nrm: 2 fp32 locals."""
    nrm[0] = 0.0
    for d0 in T.serial(K // 8):
        for u in T.vectorized(8):
            l2n[u] = tile[row, d0 * 8 + u]
        for u in T.unroll(8):
            nrm[0] += T.cast(l2n[u], "float32") * T.cast(l2n[u], "float32")
    nrm[1] = T.rsqrt(nrm[0] + eps)
    if r_out is not None:
        if store:
            r_out[r_which, out_head, r_row] = nrm[1]
    for d0 in T.serial(K // 8):
        for u in T.vectorized(8):
            l2n[u] = tile[row, d0 * 8 + u]
        for u in T.unroll(8):
            l2n[u] = T.cast(T.cast(l2n[u], "float32") * nrm[1], l2n.dtype)
        for u in T.vectorized(8):
            tile[row, d0 * 8 + u] = l2n[u]
        if store:
            for u in T.vectorized(8):
                out[out_row, out_head, d0 * 8 + u] = l2n[u]
