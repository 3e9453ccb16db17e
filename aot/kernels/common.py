"""TileLang helpers shared by several kernels (build_matrix hashes this file into every kernel that imports it)."""
import tilelang.language as T


@T.macro
def chunk_sequence(chunk_offsets, N, bc, seq):
    """seq[0] = the sequence that owns chunk slot bc of the packed batch: the largest n with chunk_offsets[n] <= bc
    (a binary search of at most 32 steps; slots past the last chunk get N, which callers test against
    chunk_offsets[N])."""
    seq[0] = 0
    seq[1] = N
    for _ in T.serial(32):
        if seq[0] < seq[1]:
            mid = (seq[0] + seq[1] + 1) // 2
            if chunk_offsets[mid] <= bc:
                seq[0] = mid
            else:
                seq[1] = mid - 1
