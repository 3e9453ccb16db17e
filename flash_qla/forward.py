"""The forward of the kernel path: the launches that turn q, k, v, g, beta (and h0) into o (and the final state).

Every call is one packed varlen problem (a dense batch B x T is B sequences of T tokens). The plain forward is
either gdn_fwd_fused alone or three launches:
  gdn_plan       chunk offsets of the packed batch (one scan),
  gdn_prepare    per (chunk, v-heads): gamma, the gate-free inverse and Agb = Gamma * A * beta,
                 P = scale * Gamma * tril(Q K^T), exp factors,
  gdn_fwd_chain  per (sequence, v-head, V-block): the state recurrence and the output.
With intra-card CP (flash_qla/cp.py) the chain runs over segments after a pre-pass and a combine; a "cp_fused" plan
runs that CP on the fused kernel instead (flash_qla/fused_cp.py: no gdn_prepare). The backward's recompute
(``saved``) runs gdn_bwd_recompute instead of the output chain. Nothing is read back to the host, so
a call can be captured in a CUDA graph; flash_qla/plans.py records a call's launches once per signature.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import cp, fused_cp, planner
from .gates import BETA_SIGMOID, NO_GATE, KernelGate
from .chunk_grads import token_positions
from .launch import (CHAIN_KERNEL, CHUNK, DTYPE_TAG, FUSED_KERNEL, L2NORM_KERNEL, RECOMPUTE_KERNEL, address,
                     built_blocks, current_stream, dense, empty, join, launch, num_sms, packed, side_stream)
from .planner import (FUSED_PERSISTENT_CTAS, OUT_CHAIN_COST, STAGED_CHAIN_COST, ForwardPlan, chain_skew,
                      plan_block_v, plan_forward, plan_heads_per_cta, plan_irregular_block_v)
from .states import PLAIN_IO, StateIO
from .tuning import settings
from .validation import Problem

# the chain kernels whose V block a batch of several sequences plans by unequal chains (planner.py
# plan_irregular_block_v), the others by equal waves: the recompute chain runs beside the dh chain in the backward,
# where the narrower block fills the SMs (docs/performance.md)
IRREGULAR_CHAIN_KERNELS = {"gdn_bwd_dh", RECOMPUTE_KERNEL}


def _block_v(problem: Problem, tag: str, device: torch.device, kernel: str = CHAIN_KERNEL, mode: Optional[str] = "out",
             chains_per_head: Optional[int] = None, longest: Optional[int] = None) -> int:
    """The V block of a chain kernel (gdn_fwd_chain, gdn_bwd_recompute's save build, gdn_bwd_dh): planned from the built
    blocks, that kernel's chain costs and the SM count, for chains_per_head (sequence or CP segment) chains per
    v-head. longest: the longest sequence's tokens, when the host knows the lengths (the backward's chains of a batch
    then plan for its own skew)."""
    built = built_blocks(kernel, mode, tag, problem.head_dim_k, problem.head_dim_v)
    if settings.force_block_v is not None and settings.force_block_v in built:
        return settings.force_block_v
    if chains_per_head is None and problem.num_seqs > 1 and kernel in IRREGULAR_CHAIN_KERNELS:
        tokens = problem.batch * problem.tokens
        return plan_irregular_block_v(tokens, problem.num_seqs, problem.num_v_heads, problem.head_dim_v, tuple(built),
                                      num_sms(device), tuple(sorted(_chain_costs(kernel).items())),
                                      chain_skew(tokens, problem.num_seqs, longest))
    seqs = problem.num_seqs if chains_per_head is None else chains_per_head
    return plan_block_v(seqs, problem.num_v_heads, problem.head_dim_v, built, num_sms(device), _chain_costs(kernel))


def _chain_costs(kernel: str) -> dict:
    """The per-chunk chain costs of a chain kernel by V block (flash_qla/planner.py): gdn_fwd_chain keeps the state
    in registers, gdn_bwd_recompute's save build and gdn_bwd_dh stage it through shared memory."""
    return OUT_CHAIN_COST if kernel == CHAIN_KERNEL else STAGED_CHAIN_COST


def _recompute_segment_chunks(problem: Problem, tag: str, device: torch.device) -> Optional[int]:
    """CP segment length (chunks) for the backward's recompute, or None (flash_qla/cp.py): its segments run
    gdn_bwd_recompute's save build (staged chains, its own V blocks)."""
    built = tuple(built_blocks(RECOMPUTE_KERNEL, "save", tag, problem.head_dim_k, problem.head_dim_v))
    return cp.plan_segment_chunks(problem.batch * problem.tokens, problem.num_seqs, problem.num_v_heads,
                                  problem.head_dim_k, problem.head_dim_v, num_sms(device), built,
                                  chain_costs=STAGED_CHAIN_COST, **cp.BACKWARD_PLAN)


_DENSE_CU: dict = {}  # (batch, tokens, device index) -> the made-up cu_seqlens of a dense batch


def device_cu_seqlens(problem: Problem, cu_seqlens: Optional[torch.Tensor], device) -> torch.Tensor:
    """cu_seqlens as int32 on the device; a dense batch's is made up once per (B, T, device) and kept (made fresh
    under CUDA-graph capture, whose pool must not leak into later calls)."""
    if cu_seqlens is not None:
        if cu_seqlens.dtype == torch.int32 and cu_seqlens.device == device:
            return cu_seqlens  # (.to costs microseconds even when it has nothing to do)
        return cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
    key = (problem.batch, problem.tokens, device.index)
    cu = _DENSE_CU.get(key)
    if cu is None:
        T = problem.tokens
        cu = torch.arange(0, (problem.batch + 1) * T, max(T, 1), device=device, dtype=torch.int32)
        if T == 0:
            cu.zero_()
        if torch.cuda.is_current_stream_capturing():
            return cu
        if len(_DENSE_CU) > 64:
            _DENSE_CU.clear()
        _DENSE_CU[key] = cu
    return cu


