"""The backward of FLA's gate / beta activations (gate_mode, aot/kernels/gate_act.py) after gdn_bwd_chunk, whose plain
build returns dg / dbeta with respect to g_log / beta (it reads the activated beta that the recompute's gdn_prepare
stored). In place on those outputs:
    d b  = dbeta * beta (1 - beta / m)                                (BETA_SIGMOID; beta the activated one)
    d g  = dg_log * (-exp(A_log) sigmoid(g + dt_bias)), 1 for sigmoid above softplus's threshold        (GATE)
and dA_log's terms dg_log * g_log and dt_bias's d g, summed per (CTA's 64-token tile, v-head) into part, which the
host adds over the tiles (backward.gate_sums): a fixed order, no atomics, bit-identical repeats. (A last-CTA sum in
this kernel, by an atomic ticket, cost more than that torch sum: its tail read every tile serially, 6 / 56 us against
3.9 + 2.4 / 18 + 2.4 on 2048 x 8 / 32768 x 64.)
Inside gdn_bwd_chunk (255 registers with spills) the same code cost 11-16% of that kernel on an H100 (2B-TP1
28672+4096: 0.737 -> 0.851 ms, 0.063 ms of it from the code's mere presence). Here: a warp holds one token's 32
consecutive v-heads (coalesced), a CTA's eight warps every eighth token of its tile, and each thread issues all of
its loads before any arithmetic (one memory round trip, not one per token: a serial loop of dependent loads took
~16 us a launch on 2048 tokens).
"""
import tilelang.language as T

from .gate_act import BETA_SIGMOID, GATE, beta_slope, exp_neg_abs, head_bias, neg_rate, softplus, softplus_slope

VARIANTS = {"tile": [64]}
THREADS = 256
HB = 32                 # v-heads a CTA covers: one per lane
GROUPS = THREADS // HB  # tokens in flight per CTA (a warp each)


@T.macro
def fold(sums, acc, val, part, h, lane, grp, bx, Hv):
    """This CTA's per-head sums over its tile (the warps' in a fixed order) into part[:, h, bx]."""
    sums[0, grp, lane] = acc[0]
    sums[1, grp, lane] = acc[1]
    T.sync_threads()
    if grp == 0 and h < Hv:
        val[0] = 0.0
        val[1] = 0.0
        for k in T.unroll(GROUPS):
            val[0] += sums[0, k, lane]
            val[1] += sums[1, k, lane]
        part[0, h, bx] = val[0]
        part[1, h, bx] = val[1]


def build(tile: int):
    E = tile // GROUPS  # tokens per thread
    NT = T.dynamic("NT")
    Hv = T.dynamic("Hv")
    NB = T.dynamic("NB")  # token tiles: ceil(NT / tile)

    @T.prim_func
    def gdn_gate_bwd(
        g: T.Tensor((NT, Hv), "float32"),        # the raw gate (GATE)
        A_log: T.Tensor((Hv,), "float32"),
        dt_bias: T.Tensor((Hv,), "float32"),     # read with GATE_BIAS only
        beta: T.Tensor((NT, Hv), "float32"),     # the activated beta (BETA_SIGMOID)
        dg: T.Tensor((NT, Hv), "float32"),       # dg_log in, d g out
        dbeta: T.Tensor((NT, Hv), "float32"),    # dbeta in, d b out
        part: T.Tensor((2, Hv, NB), "float32"),  # dA_log's and dt_bias's sums per token tile (GATE)
        gate_mode: T.int32,
    ):
        with T.Kernel(NB, T.ceildiv(Hv, HB), threads=THREADS) as (bx, by):
            tid = T.get_thread_binding()
            lane = tid % HB
            grp = tid // HB
            h = by * HB + lane
            gate = (gate_mode & GATE) != 0
            sig = (gate_mode & BETA_SIGMOID) != 0
            sums = T.alloc_shared((2, GROUPS, HB), "float32")
            gl = T.alloc_local((E,), "float32")
            dl = T.alloc_local((E,), "float32")
            bl = T.alloc_local((E,), "float32")
            dbl = T.alloc_local((E,), "float32")
            val = T.alloc_local((2,), "float32")  # x = g + dt_bias, y = exp(-|x|)
            hp = T.alloc_local((2,), "float32")   # the head's A_log, dt_bias, then -exp(A_log), its bias
            acc = T.alloc_local((2,), "float32")
            acc[0] = 0.0
            acc[1] = 0.0
            if h < Hv:
                # the head's parameters in the same round trip as the tokens' inputs (the stand-in addresses are
                # valid without GATE / GATE_BIAS)
                hp[0] = A_log[h]
                hp[1] = dt_bias[h]
                for i in T.unroll(E):
                    t = bx * tile + i * GROUPS + grp
                    gl[i] = T.if_then_else(gate and t < NT, g[t, h], 0.0)
                    dl[i] = T.if_then_else(gate and t < NT, dg[t, h], 0.0)
                    bl[i] = T.if_then_else(sig and t < NT, beta[t, h], 0.0)
                    dbl[i] = T.if_then_else(sig and t < NT, dbeta[t, h], 0.0)
                hp[0] = neg_rate(hp[0])
                hp[1] = head_bias(hp[1], gate_mode)
                for i in T.unroll(E):
                    t = bx * tile + i * GROUPS + grp
                    if t < NT:
                        if sig:
                            dbeta[t, h] = dbl[i] * beta_slope(bl[i], gate_mode)
                        if gate:
                            val[0] = gl[i] + hp[1]
                            val[1] = exp_neg_abs(val[0])
                            acc[0] += dl[i] * (hp[0] * softplus(val[0], val[1]))
                            dl[i] = dl[i] * (hp[0] * softplus_slope(val[0], val[1]))
                            dg[t, h] = dl[i]
                            acc[1] += dl[i]
            if gate:
                fold(sums, acc, val, part, h, lane, grp, bx, Hv)

    return gdn_gate_bwd
