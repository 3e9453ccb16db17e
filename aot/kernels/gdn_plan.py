"""chunk_offsets[n] = sum over m < n of ceil(len_m / 64): where each sequence's chunks start; seq_order: the
sequences by chunk count, longest first.

One CTA scans the sequence lengths 1024 at a time (block-wide inclusive scan plus a running carry), so
the planning of a packed batch is one launch on the device and never a host synchronisation.
seq_order is the chain kernels' dispatch order (CTA z walks sequence seq_order[z]): a batch's chains have unequal
lengths, and when they outnumber the SMs, a long chain whose CTAs happen to be dispatched last ends after
everything else (hk4_hv8 32k_8seq: its 9932-token sequence is the seventh of eight). Longest first is the
classic list-scheduling order. Up to one tile of sequences each thread ranks its own by counting the longer ones
(ties: the lower index first); beyond that the sequences are many and short, and the order is the identity. Only
the backward's chains use it (want_order); the forward skips the ranking.
"""
import tilelang.language as T

C = 64
VARIANTS = {"tile": [1024]}
THREADS = 1024


def build(tile: int):
    N = T.dynamic("N")
    Z = T.dynamic("Z")

    @T.prim_func
    def gdn_plan(cu_seqlens: T.Tensor((N + 1,), "int32"), chunk_offsets: T.Tensor((N + 1,), "int32"),
                 seq_order: T.Tensor((N,), "int32"), zero: T.Tensor((Z,), "int32"), want_order: T.int32):
        with T.Kernel(1, threads=THREADS) as _:
            # Z words zeroed for a later launch of the same call (gdn_gate_bwd's tickets): no memset node
            for blk in T.serial(T.ceildiv(Z, tile)):
                if blk * tile + T.get_thread_binding() < Z:
                    zero[blk * tile + T.get_thread_binding()] = 0
            counts = T.alloc_shared((tile,), "int32")
            lens = T.alloc_shared((tile,), "int32")  # chunk counts for the ranking (counts holds the scan)
            carry = T.alloc_shared((1,), "int32")
            rank = T.alloc_var("int32")
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
            tid = T.get_thread_binding()
            if want_order != 0:  # the forward's chains do not use the order (the ranking is O(N) per thread)
                if N <= tile:
                    lens[tid] = 0
                    if tid < N:
                        lens[tid] = T.ceildiv(cu_seqlens[tid + 1] - cu_seqlens[tid], C)
                    T.sync_threads()
                    if tid < N:
                        rank = 0
                        for m in T.serial(N):
                            if lens[m] > lens[tid] or (lens[m] == lens[tid] and m < tid):
                                rank = rank + 1
                        seq_order[rank] = tid
                else:
                    for blk in T.serial(T.ceildiv(N, tile)):
                        if blk * tile + tid < N:
                            seq_order[blk * tile + tid] = blk * tile + tid

    return gdn_plan
