"""Intra-card CP's tables in one launch: the segments of a packed batch and each (segment, v-head) warm-up.

The device form of flash_qla/cp.py's segment_tables + warmup_tables (the torch form, kept as the tested
specification, was ~80 small launches: ~0.1 ms of GPU time a call on the H200 and ~1.2 ms of host time).
A CTA per THREADS (segment slot, v-head) pairs:
  1. seg_base[n] = first segment of sequence n (an exclusive scan of ceil(chunks_n / L), `tile` at a time with a
     running carry, as gdn_plan's), seg_last[n] = its last segment (-1 for an empty sequence); every CTA runs the
     scan and stores the same values, then reads back its own;
  2. per (segment slot i, v-head), a thread each (padding slots past the last segment start at `tokens`): the
     sequence by binary search over seg_base, the segment's first token and chunk slot, and the head's warm-up: the
     fewest trailing chunks of the previous segment whose summed g is <= decay_bound (chunk totals: gdn_prepare's
     gamma at row 63), or the whole previous segment plus the exact-transition fallback when it never gets there or a
     token of it has beta |k|^2 outside [0, 2] (gdn_prepare's per-chunk bkk_max).
  With trail, the last sequence gets one more, empty segment at its end (its first token is the sequence's end):
     its warm-up walks the last segment's chunks as any segment's walks its predecessor's, so the pre-pass and the
     combine give the state LEAVING the sequence (multi-GPU CP's linked forward; cp.trailing_row is the torch form;
     the sequence must hold whole chunks, which the caller checks). seg_last stays the last real segment.
  3. with bidi (the backward), also the reverse warm-up: the fewest leading chunks of the NEXT segment of the
     sequence whose summed g is <= decay_bound -> rend (the range [seg_cu[i + 1], rend) that gdn_bwd_dh's state
     mode walks backwards), or all of the next segment plus the fallback flag (cp.reverse_warmup_tables).
Sums run in the torch form's order (latest chunk first for the forward, earliest first for the reverse, fp32).
"""
import tilelang.language as T

from .common import last_at_most

C = 64
VARIANTS = {"tile": [256]}
THREADS = 256
GROUP = 32  # warm-up chunks fetched together (a walk is latency-bound: L = 256 takes 8 rounds of loads, not 32)


@T.macro
def decay_walk(gam_t, bkk_max, h, first, step, count, decay_bound, tot, big, walk, w):
    """Walk count[0] chunk slots first, first + step, ... (step = -1: latest first, +1: earliest first) of head h:
    walk[0] = their g summed in that order, walk[1] = their largest beta |k|^2 (-1 for none), w[0] = the fewest
    chunks whose sum is <= decay_bound (0: never). The loads go out GROUP at a time (one after another they cost
    a DRAM latency per chunk: 0.038 ms at L = 32 on the H200; eight at a time, a 256-chunk walk still took 32
    rounds: 0.044 ms on a 256k-token, 8-head H100 forward)."""
    walk[0] = 0.0
    walk[1] = -1.0
    w[0] = 0
    for t0 in T.serial(T.ceildiv(count[0], GROUP)):
        for u in T.unroll(GROUP):
            tot[u] = T.if_then_else(t0 * GROUP + u < count[0],
                                    gam_t[h, (first + step * (t0 * GROUP + u)) * C + C - 1], 0.0)
            big[u] = T.if_then_else(t0 * GROUP + u < count[0], bkk_max[h, first + step * (t0 * GROUP + u)], -1.0)
        for u in T.unroll(GROUP):
            if t0 * GROUP + u < count[0]:
                walk[0] += tot[u]
                if w[0] == 0 and walk[0] <= decay_bound:
                    w[0] = t0 * GROUP + u + 1
                walk[1] = T.max(walk[1], big[u])