def _offsets(problem: Problem, cu_seqlens: Optional[torch.Tensor], device, stream=None, want_order: bool = False,
             zero_words: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(cu_seqlens int32, chunk_offsets int32, seq_order int32, zero_words int32 zeros or None) on the device: one
    small planning kernel, no host synchronisation. seq_order (with want_order; unwritten otherwise) lists the
    sequences longest first: the backward's chain kernels' dispatch order. The zeros are gdn_gate_bwd's tickets."""
    cu = cu_seqlens  # int32 on the device (device_cu_seqlens)
    N = problem.num_seqs
    plan = empty(2 * N + 1 + zero_words, device=cu.device, dtype=torch.int32)  # one allocation for the tables
    offsets, order = plan[:N + 1], plan[N + 1:2 * N + 1]
    zeros = plan[2 * N + 1:] if zero_words else None
    launch("gdn_plan", {"tile": 1024}, device, {"N": N, "Z": zero_words, "want_order": int(want_order)},
           {"cu_seqlens": cu.data_ptr(), "chunk_offsets": offsets.data_ptr(), "seq_order": order.data_ptr(),
            "zero": (zeros if zeros is not None else offsets).data_ptr()}, stream)
    return cu, offsets, order, zeros


def chunk_slots(problem: Problem) -> int:
    """Chunk slots of the packed batch, ceil(T / 64) + N: an upper bound of its chunk count (a sequence's last chunk
    may be partial), which sizes the per-chunk tables and gdn_prepare's / gdn_cp_scan's grids."""
    return -(-(problem.batch * problem.tokens) // CHUNK) + problem.num_seqs


def chunk_slot_states(slots: int, problem: Problem, device, dtype) -> torch.Tensor:
    """[slots, Hv, K, V] per-chunk states: every chunk's slot is written by a kernel; the slots past the last chunk
    (slots = ceil(T / 64) + N bounds the chunk count) are left as they are: no kernel reads them (gdn_bwd_chunk's
    CTAs past the last chunk return at once), and the torch specification of the chunk stage zeroes its own copy
    (backward._chunk_parallel). A memset there was a node on the backward's critical path."""
    return empty(slots, problem.num_v_heads, problem.head_dim_k, problem.head_dim_v, device=device, dtype=dtype)


def forward(problem: Problem, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
            want_gate_free_inverse: bool = False, saved: Optional[dict] = None,
            save_stream: Optional[torch.cuda.Stream] = None, gate_free_inverse: Optional[torch.Tensor] = None,
            g_is_cumsum: bool = False, after_cp_tables=None, state_io: StateIO = PLAIN_IO,
            plan: Optional[ForwardPlan] = None, gate: KernelGate = NO_GATE,
            window: Optional[Tuple[int, torch.Tensor]] = None, link=None):
    """Returns (o [B,T,Hv,V], final_state [N,Hv,K,V] or an empty tensor, A [B,T,Hv,64] or None, (cu, offsets)).

    ``state_io`` (flash_qla/states.py): the caller's state layout and pool, which the kernels read and write in
    place: initial_state is then [N, Hv, V, K] (V-first) and / or a pool indexed by state_io.index, and the final
    states go to state_io.write (returned as the final state) or to a new [N, ...] tensor in the caller's layout.
    Only where native_state_io() says so (no intra-card CP); the recompute (``saved``) reads a V-first h0 likewise.

    With ``saved`` (a dict, the backward's recompute pass) the save build of gdn_bwd_recompute runs and
    the dict receives every intermediate the backward reads (saved["longest"], when the caller sets it: the host-known
    longest sequence, which plans the save build's V block): the packed q, k, beta, then agb, p, A, eg_t,
    et_t, gam_t, hs, w, vnew and the launch context (cu, offsets, sizes, TC, tag). With ``save_stream`` the save
    build runs there, forked after gdn_prepare (and CP's pre-pass): the caller joins it before reading hs, W, Vnew.
    With ``gate_free_inverse`` (the forward's A, [B, T, Hv, 64] in q's dtype) gdn_prepare reads it instead of solving;
    with ``g_is_cumsum`` g is already the chunk-local cumsum (FlashQLA's low-level backward takes it so).
    ``plan``: the forward's plan when the caller made it (with the host-known lengths, forward_plan); else planned
    here. ``after_cp_tables(seg, reverse)``: called when the recompute plans CP, right after the segment tables are
    launched and before its pre-pass (the backward starts its own reverse pre-pass there, on a stream of its own).
    ``gate`` (flash_qla/gates.py): g / beta are FLA's raw gate / beta logits, activated by the kernels where they load
    them (gdn_prepare, gdn_fwd_fused); ``saved`` then also keeps the raw g and the gate for gdn_bwd_chunk.
    ``window`` = (walk, flags): multi-GPU CP's head window (flash_qla/distributed.py), the chain's "window" build on a
    split plan: from the identity with v unread (V = K), each (sequence, v-head) stopping where the gate of its
    first ``walk`` chunks bounds the rest (gdn_fwd_chain's docstring); flags [N, Hv] int32 receives 1 where a head
    ran its whole sequence.
    ``link`` (Link): the first part of multi-GPU CP's linked forward (flash_qla/distributed.py) on an intra-card CP
    plan: everything up to the combine, then a LinkedEntry in place of the final state (o is written by
    linked_output, after the caller has added the entering state's part to h_in)."""
    dev = q.device
    dt = q.dtype
    T = problem.batch * problem.tokens
    Hv, K, V, N = problem.num_v_heads, problem.head_dim_k, problem.head_dim_v, problem.num_seqs
    # the kernels take pointers: a contiguous [B, T, ...] tensor is already the packed [B*T, ...] layout, so the
    # packed views are made only where tensors are kept (the backward's saved dict); views cost ~2 us each
    qp, kp, vp, gp, bp = (dense(x) for x in (q, k, v, g, beta.float()))
    cu_seqlens = device_cu_seqlens(problem, cu_seqlens, dev)
    stream = current_stream(dev)
    tag = DTYPE_TAG[dt]
    h0 = initial_state.contiguous() if initial_state is not None else None
    if saved is None and plan is None:
        plan = forward_plan(problem, tag, dev, use_qk_l2norm, want_gate_free_inverse)
    L = plan.segment_chunks if plan is not None else _recompute_segment_chunks(problem, tag, dev)
    if gate.mode and g_is_cumsum:
        raise ValueError("internal: g is either the chunk-local cumsum or FLA's raw gate, not both")
    if plan is not None and plan.prenorm and use_qk_l2norm and saved is None:
        # the plain kernels on q / k normalised once (the backward's recompute keeps gdn_prepare's l2norm: it stores
        # the rows' factors for gdn_bwd_chunk)
        qp, kp = l2norm_rows(problem, qp, kp, tag, stream)
        use_qk_l2norm = False
    if L is not None and state_io.mode:
        raise ValueError("internal: the kernels read / write the caller's state layout and pool only without "
                         "intra-card CP (forward.native_state_io); the caller converts the states around a CP call")
    if (plan is not None and plan.path == "cp_fused" and saved is None and link is None and window is None
            and not want_gate_free_inverse and not g_is_cumsum and not state_io.mode):
        o, ht = fused_cp.forward(problem, plan, tag, qp, kp, vp, gp, bp, h0, cu_seqlens, output_final_state,
                                 use_qk_l2norm, gate, stream)
        return o, ht, None, (cu_seqlens, None)
    fused_bv = plan.block_v if plan is not None and plan.path == "fused" else None
    if fused_bv is not None:
        o, ht = _fused_forward(problem, qp, kp, vp, gp, bp, h0, cu_seqlens, output_final_state, use_qk_l2norm, tag,
                               fused_bv, stream, state_io, gate, plan.fused_ctas, plan.longest_first)
        return o, ht, None, (cu_seqlens, None)
    # the backward asks for zeroed words (saved["zero_words"]: gdn_gate_bwd's tickets) in the plan's allocation
    cu, offsets, order, zeros = _offsets(problem, cu_seqlens, dev, stream, want_order=saved is not None,
                                         zero_words=saved.get("zero_words", 0) if saved is not None else 0)
    agb, pqk = (empty(T, Hv, CHUNK, device=dev, dtype=dt) for _ in range(2))  # (unbinding one costs more)
    # gate_free_inverse: the caller's A (checked by the API), read by gdn_prepare instead of solved again
    read_a = gate_free_inverse is not None
    shape = (problem.batch, problem.tokens)
    returned = saved is None  # o, the final state and A are the caller's; the recompute's are workspace
    A = (packed(gate_free_inverse) if read_a else
         empty(*shape, Hv, CHUNK, device=dev, dtype=dt, output="A" if returned else None) if want_gate_free_inverse
         else None)
    # head-major and chunk-aligned: chunk slot s of the packed batch owns [s * 64, s * 64 + 64), so every
    # tile starts 256-byte aligned (slots: an upper bound of the chunk count, as gdn_prepare's grid)
    TC = chunk_slots(problem) * CHUNK
    # one allocation for the four fp32 tiles and the int32 slot table (eager calls are host-bound on small rows: each
    # allocation costs ~3 us); slot_rows[s] = (first row, valid rows) of chunk slot s, for gdn_bwd_chunk
    slots = TC // CHUNK
    slot_rows_at = 3 * Hv * TC + Hv * slots  # elements before the slot table
    tiles = empty(slot_rows_at + 2 * slots, device=dev, dtype=torch.float32)
    tile_ptr = [tiles.data_ptr() + i * Hv * TC * 4 for i in range(4)]  # eg, et, gamma, bkk_max

    def tile(i: int) -> torch.Tensor:  # tile i as a tensor (views cost ~2 us: made only where tensors are kept)
        width = TC if i < 3 else TC // CHUNK
        return tiles[i * Hv * TC:i * Hv * TC + Hv * width].view(Hv, width)
    o = empty(*shape, Hv, V, device=dev, dtype=dt, output="o" if returned else None)
    if saved is None and L is None:
        ht = final_states(problem, state_io, output_final_state, dev, o)
    else:
        ht = (empty(N, Hv, K, V, device=dev, dtype=torch.float32, output="ht" if returned else None)
              if output_final_state and not (returned and L is not None) else o.new_empty(0))
    sizes = {"T": T, "TC": TC, "Hq": problem.num_qk_heads, "Hv": Hv, "N": N, "scale": problem.scale}
    hpc = plan.heads_per_cta if plan is not None and plan.path == "split" else _heads_per_cta(problem, dev)
    # use_qk_l2norm_in_kernel: gdn_prepare normalises its q / k tiles and stores the rows (qn, kn) that the
    # recurrence kernels then read in place of q / k
    qn, kn = ((empty(T, problem.num_qk_heads, K, device=dev, dtype=dt) for _ in range(2)) if use_qk_l2norm
              else (qp, kp))
    # and each row's factor (|x|^2 + eps)^-1/2, head-major by chunk slot (as the gamma tiles), which gdn_bwd_chunk's
    # l2norm epilogue loads by TMA with its q / k tiles (q: [0], k: [1])
    # (without l2norm the kernels never read it: `tiles`, larger than its [2, Hq, TC], stands in as its address)
    rn = empty(2, problem.num_qk_heads, TC, device=dev, dtype=torch.float32) if use_qk_l2norm else tiles
    # the backward's recompute with beta logits: gdn_prepare also stores the activated beta, which gdn_bwd_chunk reads
    beta_act = (empty(T, Hv, device=dev, dtype=torch.float32) if saved is not None and gate.mode & BETA_SIGMOID
                else None)
    launch("gdn_prepare", {"dtype": tag, "K": K, "A": "read" if read_a else "solve"}, dev,
            dict(sizes, write_a=int(A is not None and not read_a), hpc=hpc, l2norm=int(use_qk_l2norm),
                 g_is_cumsum=int(g_is_cumsum), gate_mode=gate.mode, store_beta=int(beta_act is not None)),
            {"q": qp.data_ptr(), "k": kp.data_ptr(), "qn": qn.data_ptr(), "kn": kn.data_ptr(),
             "rn": rn.data_ptr(), "g": gp.data_ptr(), "beta": bp.data_ptr(),
             "cu_seqlens": cu.data_ptr(), "chunk_offsets": offsets.data_ptr(),
             "A": (A if A is not None else agb).data_ptr(), "agb": agb.data_ptr(), "p": pqk.data_ptr(),
             "eg_t": tile_ptr[0], "et_t": tile_ptr[1], "gam_t": tile_ptr[2], "bkk_max": tile_ptr[3],
             "slot_rows": tiles.data_ptr() + slot_rows_at * 4, **gate.pointers(gp),
             "beta_out": (beta_act if beta_act is not None else tiles).data_ptr()}, stream)
    qp, kp = qn, kn
    pointers = {"q": qp.data_ptr(), "k": kp.data_ptr(), "v": vp.data_ptr(), "agb": agb.data_ptr(),
                "p": pqk.data_ptr(), "eg_t": tile_ptr[0], "et_t": tile_ptr[1],
                "h0": (h0 if h0 is not None else o).data_ptr(), "cu_seqlens": cu.data_ptr(),
                "chunk_offsets": offsets.data_ptr(), "o": o.data_ptr(), "ht": ht.data_ptr(),
                "seq_order": order.data_ptr(), "state_idx": state_io.index_ptr(cu)}

    def cp_inputs() -> dict:  # what the CP path reads, as tensors (views made only when CP runs)
        return dict(device=dev, gam_t=tile(2), bkk_max=tile(3), cu=cu, offsets=offsets, h0=h0, o=o, ht=ht)

    if link is not None:
        if saved is not None or L is None:
            raise ValueError("internal: a linked forward runs on a forward's intra-card CP plan")
        named = dict(q=qp, k=kp, v=vp, agb=agb, p=pqk, eg_t=tile(0), et_t=tile(1), seq_order=order, state_idx=cu)
        return o, _linked_entry(problem, L, tag, sizes, pointers, cp_inputs(), output_final_state, stream, link,
                                named), None, (cu, offsets)
    if saved is None and L is not None:
        ht = _cp_forward(problem, L, tag, sizes, pointers, cp_inputs(), output_final_state, stream)
    elif saved is None:
        variant = {"dtype": tag, "K": K, "V": V, "BV": plan.block_v, "mode": "out" if window is None else "window"}
        chain_sizes = dict(sizes, use_h0=int(h0 is not None), store_ht=int(ht.numel() > 0), state_mode=state_io.mode,
                           h0_rows=h0.shape[0] if h0 is not None else N, ht_rows=ht.shape[0] if ht.numel() else N)
        if window is not None:
            chain_sizes.update(stop=window[0], decay_bound=cp.WARMUP_LOG_DECAY)
            pointers = dict(pointers, gam_t=tile_ptr[2], bkk_max=tile_ptr[3], fallback=window[1].data_ptr())
        launch(CHAIN_KERNEL, variant, dev, chain_sizes, pointers, stream)
    else:  # the backward's recompute: the save build stores every chunk's entering state, W and Vnew
        hs = chunk_slot_states(TC // CHUNK, problem, dev, dt)
        w, vnew = (empty(T, Hv, V, device=dev, dtype=dt) for _ in range(2))
        pointers.update(hs=hs.data_ptr(), w=w.data_ptr(), vnew=vnew.data_ptr())
        eg_t, et_t, gam_t = (tile(i) for i in range(3))
        # packed views of what the backward keeps as tensors (q / k: [T, Hq, K], beta: [T, Hv])
        saved.update(q=qp.reshape(T, -1, K), k=kp.reshape(T, -1, K), beta=bp.reshape(T, Hv), agb=agb, p=pqk,
                     eg_t=eg_t, et_t=et_t, gam_t=gam_t, hs=hs, w=w, vnew=vnew, TC=TC, A=A, cu=cu, offsets=offsets,
                     sizes=sizes, tag=tag, order=order, zeros=zeros,
                     slot_rows=tiles[slot_rows_at:].view(torch.int32).view(slots, 2), rn=rn, g=gp, gate=gate,
                     beta_act=beta_act)
        if state_io.index is not None:
            raise ValueError("internal: the backward's recompute reads a dense initial state (no pool)")
        chain_sizes = dict(sizes, use_h0=int(h0 is not None), store_ht=0, ordered=1, state_mode=state_io.mode)
        chains = None
        if L is not None:  # intra-card CP: the segments' entering states, then the segments as sequences
            seg, h_in, reverse = _cp_entry_states(problem, L, tag, sizes, pointers, cp_inputs(), stream, bidi=True,
                                                  after_tables=after_cp_tables)
            saved["cp"] = (seg, *reverse)  # the backward's dh chain runs the same segments (gdn_bwd_dh)
            pointers.update(cu_seqlens=seg.cu.data_ptr(), chunk_offsets=seg.slot.data_ptr(), h0=h_in.data_ptr())
            chain_sizes = dict(sizes, N=seg.count, use_h0=1, store_ht=0, ordered=0, state_mode=0)
            chains = seg.count
        bv = _block_v(problem, tag, dev, kernel=RECOMPUTE_KERNEL, mode="save", chains_per_head=chains,
                      longest=saved.get("longest"))
        if save_stream is not None:
            join(save_stream, torch.cuda.current_stream(dev))
        launch(RECOMPUTE_KERNEL, {"dtype": tag, "K": K, "V": V, "BV": bv, "mode": "save"}, dev, chain_sizes, pointers,
                save_stream.cuda_stream if save_stream is not None else stream)
        if save_stream is not None:  # v / h0 may be copies made here and h_in is CP's: only the launch holds them
            for buf in (vp, h0, h_in if L is not None else None):
                if buf is not None:
                    buf.record_stream(save_stream)
    A = A.view(*shape, Hv, CHUNK) if A is not None else None
    return o, ht, A, (cu, offsets)


def forward_plan(problem: Problem, tag: str, device: torch.device, l2norm: bool,
                  want_gate_free_inverse: bool, longest: Optional[int] = None, allow_cp: bool = True,
                  unordered: bool = False, allow_prenorm: bool = True) -> ForwardPlan:
    """The plain forward's path (gdn_fwd_fused, gdn_prepare + gdn_fwd_chain, or intra-card CP on either), V block,
    gdn_prepare heads per CTA and CP segment length (flash_qla/planner.py plan_forward over the built variants),
    narrowed by the tuning pins: use_fused, force_block_v (where built), force_heads_per_cta, force_segment_chunks (0:
    no CP; a forced length takes CP on the fused kernel where built, unless cp_fused is False), cp_fused. A
    forward that returns A (the gate-free inverse) needs gdn_prepare, so never takes the fused kernel. longest: the
    longest sequence's tokens when the caller gave the lengths on the host (else they are planned as equal);
    unordered: those lengths are not longest first, so a fused plan of up to planner.FUSED_ORDER_MAX sequences has
    the kernel walk them longest first (the makespan the planner prices). allow_cp False: no intra-card CP
    (FlashQLA's auto_cp=False). With l2norm the plain plan after a gdn_l2norm pass (prenorm) is priced beside the
    l2norm builds' and the faster taken (the tuning pin prenorm narrows it; allow_prenorm False leaves it out)."""
    if l2norm and allow_prenorm and settings.prenorm is not False:
        plain = _forward_plan(problem, tag, device, False, want_gate_free_inverse, longest, allow_cp, unordered)
        sizes = (problem.batch * problem.tokens, problem.num_qk_heads, problem.head_dim_k)
        if settings.prenorm:  # pinned: the pass, whatever the l2norm builds would cost
            return planner.after_prenorm(plain, *sizes)
        in_kernel = _forward_plan(problem, tag, device, True, want_gate_free_inverse, longest, allow_cp, unordered)
        return planner.cheaper_l2norm(in_kernel, plain, *sizes)
    return _forward_plan(problem, tag, device, l2norm, want_gate_free_inverse, longest, allow_cp, unordered)


def _forward_plan(problem: Problem, tag: str, device: torch.device, l2norm: bool, want_gate_free_inverse: bool,
                  longest: Optional[int], allow_cp: bool, unordered: bool) -> ForwardPlan:
    K, V = problem.head_dim_k, problem.head_dim_v
    forced_l = settings.force_segment_chunks
    fused = (() if want_gate_free_inverse or settings.use_fused is False else
             tuple(built_blocks(FUSED_KERNEL, "out", tag, K, V, int(l2norm))))
    cp_paths = {None: ("cp", "cp_fused"), True: ("cp_fused",), False: ("cp",)}[settings.cp_fused]
    if forced_l:
        if "cp_fused" in cp_paths and 64 in fused:
            _, bv = planner.cp_fused_us(problem.batch * problem.tokens, problem.num_seqs, problem.num_v_heads,
                                        problem.num_qk_heads, K, V, num_sms(device), fused, forced_l, bool(l2norm),
                                        longest)
            return ForwardPlan("cp_fused", settings.force_block_v if settings.force_block_v in fused else bv, None,
                               forced_l, 0.0)
        return ForwardPlan("cp", None, None, forced_l, 0.0)
    chain = tuple(built_blocks(CHAIN_KERNEL, "out", tag, K, V))
    bv = settings.force_block_v if settings.force_block_v in fused + chain else None
    plan = plan_forward(problem.batch * problem.tokens, problem.num_seqs, problem.num_v_heads, problem.num_qk_heads,
                        V, num_sms(device), fused, chain, cp.SEGMENT_CHUNKS, bool(l2norm),
                        path="fused" if settings.use_fused and fused else None, block_v=bv,
                        heads_per_cta=settings.force_heads_per_cta, allow_cp=allow_cp and forced_l is None,
                        longest=longest, head_dim_k=K, cp_paths=cp_paths)
    if unordered and plan.path == "fused" and problem.num_seqs <= planner.FUSED_ORDER_MAX:
        return plan._replace(longest_first=True)
    return plan


def l2norm_rows(problem: Problem, q, k, tag: str, stream) -> Tuple[torch.Tensor, torch.Tensor]:
    """q and k ([B*T, Hq, K], packed) with every row x / sqrt(sum x^2 + eps), by one gdn_l2norm launch."""
    T = problem.batch * problem.tokens
    qn, kn = (empty(T, problem.num_qk_heads, problem.head_dim_k, device=q.device, dtype=q.dtype) for _ in range(2))
    launch(L2NORM_KERNEL, {"dtype": tag, "K": problem.head_dim_k}, q.device, {"T": T, "Hq": problem.num_qk_heads},
           {"q": q.data_ptr(), "k": k.data_ptr(), "qn": qn.data_ptr(), "kn": kn.data_ptr()}, stream)
    return qn, kn


def _heads_per_cta(problem: Problem, device: torch.device) -> int:
    """gdn_prepare's v-heads per CTA (flash_qla/planner.py), over its chunk slots ceil(T / 64) + N."""
    slots = chunk_slots(problem)
    return settings.force_heads_per_cta or plan_heads_per_cta(slots, problem.num_v_heads, problem.num_qk_heads,
                                                     num_sms(device))


def _fused_forward(problem: Problem, q, k, v, g, beta, h0, cu, output_final_state: bool, l2norm: bool, tag: str,
                   bv: int, stream, state_io: StateIO = PLAIN_IO, gate: KernelGate = NO_GATE,
                   ctas: Optional[int] = None, longest_first: bool = False):
    """The forward in one launch (gdn_fwd_fused at V block bv, at most ctas persistent CTAs: the plan's, else the
    tuning pin's or FUSED_PERSISTENT_CTAS; longest_first: its order build, which walks the sequences longest first):
    (o [T, Hv, V], final state or an empty tensor)."""
    dev = q.device
    Hv, V, N = problem.num_v_heads, problem.head_dim_v, problem.num_seqs
    o = empty(problem.batch, problem.tokens, Hv, V, device=dev, dtype=q.dtype, output="o")
    ht = final_states(problem, state_io, output_final_state, dev, o)
    sizes, pointers = fused_args(problem, q, k, v, g, beta, gate, cu, o)
    launch(FUSED_KERNEL, fused_variant(problem, tag, bv, l2norm, "out", longest_first), dev,
            dict(sizes, use_h0=int(h0 is not None), store_ht=int(ht.numel() > 0), state_mode=state_io.mode,
                 max_ctas=settings.fused_ctas_max or ctas or FUSED_PERSISTENT_CTAS,
                 h0_rows=h0.shape[0] if h0 is not None else N, ht_rows=ht.shape[0] if ht.numel() else N),
            dict(pointers, h0=(h0 if h0 is not None else o).data_ptr(), ht=ht.data_ptr(),
                 state_idx=state_io.index_ptr(cu)), stream)
    return o, ht


def fused_variant(problem: Problem, tag: str, bv: int, l2norm: bool, mode: str, longest_first: bool = False) -> dict:
    """gdn_fwd_fused's variant: the forward ("out") or intra-card CP's pre-pass builds ("state", "trans": V = K)."""
    V = problem.head_dim_k if mode == "trans" else problem.head_dim_v
    return {"dtype": tag, "K": problem.head_dim_k, "V": V, "BV": bv, "l2norm": int(l2norm),
            "order": int(longest_first), "mode": mode}


def fused_args(problem: Problem, q, k, v, g, beta, gate: KernelGate, cu, o) -> Tuple[dict, dict]:
    """The sizes and pointers every gdn_fwd_fused launch shares (the callers add the state I/O and the grid cap)."""
    sizes = {"T": problem.batch * problem.tokens, "Hq": problem.num_qk_heads, "Hv": problem.num_v_heads,
             "N": problem.num_seqs, "scale": problem.scale, "gate_mode": gate.mode}
    pointers = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "g": g.data_ptr(), "beta": beta.data_ptr(),
                "cu_seqlens": cu.data_ptr(), "o": o.data_ptr(), **gate.pointers(g)}
    return sizes, pointers


def final_states(problem: Problem, state_io: StateIO, output_final_state: bool, device, o) -> torch.Tensor:
    """Where a plain forward's chains store the final states: state_io.write (a pool written through the index
    table, or the caller's [N, ...] buffer), else a new [N, Hv, K, V] ([N, Hv, V, K] V-first) float32 tensor when
    asked for, else an empty tensor (nothing stored)."""
    if state_io.write is not None:
        return state_io.write
    if not output_final_state:
        return o.new_empty(0)
    K, V = problem.head_dim_k, problem.head_dim_v
    inner = (V, K) if state_io.v_first else (K, V)
    return empty(problem.num_seqs, problem.num_v_heads, *inner, device=device, dtype=torch.float32, output="ht")


def native_state_io(problem: Problem, dtype: torch.dtype, device: torch.device, l2norm: bool,
                    want_gate_free_inverse: bool = False, plan: Optional[ForwardPlan] = None) -> bool:
    """Whether this forward's kernels read and write the caller's states as they are (forward(state_io=...)): on
    every path but intra-card CP, whose combine and per-segment states work in [.., K, V]; for CP the caller gathers /
    transposes the initial states and scatters the final ones around the call (flash_qla/states.py). plan: the
    forward's plan when the caller made it (else planned here, as forward plans it)."""
    if plan is None:
        plan = forward_plan(problem, DTYPE_TAG[dtype], device, l2norm, want_gate_free_inverse)
    return plan.segment_chunks is None


def _cp_tables(problem: Problem, L: int, TC: int, t: dict, stream, bidi: bool = False, trail: bool = False):
    """Segments and warm-ups on the device in one launch (gdn_cp_plan; cp.segment_tables / cp.warmup_tables /
    cp.reverse_warmup_tables are its torch form): (Segments, start [S, Hv] int32, fallback [S, Hv] int32,
    reverse) with reverse = (rend, rfallback) [S, Hv] int32 for the backward (bidi), else None. trail: the last
    sequence ends with an empty segment whose h_in is the state leaving it (cp.trailing_row is the torch form)."""
    dev = t["device"]
    N, Hv, T = problem.num_seqs, problem.num_v_heads, problem.batch * problem.tokens
    S = cp.max_segments(T, N, L) + int(trail)
    i32 = dict(device=dev, dtype=torch.int32)
    seg = cp.Segments(L=L, count=S, cu=empty(S + 1, **i32), slot=empty(S + 1, **i32), base=empty(N + 1, **i32),
                      last=empty(N, **i32))
    start, fallback = empty(S, Hv, **i32), empty(S, Hv, **i32)
    rend, rfallback = (empty(S, Hv, **i32), empty(S, Hv, **i32)) if bidi else (start, fallback)
    launch("gdn_cp_plan", {"tile": 256}, dev,
            {"N": N, "S": S, "Hv": Hv, "TC": TC, "L": L, "tokens": T, "decay_bound": cp.WARMUP_LOG_DECAY,
             "bidi": int(bidi), "trail": int(trail)},
            {"cu_seqlens": t["cu"].data_ptr(), "chunk_offsets": t["offsets"].data_ptr(),
             "gam_t": t["gam_t"].data_ptr(), "bkk_max": t["bkk_max"].data_ptr(), "seg_cu": seg.cu.data_ptr(),
             "seg_slot": seg.slot.data_ptr(), "seg_base": seg.base.data_ptr(), "seg_last": seg.last.data_ptr(),
             "start": start.data_ptr(), "fallback": fallback.data_ptr(), "rend": rend.data_ptr(),
             "rfallback": rfallback.data_ptr()}, stream)
    return seg, start, fallback, ((rend, rfallback) if bidi else None)


def _cp_entry_states(problem: Problem, L: int, tag: str, sizes: dict, pointers: dict, t: dict, stream,
                     bidi: bool = False, after_tables=None, link=None):
    """Intra-card CP (flash_qla/cp.py): the segment tables, the pre-pass (warm-up states and, for the heads whose
    decay does not bound the warm-up, exact transitions) and the combine. Returns (Segments, h_in
    [S, Hv, K, V] fp32, reverse), h_in[s] the state entering segment s, reverse the backward's warm-up tables
    (bidi) or None. link: forward()'s."""
    seg, start, fallback, reverse = _cp_tables(problem, L, sizes["TC"], t, stream, bidi,
                                               trail=link is not None and link.trailing)
    if after_tables is not None:
        after_tables(seg, reverse)
    pre = dict(pointers, cu_seqlens=seg.cu.data_ptr(), chunk_offsets=seg.slot.data_ptr(), start=start.data_ptr(),
               fallback=fallback.data_ptr())
    beside = (lambda m: link.affine_part(problem, seg, m, fallback)) if link is not None else None
    h_in = cp_pre_pass_and_combine(CHAIN_KERNEL, problem, tag, seg, fallback, dict(sizes, use_h0=0, store_ht=1), pre,
                                   "ht", t["h0"], False, stream, (start,), beside_combine=beside)
    return seg, h_in, reverse


def cp_pre_pass_and_combine(kernel: str, problem: Problem, tag: str, seg: "cp.Segments", fallback, sizes: dict,
                            pre: dict, out_key: str, boundary: Optional[torch.Tensor], reverse: bool, stream,
                            keep=(), side_name: str = "side", before_combine=None,
                            beside_combine=None, variant_axes: Optional[dict] = None) -> torch.Tensor:
    """The CP pre-pass of a chain kernel (gdn_fwd_chain for the forward, gdn_bwd_dh for the backward: its "state"
    build over every (segment, head) warm-up and its "trans" build for the fallback heads, on a side stream) and
    gdn_cp_combine (reverse: last segment first). pre: the kernel's pointers with the segment tables; out_key: the
    pointer its CP builds store to; boundary: h0 (forward) or dht (backward), or None for zeros. Returns
    [S, Hv, K, V] fp32: the state entering each segment, or the gradient of the state leaving it. side_name: the
    transitions' stream (the backward's reverse pre-pass, running beside the recompute's, takes its own).
    before_combine: called right before the combine, the first launch that reads the boundary (which work it queues
    on another stream may still write, the current stream waiting for it). beside_combine(m): called there too, to
    queue work that reads the transitions on another stream beside the combine; it returns the join of the current
    stream on that work, made after the combine's launch (or None). variant_axes: the kernel's other variant axes
    (gdn_fwd_fused's l2norm and order)."""
    dev = seg.cu.device
    Hv, K, V, N, S = problem.num_v_heads, problem.head_dim_k, problem.head_dim_v, problem.num_seqs, seg.count
    # the warm-up chains write Z straight into the result; gdn_cp_combine then fixes up only the boundary and the
    # fallback segments in place
    out = empty(S, Hv, K, V, device=dev, dtype=torch.float32)
    m = empty(S, Hv, K, K, device=dev, dtype=torch.float32)
    # the pre-pass chains read no h0 and store [S, Hv, K, V] (internal: the plain layout, no pool)
    seg_sizes = dict(sizes, N=S, h0_rows=S, ht_rows=S, state_mode=0)
    # the two pre-pass builds are independent: the transitions run on a side stream beside the warm-ups
    # (fork / join by events, so a CUDA graph captures them as parallel branches)
    main, side = torch.cuda.current_stream(dev), side_stream(dev, side_name)
    join(side, main)
    axes = variant_axes or {}
    launch(kernel, {"dtype": tag, "K": K, "V": V, "BV": 64, "mode": "state", **axes}, dev, seg_sizes,
            dict(pre, **{out_key: out.data_ptr()}), stream)
    launch(kernel, {"dtype": tag, "K": K, "V": K, "BV": 64, "mode": "trans", **axes}, dev, seg_sizes,
            dict(pre, **{out_key: m.data_ptr()}), side.cuda_stream)
    join(main, side)
    for buf in (m, fallback, seg.cu, seg.slot, *keep):
        buf.record_stream(side)
    if before_combine is not None:
        before_combine()
    joined = beside_combine(m) if beside_combine is not None else None
    launch("gdn_cp_combine", cp.combine_variant(K, V, Hv, N, num_sms(dev)), dev,
            {"Hv": Hv, "N": N, "S": S, "use_h0": int(boundary is not None), "reverse": int(reverse), "zero_z": 0},
            {"m": m.data_ptr(), "fallback": fallback.data_ptr(), "seg_base": seg.base.data_ptr(),
             "h0": (boundary if boundary is not None else out).data_ptr(), "h_in": out.data_ptr()}, stream)
    if joined is not None:
        joined()
    return out


def _cp_forward(problem: Problem, L: int, tag: str, sizes: dict, pointers: dict, t: dict, output_final_state: bool,
                stream) -> torch.Tensor:
    """The forward's state recurrence with intra-card CP (flash_qla/cp.py): pre-pass, combine, then gdn_fwd_chain
    over the segments as independent sequences. Returns the final state ([N, Hv, K, V] or empty)."""
    seg, h_in, _ = _cp_entry_states(problem, L, tag, sizes, pointers, t, stream)
    variant, chain_sizes, ht_seg = _segment_chain(problem, tag, sizes, seg, output_final_state, t)
    launch(CHAIN_KERNEL, variant, t["device"], chain_sizes,
           dict(pointers, cu_seqlens=seg.cu.data_ptr(), chunk_offsets=seg.slot.data_ptr(), h0=h_in.data_ptr(),
                ht=ht_seg.data_ptr()), stream)
    if not output_final_state:
        return t["ht"]
    # a zero-length sequence keeps its initial state
    return SegmentStates(ht_seg, seg.last, seg.last, t["h0"], seg.count)


def _segment_chain(problem: Problem, tag: str, sizes: dict, seg: "cp.Segments", output_final_state: bool, t: dict):
    """The CP output chain over the segments as independent sequences, from h_in: (variant, sizes, the per-segment
    final states [S, Hv, K, V] fp32, or o's buffer standing in where none is kept)."""
    dev, S = t["device"], seg.count
    Hv, K, V = problem.num_v_heads, problem.head_dim_k, problem.head_dim_v
    ht_seg = empty(S, Hv, K, V, device=dev, dtype=torch.float32) if output_final_state else t["o"]
    bv = _block_v(problem, tag, dev, chains_per_head=S)
    return ({"dtype": tag, "K": K, "V": V, "BV": bv, "mode": "out"},
            dict(sizes, N=S, use_h0=1, store_ht=int(output_final_state), h0_rows=S, ht_rows=S, state_mode=0), ht_seg)


@dataclass
class Link:
    """forward()'s ``link``: the first part of multi-GPU CP's linked forward. trailing: the tables end the last
    sequence with an empty segment, so h_in there is the state leaving it (gdn_cp_plan's trail). eye: where
    sequence 0 continues from another rank, [N, Hv, K, K] fp32 (I for sequence 0, zeros after): h_in[s] = A[s] +
    B[s] h_e is affine in the state h_e entering sequence 0 (A: the combine from a zero h_e), and B, the same combine
    from the identity with zero warm-up states (gdn_cp_combine's zero_z), runs beside A's into ``b``."""
    trailing: bool
    eye: Optional[torch.Tensor] = None
    b: Optional[torch.Tensor] = None    # [S, Hv, K, K] fp32, made by affine_part

    def affine_part(self, problem: Problem, seg: "cp.Segments", m: torch.Tensor, fallback: torch.Tensor):
        """B's combine on the "link" side stream, beside A's; returns the join of the current stream on it."""
        if self.eye is None:
            return None
        dev, K, Hv = m.device, problem.head_dim_k, problem.num_v_heads
        self.b = empty(seg.count, Hv, K, K, device=dev, dtype=torch.float32)
        main, side = torch.cuda.current_stream(dev), side_stream(dev, "link")
        join(side, main)
        launch("gdn_cp_combine", cp.combine_variant(K, K, Hv, problem.num_seqs, num_sms(dev)), dev,
               {"Hv": Hv, "N": problem.num_seqs, "S": seg.count, "use_h0": 1, "reverse": 0, "zero_z": 1},
               {"m": m.data_ptr(), "fallback": fallback.data_ptr(), "seg_base": seg.base.data_ptr(),
                "h0": self.eye.data_ptr(), "h_in": self.b.data_ptr()}, side.cuda_stream)
        for buf in (m, fallback, seg.base, self.b):
            buf.record_stream(side)
        return lambda: join(main, side)


@dataclass
class LinkedEntry:
    """A linked forward's first part's results: h_in [S, Hv, K, V] fp32 after the combine (sequence 0 entering
    with zero state), B (or None), and what linked_output needs: the output chain's variant, sizes and pointers
    (tensors, or addresses in a replay: plans.Address), the final states' tables."""
    variant: dict
    sizes: dict
    pointers: dict
    h_in: torch.Tensor
    b: Optional[torch.Tensor]
    last: object
    boundary: object
    count: int
    store_ht: bool


def _linked_entry(problem: Problem, L: int, tag: str, sizes: dict, pointers: dict, t: dict, output_final_state: bool,
                  stream, link: Link, named: dict) -> LinkedEntry:
    seg, h_in, _ = _cp_entry_states(problem, L, tag, sizes, pointers, t, stream, link=link)
    variant, chain_sizes, ht_seg = _segment_chain(problem, tag, sizes, seg, output_final_state, t)
    tensors = dict(named, h0=h_in, cu_seqlens=seg.cu, chunk_offsets=seg.slot, o=t["o"], ht=ht_seg)
    b, link.b = link.b, None        # the entry holds this call's B, not the (kept) Link
    return LinkedEntry(variant, chain_sizes, tensors, h_in, b, seg.last, t["h0"], seg.count, output_final_state)


def linked_output(entry: LinkedEntry, device: torch.device) -> Optional[SegmentStates]:
    """The linked forward's second part: the output chain from entry.h_in (which the caller completed) into o.
    Returns the final states as SegmentStates (addresses in a replay), or None."""
    launch(CHAIN_KERNEL, entry.variant, device, entry.sizes, {k: address(t) for k, t in entry.pointers.items()},
           current_stream(device))
    if not entry.store_ht:
        return None
    return SegmentStates(entry.pointers["ht"], entry.last, entry.last, entry.boundary, entry.count)


@dataclass
class SegmentStates:
    """Per-segment states and the tables that pick each sequence's: its last segment's (the final state) or its first
    segment's (dh0), the boundary (h0 / dht, or zeros) for an empty sequence (last[n] < 0). kernel_api.per_sequence
    picks them with one gdn_state_pick launch inside the call's plan."""
    states: torch.Tensor
    segment: torch.Tensor
    last: torch.Tensor
    boundary: Optional[torch.Tensor]
    count: int


def chunk_local_cumsum(g_packed: torch.Tensor, cu: torch.Tensor, shape) -> torch.Tensor:
    """Chunk-local cumsum of g [T, Hv] on the device (float64 running sum, no host sync) -> [B, T, Hv] fp32."""
    T = g_packed.shape[0]
    _, local = token_positions(cu, T)
    t = torch.arange(T, device=cu.device)
    start = t - local % CHUNK  # the token's chunk start
    cs = torch.cat([g_packed.new_zeros(1, g_packed.shape[1], dtype=torch.float64),
                    torch.cumsum(g_packed.double(), dim=0)])
    return (cs[t + 1] - cs[start]).float().unflatten(0, shape)
