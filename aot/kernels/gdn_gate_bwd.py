"""The backward of FLA's gate / beta activations (gate_mode, aot/kernels/gate_act.py) after gdn_bwd_chunk, whose plain
build returns dg / dbeta with respect to g_log / beta (it reads the activated beta that the recompute's gdn_prepare
stored). In place on those outputs:
    d b  = dbeta * beta (1 - beta / m)                                (BETA_SIGMOID; beta the activated one)
    d g  = dg_log * (-exp(A_log) sigmoid(g + dt_bias)), 1 for sigmoid above softplus's threshold        (GATE)
and dA_log's terms dg_log * g_log and dt_bias's d g summed per v-head.
Inside gdn_bwd_chunk (255 registers with spills) the same code cost 11-16% of that kernel on an H100 (2B-TP1
28672+4096: 0.737 -> 0.851 ms, 0.063 ms of it from the code's mere presence).

A warp's lanes hold hb consecutive v-heads (hb = 8, 16 or 32: a build each, the host's choice for Hv; a runtime hb made
every index a 64-bit division and the kernel ~10x slower) of 32 / hb tokens (coalesced rows), and each thread issues
its E tokens' loads before any arithmetic (one memory round trip). A CTA covers one step of step_tokens(hb) tokens
and writes its per-head sums to part[:, h, 1 + step]. Two builds for the sums over the steps:
  tiles    the host adds part over the steps (one torch sum launch: calls of many steps);
  ticket   the CTA that finishes its head block last (an atomic ticket per head block, zeroed by the backward's gdn_plan
           and reset by that CTA) adds the block's slots in a fixed order, all threads at once, into part[:, :, 0]: no
           second launch, whose ~2.4 us and graph node were a fixed cost of several percent on small calls (TP8
           1x2048 forward + backward: 0.19 ms). A cluster of 8 CTAs per head block summing over DSMEM cost more
           (6 / 17 us on 2048 x 8 / 8192 x 8: too few CTAs, and the cluster's own overhead).
Both orders are fixed whichever CTA ends last: repeats are bit-identical.
"""
import tilelang.language as T

from .gate_act import BETA_SIGMOID, GATE, beta_slope, exp_neg_abs, head_bias, neg_rate, softplus, softplus_slope

VARIANTS = {"mode": ["tiles", "ticket"], "hb": [8, 16, 32]}
WARPS = 8
THREADS = WARPS * 32
E = 8  # tokens a thread loads