def build(tile: int):
    N = T.dynamic("N")
    S = T.dynamic("S")    # segment slots (an upper bound of the segment count)
    Hv = T.dynamic("Hv")
    TC = T.dynamic("TC")  # chunk slots x 64 of gdn_prepare's tiles

    @T.prim_func
    def gdn_cp_plan(
        cu_seqlens: T.Tensor((N + 1,), "int32"),
        chunk_offsets: T.Tensor((N + 1,), "int32"),
        gam_t: T.Tensor((Hv, TC), "float32"),
        bkk_max: T.Tensor((Hv, TC // C), "float32"),
        seg_cu: T.Tensor((S + 1,), "int32"),
        seg_slot: T.Tensor((S + 1,), "int32"),
        seg_base: T.Tensor((N + 1,), "int32"),
        seg_last: T.Tensor((N,), "int32"),
        start: T.Tensor((S, Hv), "int32"),
        fallback: T.Tensor((S, Hv), "int32"),
        rend: T.Tensor((S, Hv), "int32"),
        rfallback: T.Tensor((S, Hv), "int32"),
        L: T.int32,
        tokens: T.int32,
        decay_bound: T.float32,
        bidi: T.int32,
        trail: T.int32,
    ):
        with T.Kernel(T.ceildiv(S * Hv, THREADS), threads=THREADS) as bx:
            counts = T.alloc_shared((tile,), "int32")
            carry = T.alloc_shared((1,), "int32")
            seq = T.alloc_local((2,), "int32")  # last_at_most's bounds; seq[0]: the segment's sequence
            total = T.alloc_var("int32")
            walk = T.alloc_local((2,), "float32")  # decay_walk's summed g and largest beta |k|^2
            w = T.alloc_local((1,), "int32")        # its warm-up length (0: the bound never reached)
            count = T.alloc_local((1,), "int32")    # chunks to walk
            tot = T.alloc_local((GROUP,), "float32")
            big = T.alloc_local((GROUP,), "float32")
            # the pair's indices held in registers: as expressions they were re-evaluated at every use, a 64-bit
            # modulo by Hv per warm-up load (a division subroutine each: most of the kernel's 0.07 ms, H200)
            si = T.alloc_var("int32")  # segment slot
            h = T.alloc_var("int32")
            j = T.alloc_var("int32")
            scu = T.alloc_var("int32")
            sslot = T.alloc_var("int32")
            tid = T.get_thread_binding()
            carry[0] = 0
            seg_base[0] = 0
            for blk in T.serial(T.ceildiv(N, tile)):
                for i in T.Parallel(tile):
                    counts[i] = T.if_then_else(
                        blk * tile + i < N,
                        T.ceildiv(chunk_offsets[blk * tile + i + 1] - chunk_offsets[blk * tile + i], L)
                        + T.if_then_else(blk * tile + i == N - 1, trail, 0), 0)
                T.cumsum(src=counts, dim=0)
                for i in T.Parallel(tile):
                    if blk * tile + i < N:
                        seg_base[blk * tile + i + 1] = carry[0] + counts[i]
                        seg_last[blk * tile + i] = T.if_then_else(
                            chunk_offsets[blk * tile + i + 1] > chunk_offsets[blk * tile + i],
                            carry[0] + counts[i] - 1 - T.if_then_else(blk * tile + i == N - 1, trail, 0), -1)
                if tid == 0:
                    carry[0] = carry[0] + counts[tile - 1]
            T.sync_threads()  # seg_base is read back from global memory by every thread below
            total = seg_base[N]
            # one thread per (segment slot, v-head), THREADS pairs a CTA: the L-chunk walks run side by side (a
            # thread per slot walking every head took 0.040 ms on TP8 1x32768 at L = 32, H200; one CTA walking every
            # pair, 0.094 ms on a 1M-token, 8-head H100 forward; a CTA per 256 pairs with 32-chunk load groups,
            # 0.052 ms there and 0.031 on the 256k-token one, against 0.042)
            pair = bx * THREADS + tid
            if pair < S * Hv:
                si = pair // Hv
                h = pair % Hv
                seq[1] = N - 1
                last_at_most(seg_base, si, seq)  # the sequence of segment si
                j = si - seg_base[seq[0]]
                valid = si < total
                # (clamped to the sequence's end: only the trailing segment reaches it)
                scu = T.if_then_else(valid, T.min(cu_seqlens[seq[0]] + j * (L * C), cu_seqlens[seq[0] + 1]), tokens)
                sslot = T.if_then_else(valid, T.min(chunk_offsets[seq[0]] + j * L, chunk_offsets[seq[0] + 1]),
                                       chunk_offsets[N])
                if h == 0:
                    seg_cu[si] = scu
                    seg_slot[si] = sslot
                if j == 0 or not valid:  # a sequence's first segment (or padding): no warm-up
                    start[si, h] = scu
                    fallback[si, h] = 0
                else:  # the previous segment's chunks are slots sslot - count .. sslot - 1 (count = L but for
                    # the trailing segment's, whose predecessor may be shorter)
                    count[0] = sslot - (chunk_offsets[seq[0]] + (j - 1) * L)
                    decay_walk(gam_t, bkk_max, h, sslot - 1, -1, count, decay_bound, tot, big, walk, w)
                    if w[0] == 0 or walk[1] > 2.0:
                        start[si, h] = cu_seqlens[seq[0]] + (j - 1) * (L * C)
                        fallback[si, h] = 1
                    else:
                        start[si, h] = scu - w[0] * C
                        fallback[si, h] = 0
                if bidi != 0:  # the next segment of the sequence: its first chunks, earliest first
                    seq_end = cu_seqlens[seq[0] + 1]
                    count[0] = 0
                    if valid and scu + L * C < seq_end:
                        count[0] = T.min(T.ceildiv(seq_end - scu - L * C, C), L)
                    decay_walk(gam_t, bkk_max, h, sslot + L, 1, count, decay_bound, tot, big, walk, w)
                    if count[0] == 0:  # the sequence's last segment, or padding: an empty range
                        rend[si, h] = T.if_then_else(valid, T.min(scu + L * C, seq_end), tokens)
                        rfallback[si, h] = 0
                    elif w[0] == 0 or walk[1] > 2.0:
                        rend[si, h] = T.min(scu + 2 * L * C, seq_end)
                        rfallback[si, h] = 1
                    else:
                        rend[si, h] = T.min(scu + (L + w[0]) * C, seq_end)
                        rfallback[si, h] = 0
            if bx == 0 and tid == 0:
                seg_cu[S] = tokens
                seg_slot[S] = chunk_offsets[N]

    return gdn_cp_plan
