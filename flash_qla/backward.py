"""The sm_90a GDN backward: recompute, reverse state recurrence, chunk-parallel gradients.

1. Recompute the forward intermediates (gdn_plan, gdn_prepare, then gdn_bwd_recompute, which
   stores each chunk's entering state and W, Vnew): nothing but the inputs is saved by the forward (the low-level
   API's caller passes the forward's A and g cumsum, which gdn_prepare then reads as they are). The save
   build runs beside step 2 on a side stream (tuning.save_chain_beside_dh; else before it on the caller's stream).
2. gdn_bwd_dh walks each (sequence, v-head, V-block) chain backwards: per chunk the leaving-state gradient
   dh, X = dL/dVnew and dV; dh0 at the end. With intra-card CP (when the recompute used it) the chains are the
   segments, from gradients a reverse warm-up pre-pass and a reverse combine give them; that pre-pass starts on
   its own stream as soon as the recompute's CP tables exist, beside the recompute's own pre-pass.
3. gdn_bwd_chunk turns those into dq, dk, dbeta, dg per (chunk, v-head), fused (the math is
   flash_qla.chunk_grads', whose batched-torch form `_chunk_parallel` is the CPU-tested specification);
   one CTA per (chunk, q/k head) sums the GVA group's dq/dk in shared memory (no extra pass). With
   use_qk_l2norm_in_kernel the recompute's gdn_prepare normalises q / k (as in the forward) and gdn_bwd_chunk's
   epilogue differentiates the normalisation from the raw rows: no torch pass, no autograd.
With FLA's fused activations (a gates.KernelGate) the recompute activates the raw g / beta as the forward did;
gdn_prepare also stores the activated beta for gdn_bwd_chunk (beta logits only), and gdn_gate_bwd, after it, turns
dg / dbeta into the gradients of the raw g and beta logits and sums dA_log and dt_bias's gradient per v-head (its
last CTA of each head block on small calls, one torch sum of its per-step sums on large ones).
No host synchronisation: the whole backward can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import forward as fwd
from .chunk_grads import chunk_gradients, compute_dtype, from_slots, reverse_chunk_cumsum, slot_map, to_slots
from .gates import BETA_SIGMOID, NO_GATE, KernelGate
from .launch import CHUNK, DTYPE_TAG, current_stream, dense, empty, join, launch, num_sms, packed, side_stream
from .states import PLAIN_IO, V_FIRST, StateIO
from .tuning import settings
from .validation import Problem, validate_inputs

DH_KERNEL = "gdn_bwd_dh"
CHUNK_KERNEL = "gdn_bwd_chunk"
GATE_KERNEL = "gdn_gate_bwd"  # FLA's activations' gradients after gdn_bwd_chunk
# gdn_gate_bwd's shape (aot/kernels/gdn_gate_bwd.py: WARPS, E): a CTA covers 8 warps x 32 / hb tokens x 8; up to
# GATE_TICKET_STEPS CTAs a head block, the last of them adds the block's sums (its ticket build), beyond that one torch
# sum does (there the last CTA's walk over the slots would outgrow the launch it saves)
GATE_WARPS, GATE_E = 8, 8
GATE_TICKET_STEPS = 64


def backward(problem: Problem, q, k, v, g, beta, initial_state: Optional[torch.Tensor], cu_seqlens,
             use_qk_l2norm: bool, do: torch.Tensor, dht: Optional[torch.Tensor], A: Optional[torch.Tensor] = None,
             g_is_cumsum: bool = False, v_first: bool = False, gate: KernelGate = NO_GATE, before_dht=None,
             longest: Optional[int] = None):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) of the forward's (o, final state) given (do, dht), in the kernels'
    dtypes (dg and dbeta float32; flash_qla/kernel_api.py converts). dg is with respect to the raw g; dh0 is None without an
    initial state, and a forward.SegmentStates when the recompute ran intra-card CP. A: the forward's gate-free inverse
    when the caller kept it (FlashQLA's low-level API), read instead of solved again; g_is_cumsum: g is the chunk-local
    cumsum (that API's form; dg is still with respect to the raw g). v_first: initial_state, dht and the returned dh0
    are [N, Hv, V, K], read and written so by the kernels (only where native_v_first says so: no intra-card CP).
    gate: FLA's activations applied by the kernels (g / beta are the raw gate / logits; dg and dbeta are with respect to
    them); with gate.gate a seventh result, [2, Hv] fp32: dA_log's (0) and dt_bias's (1) gradients (gate_sums).
    before_dht (context parallelism across ranks, flash_qla/distributed.py): called once, right before the first
    launch that reads dht (the dh chain's reverse combine, or the chain), with every earlier launch queued: dht (a
    float32 contiguous tensor, read in place) may be written in between by work it queues on another stream, the
    current stream waiting for it. longest: the longest sequence's tokens when the host knows the lengths: both chains'
    V block is then planned for the batch's own skew (forward._block_v), not an assumed one."""
    dt = q.dtype
    saved: dict = {"longest": longest}
    if gate.mode:  # gdn_gate_bwd's shape; its ticket build counts on words the recompute's gdn_plan zeroes
        shape = gate_backward_shape(problem.batch * problem.tokens, problem.num_v_heads)
        saved["gate_shape"] = shape
        hb, _, mode = shape
        if gate.gate and mode == "ticket":
            saved["zero_words"] = -(-problem.num_v_heads // hb)  # one a head block
    # gdn_bwd_recompute's save chain (hs, W, Vnew) and gdn_bwd_dh's chain both need only gdn_prepare's outputs: with
    # SAVE_CHAIN_BESIDE_DH the save chain runs on a side stream beside the dh chain (fork / join by events, parallel
    # branches in a CUDA graph), else before it on the caller's stream
    main = torch.cuda.current_stream(q.device)
    side = side_stream(q.device, "save_chain") if settings.save_chain_beside_dh else None
    with torch.no_grad():
        do_p = packed(do.to(dt))  # both kernels read it: packed once
        dht_c = dht.float().contiguous() if dht is not None else None
        if before_dht is not None and dht_c is not dht:
            raise ValueError("internal: before_dht needs dht float32 and contiguous (it is written in place)")
        early: dict = {}

        def start_reverse_pre_pass(seg, reverse):
            # with CP the dh chain's pre-pass (reverse warm-ups, transposed transitions, reverse combine) needs only
            # gdn_prepare's outputs, dO and the tables: it starts on a stream of its own as soon as the tables are
            # launched, beside the recompute's own pre-pass and save chain, instead of after them
            early["stream"] = pre = side_stream(q.device, "dh_pre_pass")
            join(pre, main)
            with torch.cuda.stream(pre):
                early["ds_out"] = _dh_cp_pre_pass(problem, saved, seg, *reverse, do_p, dht_c, before_dht)
            for buf in (do_p, dht_c, seg.cu, seg.slot, seg.base, *reverse):
                if buf is not None:
                    buf.record_stream(pre)
            early["ds_out"].record_stream(main)

        fwd.forward(problem, q, k, v, g, beta, initial_state, False, cu_seqlens, use_qk_l2norm,
                    want_gate_free_inverse=True, saved=saved, save_stream=side, gate_free_inverse=A,
                    g_is_cumsum=g_is_cumsum, after_cp_tables=start_reverse_pre_pass,
                    state_io=StateIO(v_first=True) if v_first else PLAIN_IO, gate=gate)
        if "stream" in early:
            join(main, early["stream"])
        dv, x, dhs, dh0 = _reverse_recurrence(problem, saved, do_p, dht_c, initial_state is not None,
                                              early.get("ds_out"), v_first, None if "stream" in early else before_dht)
        if side is not None:
            join(main, side)  # gdn_bwd_chunk reads hs, W, Vnew
        raw = (dense(q), dense(k)) if use_qk_l2norm else None
        dq, dk, dbeta, dg, part = _chunk_kernel(problem, saved, do_p, x, dv, dhs, raw)
    return (dq, dk, dv, dg, dbeta, dh0) + ((part,) if part is not None else ())


def gate_sums(sums: torch.Tensor):
    """(dA_log, d dt_bias) [Hv] fp32 from the backward's [2, Hv] sums."""
    return sums[0], sums[1]


def _dh_pointers(saved: dict, do_p, dht_c, scratch) -> dict:
    """gdn_bwd_dh's pointers from the recompute's intermediates; scratch stands in for the outputs a build does not
    write (any valid address)."""
    return {"q": saved["q"].data_ptr(), "k": saved["k"].data_ptr(), "do": do_p.data_ptr(),
            "agb": saved["agb"].data_ptr(), "p": saved["p"].data_ptr(), "eg_t": saved["eg_t"].data_ptr(),
            "et_t": saved["et_t"].data_ptr(), "dht": (dht_c if dht_c is not None else scratch).data_ptr(),
            "cu_seqlens": saved["cu"].data_ptr(), "chunk_offsets": saved["offsets"].data_ptr(),
            "dhs": scratch.data_ptr(), "x": scratch.data_ptr(), "dv": scratch.data_ptr(), "dh0": scratch.data_ptr(),
            "rend": saved["offsets"].data_ptr(), "rfallback": saved["offsets"].data_ptr(),
            "seq_order": saved["order"].data_ptr()}


def _dh_cp_pre_pass(problem: Problem, saved: dict, seg, rend, rfallback, do_p, dht_c, before_dht=None) -> torch.Tensor:
    """The dh chain's CP pre-pass and reverse combine (flash_qla/cp.py) over the recompute's segments, on the
    current stream: [S, Hv, K, V] fp32, the gradient of the state leaving each segment. before_dht: backward's."""
    pointers = dict(_dh_pointers(saved, do_p, dht_c, saved["agb"]), cu_seqlens=seg.cu.data_ptr(),
                    chunk_offsets=seg.slot.data_ptr(), rend=rend.data_ptr(), rfallback=rfallback.data_ptr())
    sizes = dict(saved["sizes"], use_dht=0, store_dh0=1, ordered=0, state_mode=0)
    return fwd.cp_pre_pass_and_combine(DH_KERNEL, problem, saved["tag"], seg, rfallback, sizes, pointers, "dh0", dht_c,
                                       True, current_stream(do_p.device), (rend,), side_name="dh_pre_pass_trans",
                                       before_combine=before_dht)


def _reverse_recurrence(problem: Problem, saved: dict, do_p, dht_c, want_dh0: bool,
                        ds_out: Optional[torch.Tensor] = None, v_first: bool = False, before_dht=None):
    """gdn_bwd_dh over the recompute's intermediates; do_p is dO packed [T, Hv, V] in the inputs' dtype, dht_c the
    final-state gradient (fp32, contiguous) or None. When the recompute ran intra-card CP, so does this chain
    (reverse warm-ups, exact transposed transitions, a reverse combine; flash_qla/cp.py), over the same segments:
    ds_out is that pre-pass's result when the caller already launched it (_dh_cp_pre_pass), else it runs here.
    v_first: dht and dh0 are [N, Hv, V, K] (no CP: the recompute refused V-first h0 with it). before_dht: backward's
    (None where the caller's pre-pass already called it)."""
    dev = do_p.device
    T, Hv, K, V, N = (problem.batch * problem.tokens, problem.num_v_heads, problem.head_dim_k,
                      problem.head_dim_v, problem.num_seqs)
    dt = saved["q"].dtype
    dv = empty(problem.batch, problem.tokens, Hv, V, device=dev, dtype=dt, output="dv")
    x = empty(T, Hv, V, device=dev, dtype=dt)
    dhs = fwd.chunk_slot_states(saved["TC"] // CHUNK, problem, dev, dt)
    tag = saved["tag"]
    pointers = dict(_dh_pointers(saved, do_p, dht_c, dhs), x=x.data_ptr(), dv=dv.data_ptr())
    sizes = dict(saved["sizes"], use_dht=int(dht_c is not None), store_dh0=int(want_dh0), ordered=1,
                 state_mode=V_FIRST if v_first else 0)
    chains, seg = None, None
    if "cp" in saved:
        seg, rend, rfallback = saved["cp"]
        if ds_out is None:
            ds_out = _dh_cp_pre_pass(problem, saved, seg, rend, rfallback, do_p, dht_c, before_dht)
        before_dht = None
        # the segments run as sequences from the gradient of the state leaving each
        pointers.update(cu_seqlens=seg.cu.data_ptr(), chunk_offsets=seg.slot.data_ptr(), dht=ds_out.data_ptr())
        sizes.update(N=seg.count, use_dht=1, ordered=0, state_mode=0)  # equal segments: in index order
        chains = seg.count
    inner = (V, K) if v_first else (K, V)
    dh0 = (empty(chains or N, Hv, *inner, device=dev, dtype=torch.float32, output=None if chains else "dh0")
           if want_dh0 else None)
    if dh0 is not None:
        pointers.update(dh0=dh0.data_ptr())
    bv = fwd._block_v(problem, tag, dev, kernel=DH_KERNEL, mode="chain", chains_per_head=chains,
                      longest=saved.get("longest"))
    if before_dht is not None:
        before_dht()
    launch(DH_KERNEL, {"dtype": tag, "K": K, "V": V, "BV": bv, "mode": "chain"}, dev, sizes, pointers)
    if seg is not None and dh0 is not None:  # a sequence's dh0 is its first segment's; an empty one passes dht
        dh0 = fwd.SegmentStates(dh0, seg.base[:N], seg.last, dht_c, seg.count)
    return dv, x, dhs, dh0


def chain_blocks(problem: Problem, tag: str, device: torch.device, longest: Optional[int]) -> tuple:
    """The V blocks of the backward's two chains (the recompute's save build, gdn_bwd_dh) without intra-card CP, for a
    batch whose longest sequence has ``longest`` tokens (None: unknown lengths)."""
    return (fwd._block_v(problem, tag, device, kernel=fwd.RECOMPUTE_KERNEL, mode="save", longest=longest),
            fwd._block_v(problem, tag, device, kernel=DH_KERNEL, mode="chain", longest=longest))


def native_v_first(problem: Problem, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether backward(v_first=True) runs: the recompute plans no intra-card CP (whose combine and per-segment
    states work in [.., K, V]); else the caller transposes h0 / dht / dh0 around the call."""
    return fwd._recompute_segment_chunks(problem, DTYPE_TAG[dtype], device) is None


def chunk_stage_inputs(q, k, v, g, beta, initial_state, cu_seqlens, do, dht):
    """(problem, saved, (dO packed, X, dV, dS')): the recompute and the dh chain in order on the current stream,
    i.e. everything gdn_bwd_chunk reads (for the tests and experiments that check or time that stage alone)."""
    problem = validate_inputs(q, k, v, g, beta, None, initial_state, cu_seqlens)
    saved: dict = {}
    fwd.forward(problem, q, k, v, g, beta, initial_state, False, cu_seqlens, False, want_gate_free_inverse=True,
                saved=saved)
    do_p = packed(do)
    dv, x, dhs, _ = _reverse_recurrence(problem, saved, do_p, dht.float().contiguous(), True)
    return problem, saved, (do_p, x, dv, dhs)


def _chunk_kernel(problem: Problem, saved: dict, do_p, x, dv, dhs, raw=None):
    """gdn_bwd_chunk: one item per (chunk slot, q/k head); dq / dk come out summed over the GVA group. raw: the
    un-normalised (q, k) under use_qk_l2norm_in_kernel (saved q / k are then the normalised rows), and dq / dk
    come out with respect to them."""
    dev = do_p.device
    B, Tb, Hq, Hv, K = problem.batch, problem.tokens, problem.num_qk_heads, problem.num_v_heads, problem.head_dim_k
    dt = saved["q"].dtype
    # separate allocations: outputs that share a storage cannot be returned by a torch custom op (torch_ops)
    dq, dk = (empty(B, Tb, Hq, K, device=dev, dtype=dt, output=name) for name in ("dq", "dk"))
    dbeta, dg = (empty(B, Tb, Hv, device=dev, dtype=torch.float32, output=name) for name in ("dbeta", "dg"))
    gate = saved.get("gate", NO_GATE)
    # beta logits: the activated beta the recompute's gdn_prepare stored (the plain chunk kernel applies none)
    beta = saved["beta_act"] if gate.mode & BETA_SIGMOID else saved["beta"]
    q_raw, k_raw = raw if raw is not None else (saved["q"], saved["k"])
    # persistent: one CTA per SM (its shared memory allows no second) walks the (chunk slot, q/k head) items
    ctas = min(settings.chunk_ctas_max or num_sms(dev), saved["TC"] // CHUNK * Hq)
    launch(CHUNK_KERNEL, {"dtype": saved["tag"], "K": K, "V": problem.head_dim_v}, dev,
                dict(saved["sizes"], l2norm=int(raw is not None), ctas=ctas),
                {"q": saved["q"].data_ptr(), "k": saved["k"].data_ptr(), "A": saved["A"].data_ptr(),
                 "beta": beta.data_ptr(), "gam_t": saved["gam_t"].data_ptr(),
                 "do": do_p.data_ptr(), "w": saved["w"].data_ptr(),
                 "vnew": saved["vnew"].data_ptr(), "x": x.data_ptr(), "dv": dv.data_ptr(),
                 "hs": saved["hs"].data_ptr(), "dhs": dhs.data_ptr(), "slot_rows": saved["slot_rows"].data_ptr(),
                 "dq": dq.data_ptr(), "dk": dk.data_ptr(),
                 "dbeta": dbeta.data_ptr(), "dg": dg.data_ptr(), "q_raw": q_raw.data_ptr(),
                 "k_raw": k_raw.data_ptr(),
                 # l2norm: the rows' factors (|x|^2 + eps)^-1/2 from gdn_prepare (without it, ops' stand-in: unread)
                 "rn": saved["rn"].data_ptr()})
    part = _gate_backward(problem, saved, gate, beta, dg, dbeta) if gate.mode else None
    return dq, dk, dbeta, dg, part


def _gate_backward(problem: Problem, saved: dict, gate: KernelGate, beta, dg, dbeta):
    """gdn_gate_bwd: dg / dbeta turned in place into the raw g's and beta logits' gradients; returns dA_log's and
    dt_bias's gradients [2, Hv] with the raw gate, else None."""
    dev = dg.device
    NT, Hv = problem.batch * problem.tokens, problem.num_v_heads
    hb, steps, mode = saved["gate_shape"]
    # [2, Hv, 1 + step]: slot 0 the ticket build's total, slot 1 + s step s's sums (a contiguous torch sum's order)
    part = empty(2, Hv, 1 + steps, device=dev, dtype=torch.float32, output="gate_part") if gate.gate else None
    tickets = saved.get("zeros") if mode == "ticket" else None
    if gate.gate and mode == "ticket" and tickets is None:
        raise RuntimeError("internal: gdn_gate_bwd's ticket build needs the recompute's zeroed tickets")
    launch(GATE_KERNEL, {"mode": mode, "hb": hb}, dev,
           {"NT": NT, "Hv": Hv, "NP": 1 + steps, "NB": tickets.numel() if tickets is not None else 0,
            "gate_mode": gate.mode},
           {"g": saved["g"].data_ptr(), **gate.pointers(saved["g"]), "beta": beta.data_ptr(), "dg": dg.data_ptr(),
            "dbeta": dbeta.data_ptr(), "part": (part if part is not None else dg).data_ptr(),
            "ticket": (tickets if tickets is not None else dg).data_ptr()})
    if part is None:
        return None
    return part[..., 0] if mode == "ticket" else part[..., 1:].sum(-1)


def gate_backward_shape(tokens: int, num_v_heads: int) -> tuple:
    """gdn_gate_bwd's (lanes a token hb, steps, build): hb the smallest of 8 / 16 / 32 that holds the heads (a warp
    then covers 32 / hb tokens), the ticket build up to GATE_TICKET_STEPS steps."""
    hb = 8 if num_v_heads <= 8 else 16 if num_v_heads <= 16 else 32
    steps = -(-tokens // (GATE_WARPS * (32 // hb) * GATE_E))
    return hb, steps, "ticket" if steps <= GATE_TICKET_STEPS else "tiles"


def _chunk_parallel(problem: Problem, saved: dict, do_p, x, dv, dhs):
    """The same stage in batched torch GEMMs (flash_qla.chunk_grads): the CPU tests' specification."""
    T, Hq, Hv = problem.batch * problem.tokens, problem.num_qk_heads, problem.num_v_heads
    ratio = Hv // Hq
    slots = saved["TC"] // CHUNK
    m = slot_map(saved["cu"], saved["offsets"], T, slots)
    qs = to_slots(saved["q"], m).repeat_interleave(ratio, dim=1)
    ks = to_slots(saved["k"], m).repeat_interleave(ratio, dim=1)
    valid = to_slots(torch.ones(T, 1, device=do_p.device), m).expand(slots, Hv, CHUNK)
    gamma = saved["gam_t"].view(Hv, slots, CHUNK).transpose(0, 1)
    # the slots past the last chunk are never written (forward.chunk_slot_states): zeroed in copies (x 0 in the batched
    # products; a host read of the chunk count is fine in this specification path)
    used = int(saved["offsets"][-1])
    hs, dhs = (t.to(compute_dtype(t), copy=True) for t in (saved["hs"], dhs))
    hs[used:] = 0
    dhs[used:] = 0
    dq, dk, dbeta, dgamma = chunk_gradients(
        qs, ks, to_slots(do_p, m), to_slots(saved["w"], m), to_slots(saved["vnew"], m),
        to_slots(x, m), to_slots(dv.reshape(-1, *dv.shape[-2:]), m), hs, dhs,
        to_slots(saved["A"].reshape(-1, *saved["A"].shape[-2:]), m), to_slots(saved["beta"], m), gamma, valid,
        problem.scale)
    shape = (problem.batch, problem.tokens)
    dq = from_slots(dq, m).unflatten(1, (Hq, ratio)).sum(2).unflatten(0, shape)
    dk = from_slots(dk, m).unflatten(1, (Hq, ratio)).sum(2).unflatten(0, shape)
    return dq, dk, from_slots(dbeta, m).unflatten(0, shape), from_slots(reverse_chunk_cumsum(dgamma), m).unflatten(0, shape)
