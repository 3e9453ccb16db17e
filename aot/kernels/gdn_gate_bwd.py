"""The backward of FLA's gate / beta activations (gate_mode, aot/kernels/gate_act.py) after gdn_bwd_chunk, whose plain
build returns dg / dbeta with respect to g_log / beta (it reads the activated beta that the recompute's gdn_prepare
stored). In place on those outputs:
    d b  = dbeta * beta (1 - beta / m)                                (BETA_SIGMOID; beta the activated one)
    d g  = dg_log * (-exp(A_log) sigmoid(g + dt_bias)), 1 for sigmoid above softplus's threshold        (GATE)
and dA_log's terms dg_log * g_log and dt_bias's d g summed per v-head into part [2, Hv, NP].
Inside gdn_bwd_chunk (255 registers with spills) the same code cost 11-16% of that kernel on an H100 (2B-TP1
28672+4096: 0.737 -> 0.851 ms, 0.063 ms of it from the code's mere presence).

A warp's lanes hold hb consecutive v-heads (hb = 8, 16 or 32, the host's choice for Hv) of 32 / hb tokens (coalesced
rows), and each thread issues its E tokens' loads before any arithmetic: one memory round trip a step, not one a
token. A step is STEP(hb) = 8 warps x 32 / hb tokens x E. Two builds:
  tiles    one step a CTA (grid: steps x head blocks); part[:, h, step] per CTA, which the host adds over the steps
           (backward.gate_sums: one torch sum, a fixed order);
  cluster  a cluster of CLUSTER CTAs per head block takes every step (CTA r: steps r, r + CLUSTER, ...); each CTA
           sends its sums to rank 0's shared memory, which adds them in rank order into part[:, h, 0] (NP = 1: no
           torch sum). For calls of a few steps a CTA, where the sum's launch (~2.4 us on an H100) and the tiles'
           ~3.5 us were a fixed cost of several percent (TP8 1x2048 forward + backward: 0.19 ms).
Both orders are fixed: repeats are bit-identical.
"""
import tilelang.language as T

from .gate_act import BETA_SIGMOID, GATE, beta_slope, exp_neg_abs, head_bias, neg_rate, softplus, softplus_slope

VARIANTS = {"mode": ["tiles", "cluster"]}
WARPS = 8
THREADS = WARPS * 32
E = 8         # tokens a thread loads per step
CLUSTER = 8   # CTAs a cluster (portable size)