def step_tokens(hb: int) -> int:
    """Tokens a CTA covers in one step at hb lanes per token (the host sizes the grid by it)."""
    return WARPS * (32 // hb) * E


def build(mode: str, hb: int):
    ticketed = mode == "ticket"
    tpw = 32 // hb  # tokens a warp covers: a constant, so the index math is shifts and masks
    G = THREADS // (2 * hb)  # the tail's threads per (sum, head)
    NT = T.dynamic("NT")
    Hv = T.dynamic("Hv")
    NP = T.dynamic("NP")  # part's slots: 1 + steps
    NB = T.dynamic("NB")  # tickets: head blocks (ticket build)

    @T.prim_func
    def gdn_gate_bwd(
        g: T.Tensor((NT, Hv), "float32"),        # the raw gate (GATE)
        A_log: T.Tensor((Hv,), "float32"),
        dt_bias: T.Tensor((Hv,), "float32"),     # read with GATE_BIAS only
        beta: T.Tensor((NT, Hv), "float32"),     # the activated beta (BETA_SIGMOID)
        dg: T.Tensor((NT, Hv), "float32"),       # dg_log in, d g out
        dbeta: T.Tensor((NT, Hv), "float32"),    # dbeta in, d b out
        part: T.Tensor((2, Hv, NP), "float32"),  # [.., 1 + step]: a step's sums (GATE); [.., 0]: the total (ticket)
        ticket: T.Tensor((NB,), "int32"),        # zero on entry, left zero (ticket build)
        gate_mode: T.int32,
    ):
        with T.Kernel(NP - 1, T.ceildiv(Hv, hb), threads=THREADS) as (bx, by):
            red = T.alloc_shared((2, THREADS), "float32")
            last = T.alloc_shared((1,), "int32")
            gl, dl, bl, dbl = (T.alloc_local((E,), "float32") for _ in range(4))
            # val: x = g + dt_bias, y = exp(-|x|); hp: the head's A_log, dt_bias, then -exp(A_log), its bias
            val, hp, acc = (T.alloc_local((2,), "float32") for _ in range(3))
            tid = T.get_thread_binding()
            lane = tid % 32
            slot = (tid // 32) * tpw + lane // hb  # the thread's token within the step's rows of WARPS * tpw
            h = by * hb + lane % hb
            gate = (gate_mode & GATE) != 0
            sig = (gate_mode & BETA_SIGMOID) != 0
            acc[0] = 0.0
            acc[1] = 0.0
            if h < Hv:
                # the head's parameters in the same round trip as the tokens' inputs (the stand-in addresses are
                # valid without GATE / GATE_BIAS)
                hp[0] = A_log[h]
                hp[1] = dt_bias[h]
                for i in T.unroll(E):
                    t = (bx * E + i) * WARPS * tpw + slot
                    gl[i] = T.if_then_else(gate and t < NT, g[t, h], 0.0)
                    dl[i] = T.if_then_else(gate and t < NT, dg[t, h], 0.0)
                    bl[i] = T.if_then_else(sig and t < NT, beta[t, h], 0.0)
                    dbl[i] = T.if_then_else(sig and t < NT, dbeta[t, h], 0.0)
                hp[0] = neg_rate(hp[0])
                hp[1] = head_bias(hp[1], gate_mode)
                for i in T.unroll(E):
                    t = (bx * E + i) * WARPS * tpw + slot
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
                red[0, tid] = acc[0]
                red[1, tid] = acc[1]
                T.sync_threads()
                if tid < hb and by * hb + tid < Hv:  # head by * hb + tid: its lanes of every warp, a fixed order
                    val[0] = 0.0
                    val[1] = 0.0
                    for w in T.serial(WARPS):
                        for u in T.unroll(tpw):
                            val[0] += red[0, w * 32 + u * hb + tid]
                            val[1] += red[1, w * 32 + u * hb + tid]
                    part[0, by * hb + tid, 1 + bx] = val[0]
                    part[1, by * hb + tid, 1 + bx] = val[1]
                if ticketed:
                    T.call_extern("handle", "__threadfence")  # this CTA's sums are visible before its ticket
                    T.sync_threads()
                    if tid == 0:
                        last[0] = T.atomic_add(ticket[by], 1, return_prev=True)
                    T.sync_threads()
                    if last[0] == NP - 2:  # every other CTA of the block has added its sums
                        T.call_extern("handle", "__threadfence")
                        # thread (r, q, j): sum q of head by * hb + j over the slots r, r + G, ... (E loads in
                        # flight a round, the adds in slot order); then the G partial sums in order r = 0, 1, ...
                        val[0] = 0.0
                        for b in T.serial(T.ceildiv(NP - 1, G * E)):
                            for u in T.unroll(E):
                                gl[u] = T.if_then_else(
                                    (b * E + u) * G + tid // (2 * hb) < NP - 1 and by * hb + tid % hb < Hv,
                                    part[tid // hb % 2, by * hb + tid % hb, 1 + (b * E + u) * G + tid // (2 * hb)],
                                    0.0)
                            for u in T.unroll(E):
                                val[0] += gl[u]
                        red[0, tid] = val[0]
                        T.sync_threads()
                        if tid < 2 * hb and by * hb + tid % hb < Hv:
                            val[1] = 0.0
                            for r in T.serial(G):
                                val[1] += red[0, r * 2 * hb + tid]
                            part[tid // hb, by * hb + tid % hb, 0] = val[1]
                        if tid == 0:
                            ticket[by] = 0  # for the next call on the same tables

    return gdn_gate_bwd
