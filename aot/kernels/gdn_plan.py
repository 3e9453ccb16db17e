"""chunk_offsets[n] = sum over m < n of ceil(len_m / 64): where each sequence's chunks start.

One CTA scans the sequence lengths 1024 at a time (block-wide inclusive scan plus a running carry), so
the planning of a packed batch is one launch on the device and never a host synchronisation.
"""
import tilelang.language as T

C = 64
VARIANTS = {"tile": [1024]}
THREADS = 1024


def build(tile: int):
    N = T.dynamic("N")

    @T.prim_func
    def gdn_plan(cu_seqlens: T.Tensor((N + 1,), "int32"), chunk_offsets: T.Tensor((N + 1,), "int32")):
        with T.Kernel(1, threads=THREADS) as _:
            counts = T.alloc_shared((tile,), "int32")
            carry = T.alloc_shared((1,), "int32")
            carry[0] = 0
            chunk_offsets[0] = 0
            for blk in T.serial(T.ceildiv(N, tile)):
                for i in T.Parallel(tile):
                    counts[i] = T.if_then_else(blk * tile + i < N,
                                               T.ceildiv(cu_seqlens[blk * tile + i + 1] - cu_seqlens[blk * tile + i], C), 0)
                T.cumsum(src=counts, dim=0)
                for i in T.Parallel(tile):
                    if blk * tile + i < N:
                        chunk_offsets[blk * tile + i + 1] = carry[0] + counts[i]
                if T.get_thread_binding() == 0:
                    carry[0] = carry[0] + counts[tile - 1]

    return gdn_plan
