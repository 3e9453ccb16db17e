"""The kernel path's entry points behind the public API: input preparation, plan look-up, autograd.

A call is validated (flash_qla.validation, O(1) Python, no device synchronisation), its inputs brought to the
kernels' layouts (no-ops for the usual dtypes), and run by its cached plan (flash_qla/plans.py): the first call of a
signature records forward.forward / backward.backward, later ones replay them with one C crossing.
FLA's gate / beta activations (gates.KernelGate) run inside the kernels: the mode joins the plans' keys, A_log and
dt_bias join their inputs, and the autograd function returns their gradients.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import plans
from .backward import backward, chain_blocks, gate_sums, native_v_first
from .forward import (Link, LinkedEntry, SegmentStates, chunk_local_cumsum, device_cu_seqlens, forward, forward_plan,
                      native_state_io)
from .gates import NO_GATE, KernelGate, head_vector
from .launch import (DTYPE_TAG, PICK_KERNEL, address, current_stream, dense, empty, launch, packed, side_stream,
                     supported_head_dims)
from .planner import ForwardPlan
from .states import PLAIN_IO, StateIO
from .tuning import settings
from .validation import HostLengths, Problem, host_lengths, validate_kernel_inputs

__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd", "run_forward",
           "run_backward", "supported_head_dims"]


def _contiguous(x: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    if x is None:
        return None
    if dtype is not None and x.dtype != dtype:
        return x.to(dtype).contiguous()
    return x if x.is_contiguous() else x.contiguous()


def _forward_inputs(problem: Problem, q, k, v, g, beta, initial_state, cu_seqlens) -> tuple:
    """The tensors the forward's kernels read, in their layouts: q, k, v, g contiguous, beta and h0 float32,
    cu_seqlens int32 on the device (a dense batch's made up)."""
    return (dense(q), dense(k), dense(v), dense(g), _contiguous(beta, torch.float32),
            _contiguous(initial_state, torch.float32), device_cu_seqlens(problem, cu_seqlens, q.device))


def _finish_forward(o, A, ht):
    return o, ht, A


def per_sequence(problem: Problem, seg: SegmentStates, device: torch.device, output: str) -> torch.Tensor:
    """Intra-card CP's per-segment states -> [N, Hv, K, V] per sequence (gdn_state_pick: the last segment's final
    state, the first segment's dh0; an empty sequence passes the boundary through), launched inside the call's
    plan."""
    N, Hv, K, V = problem.num_seqs, problem.num_v_heads, problem.head_dim_k, problem.head_dim_v
    out = empty(N, Hv, K, V, device=device, dtype=torch.float32, output=output)
    boundary = seg.boundary if seg.boundary is not None else out
    launch(PICK_KERNEL, {"K": K, "V": V}, device,
           {"Hv": Hv, "N": N, "S": seg.count, "use_boundary": int(seg.boundary is not None)},
           {"states": address(seg.states), "segment": address(seg.segment), "last": address(seg.last),
            "boundary": address(boundary), "out": out.data_ptr()})
    return out


def forward_key(problem: Problem, device: torch.device, dtype: torch.dtype, has_h0: bool, output_final_state: bool,
                use_qk_l2norm: bool, want_gate_free_inverse: bool = False) -> tuple:
    """A forward plan's key: everything its decisions depend on (sizes and scale in ``problem``, dtypes, flags,
    device, the tuning generation). Sequence lengths beyond the token and sequence counts are not in it: the plans
    read them on the device."""
    return ("fwd", device.index, problem, dtype, bool(has_h0), bool(output_final_state), bool(use_qk_l2norm),
            bool(want_gate_free_inverse), settings.generation)


def _record_forward(problem: Problem, inputs: tuple, dev: torch.device, output_final_state: bool, l2norm: bool,
                    want_gate_free_inverse: bool = False, plan: Optional[ForwardPlan] = None,
                    state_io: StateIO = PLAIN_IO, gate: KernelGate = NO_GATE):
    """A forward run as written on prepared inputs (a plan's recording): ((o, A, ht), finish)."""
    qi, ki, vi, gi, bi, h0, cu = inputs
    o, ht, A, _ = forward(problem, qi, ki, vi, gi, bi, h0, output_final_state, cu, l2norm,
                          want_gate_free_inverse=want_gate_free_inverse, plan=plan, state_io=state_io, gate=gate)
    if isinstance(ht, SegmentStates):
        ht = per_sequence(problem, ht, dev, "ht")
    return (o, A, ht), _finish_forward


def _finish_window(o, ht, flags):
    return o, ht, flags[0] != 0


def run_window(problem: Problem, q, k, v, g, beta, use_qk_l2norm: bool, plan: ForwardPlan, walk: int):
    """Multi-GPU CP's head window build (forward.forward's ``window``) over each sequence of a validated problem with
    V = K (v is not read): (o, final states, whole [Hv] bool: the heads that ran the whole first sequence), recorded
    once per signature and replayed like the plain forward. ``plan``: a split plan of one 64-column block."""
    dev = q.device
    inputs = _forward_inputs(problem, q, k, v, g, beta, None, None)
    key = forward_key(problem, dev, q.dtype, False, True, use_qk_l2norm) + ("window", tuple(plan[:4]), walk)

    def record():
        flags = empty(problem.num_seqs, problem.num_v_heads, device=dev, dtype=torch.int32, output="flags")
        o, ht, _, _ = forward(problem, *inputs[:5], None, True, inputs[6], use_qk_l2norm, plan=plan,
                              window=(walk, flags))
        return (o, ht, flags), _finish_window

    return plans.call(key, inputs, dev, current_stream(dev), record, side_stream)


def _finish_linked(keys, variant, sizes, count, store_ht, o, h_in, b, *rest):
    n = len(keys)
    return o, LinkedEntry(variant, sizes, dict(zip(keys, rest), h0=h_in), h_in, b, rest[n], rest[n + 1], count,
                          store_ht)


def run_linked_entry(problem: Problem, q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm: bool,
                     plan: ForwardPlan, link: Link, output_final_state: bool):
    """Multi-GPU CP's linked forward, first part (forward.forward's ``link``) on an intra-card CP plan: (o, unwritten
    yet, and the LinkedEntry that forward.linked_output completes), recorded once per signature and replayed like
    the plain forward (link.eye is an input of the plan)."""
    dev = q.device
    inputs = _forward_inputs(problem, q, k, v, g, beta, initial_state, cu_seqlens) + (link.eye,)
    key = forward_key(problem, dev, q.dtype, initial_state is not None, output_final_state, use_qk_l2norm) + (
        "linked", tuple(plan[:4]), link.trailing, link.eye is not None)

    def record():
        o, entry, _, _ = forward(problem, *inputs[:6], output_final_state, inputs[6], use_qk_l2norm, plan=plan,
                                 link=link)
        # the output chain's other pointers and the final states' tables pass on as addresses (no views to build)
        rest = {k: t for k, t in entry.pointers.items() if k != "h0"}
        results = ((o, entry.h_in, entry.b) + tuple(plans.Address(t) for t in rest.values())
                   + (plans.Address(entry.last), None if entry.boundary is None else plans.Address(entry.boundary)))
        return results, functools.partial(_finish_linked, tuple(rest), entry.variant, entry.sizes, entry.count,
                                          entry.store_ht)

    return plans.call(key, inputs, dev, current_stream(dev), record, side_stream)


def run_forward(problem: Problem, q, k, v, g, beta, initial_state, output_final_state: bool, cu_seqlens,
                use_qk_l2norm: bool, want_gate_free_inverse: bool = False):
    """(o [B, T, Hv, V], final state [N, Hv, K, V] fp32 or an empty tensor, A [B, T, Hv, 64] or None, cu int32)."""
    validate_kernel_inputs(problem, q, g, beta, initial_state, supported_head_dims())
    inputs = _forward_inputs(problem, q, k, v, g, beta, initial_state, cu_seqlens)
    dev = q.device
    key = forward_key(problem, dev, q.dtype, initial_state is not None, output_final_state, use_qk_l2norm,
                      want_gate_free_inverse)

    def record():
        return _record_forward(problem, inputs, dev, output_final_state, use_qk_l2norm, want_gate_free_inverse)

    o, ht, A = plans.call(key, inputs, dev, current_stream(dev), record, side_stream)
    return o, ht, A, inputs[-1]


def _finish_backward(dq, dk, dv, dg, dbeta, dh0, part=None, *, dtypes):
    grads = (dq, dk, dv, dg, dbeta, dh0)
    if part is not None:  # the raw gate: dA_log and dt_bias's gradient, [2, Hv]
        grads += gate_sums(part)
    return _converted(grads, dtypes)


def _converted(grads, dtypes):
    return tuple(d if d is None or t is None else d.to(t) for d, t in zip(grads, dtypes))


def run_backward(problem: Problem, q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm: bool, do, dht,
                 A=None, g_is_cumsum: bool = False, v_first: bool = False, gate: KernelGate = NO_GATE,
                 gate_dtypes: tuple = (None, None), before_dht=None, longest: Optional[int] = None):
    """(dq, dk, dv, dg, dbeta, dh0) in the inputs' dtypes; dh0 None without an initial state. v_first: initial_state,
    dht and dh0 are [N, Hv, V, K] (the kernels read and write them so, or, where the recompute plans intra-card CP,
    they are transposed around the call). gate: FLA's activations in the kernels (g / beta raw, dg / dbeta with
    respect to them); with gate.gate (dA_log [Hv], d dt_bias [Hv] or None) follow, in gate_dtypes.
    before_dht (flash_qla.distributed): backward.backward's hook; the call then runs as written, not from a recorded
    plan (the work the hook queues on another stream is not the plan's), and dht must be float32 and contiguous: the
    tensor the kernels read, which the hook may write. longest: the longest sequence's tokens when the host knows the
    lengths (the chains' V blocks then plan for the batch's skew; the blocks, not the lengths, join the plan's key)."""
    if v_first and not native_v_first(problem, q.dtype, q.device):
        swap = (lambda x: None if x is None else x.transpose(-1, -2).contiguous())
        grads = run_backward(problem, q, k, v, g, beta, swap(initial_state), cu_seqlens, use_qk_l2norm, do, swap(dht),
                             A, g_is_cumsum, gate=gate, gate_dtypes=gate_dtypes, longest=longest)
        return grads[:5] + (swap(grads[5]),) + grads[6:]
    validate_kernel_inputs(problem, q, g, beta, initial_state, supported_head_dims())
    dev = q.device
    inputs = _forward_inputs(problem, q, k, v, g, beta, initial_state, cu_seqlens) + (
        _contiguous(do, q.dtype), _contiguous(dht, torch.float32), _contiguous(A), gate.A_log, gate.dt_bias)
    dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
              initial_state.dtype if initial_state is not None else None) + (gate_dtypes if gate.gate else ())
    key = ("bwd", dev.index, problem, dtypes, dht is not None, A is not None, bool(use_qk_l2norm), g_is_cumsum,
           v_first, gate.mode, settings.generation)
    if longest is not None and problem.num_seqs > 1:  # the chains' V blocks, the one decision the lengths move
        key += chain_blocks(problem, DTYPE_TAG[q.dtype], dev, longest)
    else:
        longest = None

    def record():
        qi, ki, vi, gi, bi, h0, cu, doi, dhti, Ai = inputs[:10]
        grads = backward(problem, qi, ki, vi, gi, bi, h0, cu, use_qk_l2norm, doi, dhti, Ai, g_is_cumsum=g_is_cumsum,
                         v_first=v_first, gate=gate, before_dht=before_dht, longest=longest)
        dh0 = grads[5]
        if isinstance(dh0, SegmentStates):
            dh0 = per_sequence(problem, dh0, dev, "dh0")
        return grads[:5] + (dh0,) + grads[6:], functools.partial(_finish_backward, dtypes=dtypes)

    if before_dht is not None:
        if dht is not None and inputs[8] is not dht:
            raise ValueError("internal: a backward with before_dht needs dht float32 and contiguous")
        results, finish = record()
        return finish(*results)
    return plans.call(key, inputs, dev, current_stream(dev), record, side_stream)


