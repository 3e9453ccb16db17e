"""The warp split of the chains' K x BV state products (gdn_bwd_dh's dS, gdn_bwd_recompute's S)."""
import tilelang.language as T


def state_policy(K: int):
    """By rows where K = 128 splits into the two warpgroups' 64-row wgmmas: each takes 64 rows and all BV columns.
    TileLang's default (Square) gave each all K rows of BV / 2 columns, twice the wgmma instructions at N = 16 on
    the chains' last dependent step (ncu, hk16_hv32 8k_1seq: gdn_bwd_dh 250.8 -> 229.0 us)."""
    return T.GemmWarpPolicy.FullRow if K >= 128 else T.GemmWarpPolicy.Square
