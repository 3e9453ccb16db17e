"""TileLang helpers shared by several kernels (build_matrix hashes this file into every kernel that imports it)."""
import tilelang.language as T

# use_qk_l2norm_in_kernel: x / sqrt(sum x^2 + eps) (gdn_prepare) and its backward (gdn_bwd_chunk);
# flash_qla/reference.py L2NORM_EPS, FLA's and FlashQLA's
L2NORM_EPS = 1e-6


@T.macro
def last_at_most(table, x, found):
    """found[0] = the largest n in [0, found[1]] with table[n] <= x, for a non-decreasing table with
    table[0] <= x: a binary search of at most 32 steps; the caller sets the upper bound found[1] (a macro
    argument bound to a run-time size would become a kernel parameter of its own). With chunk_offsets and
    found[1] = N it is the sequence that owns chunk slot x (N for slots past the last chunk, which callers test
    against chunk_offsets[N]); with a sequence's first segment and found[1] = N - 1, the sequence of segment x."""
    found[0] = 0
    for _ in T.serial(32):
        if found[0] < found[1]:
            mid = (found[0] + found[1] + 1) // 2
            if table[mid] <= x:
                found[0] = mid
            else:
                found[1] = mid - 1