class Call:
    """One validated signature's call (sizes, flags, device; its forward plan's key computed once). flash_qla.api
    keeps one per plain signature (its fast lane): a repeat goes from the API straight to here, with no checks run
    again, then to the plan, or through autograd, whose forward replays the same plan."""

    __slots__ = ("problem", "output_final_state", "l2norm", "key", "device", "plan", "dtype", "has_h0", "_by_plan",
                 "state_io", "gate_mode", "allow_cp")

    def __init__(self, problem: Problem, device: torch.device, dtype: torch.dtype, has_h0: bool,
                 output_final_state: bool, l2norm: bool, lengths: Optional[HostLengths] = None,
                 state_io: StateIO = PLAIN_IO, allow_cp: bool = True, gate_mode: int = 0):
        self.problem, self.device, self.dtype, self.has_h0 = problem, device, dtype, has_h0
        # FLA's activations in the kernels (gates.KernelGate's mode); A_log / dt_bias come with each call
        self.gate_mode = gate_mode
        self.output_final_state, self.l2norm, self.allow_cp = output_final_state, l2norm, allow_cp
        self.key = forward_key(problem, device, dtype, has_h0, output_final_state, l2norm)
        self._by_plan: dict = {}
        # host-known lengths plan the forward from the longest sequence: the plan (not the lengths) joins the key,
        # so batches that plan alike share one recorded plan
        self.plan = None
        if lengths is not None or not allow_cp:
            self.plan = _plan(problem, dtype, device, l2norm, lengths, allow_cp)
            self.key += (_plan_key(self.plan),)
        # the caller's state layout / pool, read and written by the kernels (state_io: see native_state_io); its
        # index table and separate write target are inputs of the plan, traced like q or k
        self.state_io = state_io
        if state_io.mode or state_io.write is not None:
            self.key += ("state_io", state_io.mode, state_io.write is not None)
        if gate_mode:
            self.key += ("gate", gate_mode)

    def for_lengths(self, lengths: Optional[HostLengths]) -> "Call":
        """This signature's call for a batch of these host-known lengths (None: equal lengths)."""
        if lengths is None:
            return self
        plan = _plan_key(_plan(self.problem, self.dtype, self.device, self.l2norm, lengths, self.allow_cp))
        call = self._by_plan.get(plan)
        if call is None:
            call = self._by_plan[plan] = Call(self.problem, self.device, self.dtype, self.has_h0,
                                              self.output_final_state, self.l2norm, lengths, allow_cp=self.allow_cp,
                                              gate_mode=self.gate_mode)
        return call

    def __call__(self, q, k, v, g, beta, initial_state, cu_seqlens, A_log=None, dt_bias=None,
                 lengths: Optional[HostLengths] = None):
        """lengths: this batch's host-known lengths, which plan the backward's chains under autograd."""
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or g.requires_grad
                                        or beta.requires_grad or
                                        (initial_state is not None and initial_state.requires_grad)
                                        or (A_log is not None and A_log.requires_grad)
                                        or (dt_bias is not None and dt_bias.requires_grad)):
            return _ChunkGatedDeltaRule.apply(self, q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias,
                                              lengths.longest if lengths is not None else None)
        o, ht = self.forward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
        return o, (ht if self.output_final_state else None)

    def gate(self, A_log, dt_bias) -> KernelGate:
        """This call's KernelGate with the parameters as the kernels read them."""
        if not self.gate_mode:
            return NO_GATE
        return KernelGate(self.gate_mode, head_vector(A_log) if A_log is not None else None,
                          head_vector(dt_bias) if dt_bias is not None else None)

    def forward(self, q, k, v, g, beta, initial_state, cu_seqlens, A_log=None, dt_bias=None):
        """(o, final state or an empty tensor), no autograd."""
        dev = self.device
        inputs = _forward_inputs(self.problem, q, k, v, g, beta, initial_state, cu_seqlens)
        io, key = self.state_io, self.key
        if io.mode or io.write is not None:
            separate = io.write is not None and io.write is not initial_state  # the pool written in place: one input
            inputs += (io.index, io.write if separate else None)
            key += (separate,)  # which input the recorded stores trace to
        gate = self.gate(A_log, dt_bias)
        if gate.mode:
            inputs += (gate.A_log, gate.dt_bias)
        o, ht, _ = plans.call(key, inputs, dev, current_stream(dev), lambda: self._record(inputs, gate), side_stream)
        return o, ht

    def _record(self, inputs, gate: KernelGate = NO_GATE):
        return _record_forward(self.problem, inputs[:7], self.device, self.output_final_state, self.l2norm,
                               plan=self.plan, state_io=self.state_io, gate=gate)