def step_tokens(hb: int) -> int:
    """Tokens a CTA covers in one step at hb lanes per token (the host sizes the grid by it)."""
    return WARPS * (32 // hb) * E


def build(mode: str):
    cluster = mode == "cluster"
    NT = T.dynamic("NT")
    Hv = T.dynamic("Hv")
    NP = T.dynamic("NP")  # part's slots: ns (tiles) or 1 (cluster)

    @T.macro
    def step(g, beta, dg, dbeta, s, h, slot, tpw, gl, dl, bl, dbl, val, hp, acc, gate_mode):
        """One step's E tokens of this thread: loads, then the stores and the head's running sums."""
        gate = (gate_mode & GATE) != 0
        sig = (gate_mode & BETA_SIGMOID) != 0
        for i in T.unroll(E):
            t = (s * E + i) * WARPS * tpw + slot
            gl[i] = T.if_then_else(gate and t < NT, g[t, h], 0.0)
            dl[i] = T.if_then_else(gate and t < NT, dg[t, h], 0.0)
            bl[i] = T.if_then_else(sig and t < NT, beta[t, h], 0.0)
            dbl[i] = T.if_then_else(sig and t < NT, dbeta[t, h], 0.0)
        for i in T.unroll(E):
            t = (s * E + i) * WARPS * tpw + slot
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

    def buffers():
        """red: every thread's two sums; per thread its step's E tokens (gl, dl, bl, dbl), val, the head's
        parameters hp (A_log, dt_bias, then -exp(A_log) and its bias) and its running sums acc."""
        return (T.alloc_shared((2, THREADS), "float32"),
                *(T.alloc_local((E,), "float32") for _ in range(4)),
                *(T.alloc_local((2,), "float32") for _ in range(3)))

    @T.macro
    def body(g, A_log, dt_bias, beta, dg, dbeta, gate_mode, hb, ns, bx, by, red, gl, dl, bl, dbl, val, hp, acc):
        """This CTA's steps (tiles: step bx; cluster: rank, rank + CLUSTER, ... < ns); threads tid < hb end with
        head by * hb + tid's two sums over the CTA in val."""
        tid = T.get_thread_binding()
        lane = tid % 32
        tpw = 32 // hb
        slot = (tid // 32) * tpw + lane // hb  # the thread's token within a step's group of WARPS * tpw
        h = by * hb + lane % hb
        acc[0] = 0.0
        acc[1] = 0.0
        if h < Hv:
            # the head's parameters in the same round trip as the first step's loads (the stand-in addresses are
            # valid without GATE / GATE_BIAS)
            hp[0] = A_log[h]
            hp[1] = dt_bias[h]
            hp[0] = neg_rate(hp[0])
            hp[1] = head_bias(hp[1], gate_mode)
            if cluster:
                for it in T.serial(T.ceildiv(ns - T.block_rank_in_cluster(), CLUSTER)):
                    step(g, beta, dg, dbeta, T.block_rank_in_cluster() + it * CLUSTER, h, slot, tpw, gl, dl, bl, dbl,
                         val, hp, acc, gate_mode)
            else:
                step(g, beta, dg, dbeta, bx, h, slot, tpw, gl, dl, bl, dbl, val, hp, acc, gate_mode)
        red[0, tid] = acc[0]
        red[1, tid] = acc[1]
        T.sync_threads()
        if tid < hb:  # head by * hb + tid: every warp's lanes of that head, in a fixed order
            val[0] = 0.0
            val[1] = 0.0
            for w in T.serial(WARPS):
                for u in T.serial(tpw):
                    val[0] += red[0, w * 32 + u * hb + tid]
                    val[1] += red[1, w * 32 + u * hb + tid]

    if not cluster:
        @T.prim_func
        def gdn_gate_bwd(
            g: T.Tensor((NT, Hv), "float32"),        # the raw gate (GATE)
            A_log: T.Tensor((Hv,), "float32"),
            dt_bias: T.Tensor((Hv,), "float32"),     # read with GATE_BIAS only
            beta: T.Tensor((NT, Hv), "float32"),     # the activated beta (BETA_SIGMOID)
            dg: T.Tensor((NT, Hv), "float32"),       # dg_log in, d g out
            dbeta: T.Tensor((NT, Hv), "float32"),    # dbeta in, d b out
            part: T.Tensor((2, Hv, NP), "float32"),  # dA_log's and dt_bias's sums per step (GATE)
            gate_mode: T.int32,
            hb: T.int32,                             # lanes a token: 8, 16 or 32
            ns: T.int32,                             # steps: ceil(NT / step_tokens(hb))
        ):
            with T.Kernel(ns, T.ceildiv(Hv, hb), threads=THREADS) as (bx, by):
                red, gl, dl, bl, dbl, val, hp, acc = buffers()
                body(g, A_log, dt_bias, beta, dg, dbeta, gate_mode, hb, ns, bx, by, red, gl, dl, bl, dbl, val, hp, acc)
                if (gate_mode & GATE) != 0 and T.get_thread_binding() < hb and by * hb + T.get_thread_binding() < Hv:
                    part[0, by * hb + T.get_thread_binding(), bx] = val[0]
                    part[1, by * hb + T.get_thread_binding(), bx] = val[1]

        return gdn_gate_bwd

    @T.prim_func
    def gdn_gate_bwd(
        g: T.Tensor((NT, Hv), "float32"),
        A_log: T.Tensor((Hv,), "float32"),
        dt_bias: T.Tensor((Hv,), "float32"),
        beta: T.Tensor((NT, Hv), "float32"),
        dg: T.Tensor((NT, Hv), "float32"),
        dbeta: T.Tensor((NT, Hv), "float32"),
        part: T.Tensor((2, Hv, NP), "float32"),      # [:, h, 0]: the sums over every step
        gate_mode: T.int32,
        hb: T.int32,
        ns: T.int32,
    ):
        with T.ClusterKernel(CLUSTER, T.ceildiv(Hv, hb), cluster_dims=(CLUSTER, 1, 1), threads=THREADS) as (bx, by):
            gather = T.alloc_shared((CLUSTER * 2 * 32,), "float32")  # rank 0's: every rank's sums, [rank, 2, head]
            mine = T.alloc_shared((2 * 32,), "float32")
            red, gl, dl, bl, dbl, val, hp, acc = buffers()
            rank = T.block_rank_in_cluster()
            tid = T.get_thread_binding()
            body(g, A_log, dt_bias, beta, dg, dbeta, gate_mode, hb, ns, bx, by, red, gl, dl, bl, dbl, val, hp, acc)
            if tid < hb:
                mine[tid] = val[0]
                mine[32 + tid] = val[1]
            T.cluster_sync()  # rank 0's gather is free (every CTA of the cluster has started)
            if tid < hb:
                T.copy_cluster(mine[tid:tid + 1], gather[rank * 64 + tid:rank * 64 + tid + 1], dst_block=0)
                T.copy_cluster(mine[32 + tid:33 + tid], gather[rank * 64 + 32 + tid:rank * 64 + 33 + tid],
                               dst_block=0)
            T.cluster_sync()  # every rank's sums are in rank 0's gather
            if rank == 0 and (gate_mode & GATE) != 0 and tid < hb and by * hb + tid < Hv:
                val[0] = 0.0
                val[1] = 0.0
                for r in T.serial(CLUSTER):
                    val[0] += gather[r * 64 + tid]
                    val[1] += gather[r * 64 + 32 + tid]
                part[0, by * hb + tid, 0] = val[0]
                part[1, by * hb + tid, 0] = val[1]

    return gdn_gate_bwd