class _ChunkGatedDeltaRule(torch.autograd.Function):
    """Saves only the inputs: the backward recomputes every intermediate (flash_qla/backward.py)."""

    @staticmethod
    def forward(ctx, call: Call, q, k, v, g, beta, initial_state, cu_seqlens, A_log=None, dt_bias=None, longest=None):
        if call.state_io.index is not None or call.state_io.write is not None:
            raise RuntimeError("a state pool or in-place state write under autograd: the API keeps these to torch's "
                               "passes (states.native_io)")
        o, ht = call.forward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
        ctx.call, ctx.cu_seqlens, ctx.has_h0, ctx.longest = call, cu_seqlens, initial_state is not None, longest
        ctx.gate_params = (A_log is not None, dt_bias is not None)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, A_log, dt_bias)
        return o, (ht if call.output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, A_log, dt_bias = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        call = ctx.call
        gate = call.gate(A_log if ctx.gate_params[0] else None, dt_bias if ctx.gate_params[1] else None)
        grads = run_backward(call.problem, q, k, v, g, beta, h0 if ctx.has_h0 else None, ctx.cu_seqlens, call.l2norm,
                             do, dht, v_first=call.state_io.v_first, gate=gate,
                             gate_dtypes=(A_log.dtype if ctx.gate_params[0] else None,
                                          dt_bias.dtype if ctx.gate_params[1] else None), longest=ctx.longest)
        dq, dk, dv, dg, dbeta, dh0 = grads[:6]
        dA_log = d_dt_bias = None
        if gate.gate:
            dA_log = grads[6].reshape(A_log.shape)
            d_dt_bias = grads[7].reshape(dt_bias.shape) if ctx.gate_params[1] else None
        return None, dq, dk, dv, dg, dbeta, dh0, None, dA_log, d_dt_bias, None


def _plan(problem: Problem, dtype: torch.dtype, device: torch.device, l2norm: bool,
          lengths: Optional[HostLengths], allow_cp: bool) -> ForwardPlan:
    return forward_plan(problem, DTYPE_TAG[dtype], device, l2norm, False, lengths.longest if lengths else None,
                        allow_cp, bool(lengths and lengths.unordered))


def _plan_key(plan: ForwardPlan) -> tuple:
    """What of a forward plan its recording depends on (not its predicted time)."""
    return plan[:4] + (plan.longest_first,)


def host_lengths_of(problem: Problem, cu_seqlens_cpu) -> Optional[HostLengths]:
    """The longest sequence and whether the lengths are out of longest-first order, from cu_seqlens' host copy (None:
    not given, or a single sequence)."""
    return None if cu_seqlens_cpu is None else host_lengths(cu_seqlens_cpu, problem.batch * problem.tokens)


def native_state_io_for(problem: Problem, dtype: torch.dtype, device: torch.device, l2norm: bool,
                        cu_seqlens_cpu=None, auto_cp: Optional[bool] = None) -> bool:
    """Whether this call's forward plan lets the kernels read and write the caller's states as they are (every
    plan but intra-card CP; forward.native_state_io)."""
    plan = _plan(problem, dtype, device, l2norm, host_lengths_of(problem, cu_seqlens_cpu), auto_cp is not False)
    return native_state_io(problem, dtype, device, l2norm, plan=plan)


def chunk_gated_delta_rule(problem, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                           use_qk_l2norm_in_kernel, cu_seqlens_cpu=None, state_io: StateIO = PLAIN_IO,
                           auto_cp: Optional[bool] = None, gate: KernelGate = NO_GATE):
    """The kernel path of flash_qla.chunk_gated_delta_rule on validated inputs: (o, final state or None).
    cu_seqlens_cpu: cu_seqlens' values on the host (checked by the API), which plan the forward from the longest
    sequence instead of equal lengths. state_io: the caller's state layout / pool / write target, done by the kernels
    (only where native_state_io_for says so); initial_state is then as the caller gave it (V-first, or the pool).
    auto_cp False: the forward plans no intra-card CP (FlashQLA's meaning; the backward's recompute still may).
    gate: FLA's use_gate_in_kernel / use_beta_sigmoid_in_kernel run by the kernels (g / beta raw; gates.kernel_gate):
    its A_log / dt_bias get gradients under autograd."""
    if state_io.mode or state_io.write is not None:
        validate_kernel_inputs(problem, q, g, beta, None, supported_head_dims())  # the pool's shape is the caller's
    else:
        validate_kernel_inputs(problem, q, g, beta, initial_state, supported_head_dims())
    lengths = host_lengths_of(problem, cu_seqlens_cpu)
    return Call(problem, q.device, q.dtype, initial_state is not None, output_final_state,
                use_qk_l2norm_in_kernel, lengths, state_io, auto_cp is not False,
                gate.mode)(q, k, v, g, beta, initial_state, cu_seqlens, gate.A_log, gate.dt_bias, lengths=lengths)


def chunk_gated_delta_rule_fwd(problem, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                               use_qk_l2norm_in_kernel):
    o, ht, A, cu = run_forward(problem, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                               use_qk_l2norm_in_kernel, want_gate_free_inverse=True)
    g_cumsum = chunk_local_cumsum(packed(g), cu, (problem.batch, problem.tokens))
    return g_cumsum, A, o, None, (ht if output_final_state else None)


def chunk_gated_delta_rule_bwd(problem, q, k, v, g_cumsum, beta, A, do, dht, initial_state, cu_seqlens,
                               use_qk_l2norm_in_kernel, cu_seqlens_cpu=None):
    """FlashQLA's low-level backward. ``A`` (the forward's gate-free inverse, checked by the API; None: solved
    again) is read by the recompute pass instead of solved, as FlashQLA's backward reads it; g_cumsum goes to
    gdn_prepare as it is. cu_seqlens_cpu: cu_seqlens' values on the host (checked by the API), which plan the
    chains from the batch's longest sequence."""
    lengths = host_lengths_of(problem, cu_seqlens_cpu)
    dq, dk, dv, dg, dbeta, dh0 = run_backward(problem, q, k, v, g_cumsum, beta, initial_state, cu_seqlens,
                                              use_qk_l2norm_in_kernel, do, dht, A, g_is_cumsum=True,
                                              longest=lengths.longest if lengths is not None else None)
    return dq, dk, dv, dbeta, dg, dh0
