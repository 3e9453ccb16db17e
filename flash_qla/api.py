"""Public API, drop-in for FlashQLA's and FLA's ``chunk_gated_delta_rule``.

Backends:
* ``"reference"``: the pure-PyTorch chunked form (:mod:`flash_qla.reference`) on any device, computing in
  float32 (float64 for float64 inputs). Slow; it exists for CPUs, tests and checking.
* ``"kernels"``: the precompiled sm_90a kernels (CUDA tensors on a compute-capability 9.0 GPU).
* ``"auto"`` (default): CPU tensors run the reference; CUDA tensors on sm_90 run the kernels; any other
  device is an error that says which backend to ask for. There is never a silent fallback.
"""
from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch

from . import gates, reference, states
from .tuning import settings
from .validation import Problem, check_cu_seqlens_cpu, check_keywords, host_lengths, validate_inputs

BACKENDS = ("auto", "kernels", "reference")
_CAPABILITY: dict = {}


def select_backend(device: torch.device, backend: str) -> str:
    """Resolve ``backend`` for tensors on ``device``; raise a clear error where nothing fits."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return "reference"
    if device.type == "cpu":
        if backend == "kernels":
            raise ValueError("backend='kernels' needs CUDA tensors on an sm_90 GPU; the inputs are on the CPU "
                             "(use backend='reference' or 'auto')")
        return "reference"
    if device.type != "cuda":
        raise ValueError(f"flash_qla runs on CUDA (sm_90) or CPU tensors, got device {device}; "
                         f"pass backend='reference' to run the pure-PyTorch path there")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:  # torch's query costs ~20 us per call; a device's capability never changes
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    major, minor = _CAPABILITY[index]
    if (major, minor) != (9, 0):
        raise RuntimeError(f"the kernels are built for sm_90a, found sm_{major}{minor} on {device}; "
                           f"pass backend='reference' to run the pure-PyTorch path there (called through FLA's "
                           f"dispatch, which also routes SM100 / SM120 to flash_qla: set FLA_FLASH_QLA=0 so FLA runs "
                           f"its own kernels on this GPU)")
    return "kernels"


def _kernel_ops():
    from . import kernel_api  # imported lazily: CPU-only users never touch the loader
    return kernel_api


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, *,
                           cu_seqlens: Optional[torch.Tensor] = None, cu_seqlens_cpu: Optional[torch.Tensor] = None,
                           chunk_indices: Optional[torch.Tensor] = None, chunk_size: int = 64,
                           head_first: bool = False, state_v_first: bool = False,
                           use_gate_in_kernel: bool = False, A_log: Optional[torch.Tensor] = None,
                           dt_bias: Optional[torch.Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
                           allow_neg_eigval: bool = False, initial_state_indices: Optional[torch.Tensor] = None,
                           state_indices: Optional[torch.Tensor] = None, inplace_update: bool = False,
                           output_state: Optional[torch.Tensor] = None, output: Optional[torch.Tensor] = None,
                           auto_cp: bool = True, enable_fwd_cp_cache: bool = True, force_intra_cp: bool = False,
                           cp_context=None, backend: str = "auto") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated DeltaNet chunked prefill, differentiable in q, k, v, g, beta, initial_state (and A_log, dt_bias).

    A drop-in for FLA's and FlashQLA's ``chunk_gated_delta_rule``: the first nine arguments are positional as in
    both, every other one is keyword-only (the two libraries order them differently).

    Shapes: q, k [B, T, Hq, K]; v [B, T, Hv, V]; g (natural-log decay, <= 0), beta [B, T, Hv];
    initial_state [N, Hv, K, V]; cu_seqlens [N+1] int32/int64 with B == 1 for packed sequences.
    Hv must be a multiple of Hq (v-head h reads q/k head h // (Hv // Hq)). scale defaults to K**-0.5.
    Returns (o [B, T, Hv, V] in v's dtype, final_state [N, Hv, K, V] float32 or None).

    Keywords (FLA 0.6 / FlashQLA 0.1.3 meanings; docs/integrations.md has the table):

    * ``state_v_first``: every state (initial_state, the pool, output_state, the result) is [..., Hv, V, K].
    * ``use_gate_in_kernel`` with ``A_log`` [Hv] and optional ``dt_bias`` [Hv]: g is the raw gate and the decay is
      -exp(A_log) * softplus(g + dt_bias); gradients flow to g, A_log and dt_bias.
    * ``use_beta_sigmoid_in_kernel``: beta holds logits, sigmoid(beta) is used (2 * sigmoid with
      ``allow_neg_eigval``, which requires it).
    * g, beta and initial_state may be float16 / bfloat16 (converted to float32); the final state is float32.
    * ``cu_seqlens_cpu``: the host copy of cu_seqlens (its lengths are then known with no device sync: the forward
      is planned from them, the fused kernel walks up to 128 sequences out of order longest first, and under
      autograd the backward's chains plan from the longest sequence);
      ``chunk_indices``: FLA's precomputed chunk table, checked and not needed (the kernels plan chunks on the
      device); ``chunk_size`` in (16, 32, 64): accepted, the results do not depend on it (the kernels use 64).
    * ``head_first=True``: an error (FLA and FlashQLA removed it). ``auto_cp=False``: the forward takes no
      intra-card CP (FlashQLA's meaning; with True the planner decides per shape, with the same results);
      ``force_intra_cp``, ``enable_fwd_cp_cache``: FlashQLA's other CP controls, accepted: the planner decides, and
      the backward recomputes instead of caching.
    * ``cp_context``: a :class:`flash_qla.distributed.CPContext` (``flash_qla.build_cp_context``) runs the
      multi-GPU path; its context fixes the sequence layout (FLA's rule); any other object is an error.
    * State pool (serving engines): with ``initial_state_indices`` (or FlashInfer's ``state_indices``) int32 [N],
      ``initial_state`` is a pool [S, Hv, K, V] and sequence n starts from ``initial_state[indices[n]]``, or from
      zeros where ``indices[n] < 0`` (padding). ``inplace_update=True`` writes each final state back into its slot
      (padding writes nothing); ``output_state`` (with ``output_final_state=True``) receives them instead, by slot
      with indices or [N, ...] without, and is returned as the final state. Without indices, ``inplace_update``
      overwrites a dense initial_state. No host synchronisation: capturable in a CUDA graph.
    * ``output``: a buffer for o ([B, T, Hv, V] or [B*T, Hv, V], v's dtype), written and returned.
    """
    plain = (initial_state_indices is None and state_indices is None and output_state is None and output is None
             and inplace_update is False and state_v_first is False
             and use_gate_in_kernel is False and use_beta_sigmoid_in_kernel is False
             and chunk_indices is None and head_first is False and allow_neg_eigval is False
             and type(auto_cp) is bool and enable_fwd_cp_cache is True and force_intra_cp is False
             and type(output_final_state) is bool and type(use_qk_l2norm_in_kernel) is bool
             and (backend == "auto" or backend == "kernels"))
    if plain and cp_context is not None:
        if _cp_direct(q, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_size):
            return _run_cp(cp_context, q, k, v, g, beta, scale, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel, backend)
        plain = False
    if plain:
        signature = _signature(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state,
                               use_qk_l2norm_in_kernel, chunk_size, cu_seqlens_cpu, auto_cp)
        fast = _FAST.get(signature)
        if fast is not None and not torch.compiler.is_compiling():
            if cu_seqlens_cpu is not None:  # its values change from call to call: checked, and they pick the plan
                lengths = host_lengths(cu_seqlens_cpu, q.shape[1])
                return fast.for_lengths(lengths)(q, k, v, g, beta, initial_state, cu_seqlens, lengths=lengths)
            return fast(q, k, v, g, beta, initial_state, cu_seqlens)
    check_keywords(head_first=head_first, chunk_size=chunk_size, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                   dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                   chunk_indices=chunk_indices,
                   flags=dict(output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                              state_v_first=state_v_first, inplace_update=inplace_update, auto_cp=auto_cp,
                              enable_fwd_cp_cache=enable_fwd_cp_cache, force_intra_cp=force_intra_cp))
    problem = validate_inputs(q, k, v, g, beta, scale, None, cu_seqlens)
    if cu_seqlens_cpu is not None:
        check_cu_seqlens_cpu(cu_seqlens_cpu, cu_seqlens, problem.batch, problem.tokens)
    if initial_state_indices is not None and state_indices is not None:
        raise ValueError("pass the pool's slots once: initial_state_indices (SGLang's name) or state_indices "
                         "(FlashInfer's), not both")
    indices = initial_state_indices if initial_state_indices is not None else state_indices
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32  # g / state dtype the computation reads
    if use_gate_in_kernel:
        gates.check_head_vector("A_log", A_log, problem.num_v_heads, q.device)
        if dt_bias is not None:
            gates.check_head_vector("dt_bias", dt_bias, problem.num_v_heads, q.device)
    gate = gates.NO_GATE
    if (use_gate_in_kernel or use_beta_sigmoid_in_kernel) and _gates_in_kernels(q, backend, cp_context):
        gate = gates.kernel_gate(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    else:  # the reference, torch.compile's op and the multi-GPU path: the torch pass (flash_qla/gates.py)
        if use_gate_in_kernel:
            g = gates.gdn_gate(g, A_log, dt_bias)
        if use_beta_sigmoid_in_kernel:
            beta = gates.beta_from_logits(beta, allow_neg_eigval)
    g = g if g.dtype == ct else g.to(ct)
    beta = beta if beta.dtype in (ct, q.dtype) else beta.to(ct)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, g, beta, initial_state, gate.A_log,
                                                                   gate.dt_bias))
    plan = states.plan(problem, q.device, initial_state, indices, state_v_first, inplace_update, output_state,
                       output_final_state, needs_grad)
    if output is not None:
        _check_output_buffer(output, v, problem)
    if cp_context is None and (plan.v_first or plan.indices is not None or plan.write_to is not None):
        native = _native_state_call(problem, q, k, v, g, beta, initial_state, plan, output_final_state, needs_grad,
                                    cu_seqlens, cu_seqlens_cpu, use_qk_l2norm_in_kernel, backend, auto_cp, gate)
        if native is not None:
            return _with_output(native, output)
    h0 = states.initial_states(plan, initial_state, ct)
    if cp_context is not None:
        if indices is not None:
            raise ValueError("cp_context splits sequences across GPUs; the state pool (initial_state_indices / "
                             "state_indices) is not supported with it")
        o, final = _run_cp(cp_context, q, k, v, g, beta, problem.scale, h0, plan.need_final,
                           use_qk_l2norm_in_kernel, backend)
    else:
        o, final = _run(problem, q, k, v, g, beta, h0, plan.need_final, cu_seqlens, cu_seqlens_cpu,
                        use_qk_l2norm_in_kernel, chunk_size, auto_cp, backend, gate)
        if (plain and signature is not None and h0 is initial_state and not torch.compiler.is_compiling()
                and _fast_eligible(q, k, v, g, beta, h0, cu_seqlens, backend)):
            _remember(signature, _kernel_ops().Call(problem, q.device, q.dtype, h0 is not None,
                                                         output_final_state, use_qk_l2norm_in_kernel,
                                                         allow_cp=auto_cp))
    final = states.finish(plan, final, output_final_state)
    return _with_output((o, final), output)


def _gates_in_kernels(q, backend: str, cp_context) -> bool:
    """Whether the kernels apply FLA's gate / beta activations themselves (gates.KernelGate): the single-GPU kernel
    path outside torch.compile's trace; elsewhere gates.py's torch pass runs before the call."""
    return (cp_context is None and q.dtype in (torch.bfloat16, torch.float16)
            and select_backend(q.device, backend) == "kernels" and not torch.compiler.is_compiling())


def _with_output(result, output):
    o, final = result
    if output is not None:
        output.copy_(o.reshape(output.shape))
        o = output
    return o, final


def _native_state_call(problem: Problem, q, k, v, g, beta, initial_state, plan, output_final_state: bool,
                       needs_grad: bool, cu_seqlens, cu_seqlens_cpu, l2norm: bool, backend: str, auto_cp: bool,
                       gate=gates.NO_GATE):
    """(o, final) with the kernels reading and writing the caller's states as they are (V-first layout, pool slots,
    in-place or output_state writes: states.native_io), or None where torch's passes must do it (states.native_io's
    cases, intra-card CP plans, the reference backend, torch.compile, or autograd over a pool or a written state)."""
    if (q.dtype not in (torch.bfloat16, torch.float16) or select_backend(q.device, backend) != "kernels"
            or torch.compiler.is_compiling()):
        return None
    io = states.native_io(plan, initial_state, output_final_state, needs_grad)
    if io is None or (needs_grad and (io.index is not None or io.write is not None)):
        return None
    if g.dtype != torch.float32 or beta.dtype not in (torch.float32, q.dtype):
        return None
    ops = _kernel_ops()
    host_cu = _host_offsets(cu_seqlens, cu_seqlens_cpu)
    if not ops.native_state_io_for(problem, q.dtype, q.device, l2norm, host_cu, auto_cp):
        return None
    o, ht = ops.chunk_gated_delta_rule(problem, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, l2norm,
                                       cu_seqlens_cpu=host_cu, state_io=io, auto_cp=auto_cp,
                                       **kernel_extras(ops.chunk_gated_delta_rule, gate=gate if gate.mode else None))
    if plan.write_to is not None:
        return o, (plan.write_to if plan.return_written else None)
    return o, ht


_FAST: dict = {}  # plain call signature -> its kernel_api.Call (see _signature): the fast lane
_FAST_MAX = 1024


def _signature(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, l2norm,
               chunk_size, cu_seqlens_cpu=None, auto_cp: bool = True) -> Optional[tuple]:
    """What a plain call's checks and kernel-path decisions depend on: shapes, dtypes, devices, contiguity of every
    tensor, scale (with its type: 1 and 1.0 hash alike), the flags and the tuning generation. None when an argument
    is not what a signature can describe (the full path then names the problem)."""
    try:
        h, c = initial_state, cu_seqlens
        return (q.shape, k.shape, v.shape, g.shape, beta.shape, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
                q.device, k.device, v.device, g.device, beta.device,
                q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and g.is_contiguous()
                and beta.is_contiguous(),
                None if h is None else (h.shape, h.dtype, h.device, h.is_contiguous()),
                None if c is None else (c.shape, c.dtype, c.device),
                None if cu_seqlens_cpu is None else (cu_seqlens_cpu.shape, cu_seqlens_cpu.dtype,
                                                     cu_seqlens_cpu.device),
                scale, type(scale), output_final_state, l2norm, chunk_size, type(chunk_size), auto_cp,
                settings.generation)
    except (AttributeError, TypeError):
        return None


def _fast_eligible(q, k, v, g, beta, h0, cu_seqlens, backend: str) -> bool:
    """A call the fast lane can repeat exactly: the kernel path with inputs already in its layouts (contiguous, g
    and the initial state float32, cu_seqlens int32 on the device; beta is converted the same way each call)."""
    if backend == "reference" or q.device.type != "cuda" or g.dtype != torch.float32:
        return False
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and g.is_contiguous()
            and beta.is_contiguous()):
        return False
    if h0 is not None and (h0.dtype != torch.float32 or not h0.is_contiguous()):
        return False
    return cu_seqlens is None or (cu_seqlens.dtype == torch.int32 and cu_seqlens.device == q.device)


def remembered_call(q, k, v, g, beta, scale, initial_state, output_final_state: bool, l2norm: bool,
                    cu_seqlens=None, auto_cp: bool = True):
    """The fast lane's kernel_api.Call of a plain call (cu_seqlens on the device or None, no host copy) made before
    with these arguments' signature, or None: a caller that repeats one shape of call with the same offsets
    (flash_qla.distributed's main pass and head window) keeps it and calls it as Call(q, k, v, g, beta,
    initial_state, cu_seqlens), skipping the entry's per-call checks, as the fast lane does."""
    signature = _signature(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, l2norm, 64, None,
                           auto_cp)
    return _FAST.get(signature) if signature is not None else None


def _remember(signature: tuple, fast) -> None:
    if len(_FAST) >= _FAST_MAX:  # a serving workload's lengths vary: keep the table bounded
        _FAST.pop(next(iter(_FAST)))
    _FAST[signature] = fast


def _run(problem: Problem, q, k, v, g, beta, h0, need_final: bool, cu_seqlens, cu_seqlens_cpu, l2norm: bool,
         chunk_size: int, auto_cp: bool, backend: str, gate=gates.NO_GATE):
    """One call of the kernels (or the reference) on prepared inputs: (o, final [N, Hv, K, V] or None)."""
    if select_backend(q.device, backend) == "kernels":
        if torch.compiler.is_compiling():  # one opaque custom op for torch.compile (flash_qla.torch_ops)
            from . import torch_ops
            return torch_ops.chunk_gated_delta_rule(problem, q, k, v, g, beta, h0, need_final, cu_seqlens, l2norm)
        ops = _kernel_ops()
        extra = kernel_extras(ops.chunk_gated_delta_rule, cu_seqlens_cpu=_host_offsets(cu_seqlens, cu_seqlens_cpu),
                              auto_cp=None if auto_cp else False, gate=gate if gate.mode else None)
        return ops.chunk_gated_delta_rule(problem, q, k, v, g, beta, h0, need_final, cu_seqlens, l2norm, **extra)
    cu = cu_seqlens_cpu if cu_seqlens_cpu is not None else _host(cu_seqlens)
    return reference.chunked_gated_delta_rule(q, k, v, g, beta, problem.scale, h0, need_final, cu, l2norm,
                                              chunk_size=chunk_size)


_KERNEL_KEYWORDS: dict = {}  # kernel entry point -> the keyword names it takes (None: any, it has **kwargs)


def kernel_extras(fn, **candidates) -> dict:
    """The optional keywords (those not None) that the kernel entry point ``fn`` accepts, by its signature (read
    once per function). The others are left out: the kernels then plan without them (same results)."""
    if fn not in _KERNEL_KEYWORDS:
        params = inspect.signature(fn).parameters.values()
        _KERNEL_KEYWORDS[fn] = (None if any(p.kind is p.VAR_KEYWORD for p in params)
                                else frozenset(p.name for p in params))
    accepted = _KERNEL_KEYWORDS[fn]
    return {n: x for n, x in candidates.items() if x is not None and (accepted is None or n in accepted)}


def _cp_direct(q, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_size) -> bool:
    """A plain multi-GPU call whose inputs need none of this function's conversions (g, beta and the initial state
    already in the computation's dtype, no offsets of its own): it goes straight to the context, whose entry checks
    it (once per signature), so its host time before the main pass stays that of a plain call."""
    if not (isinstance(q, torch.Tensor) and isinstance(g, torch.Tensor) and isinstance(beta, torch.Tensor)):
        return False
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (cu_seqlens is None and cu_seqlens_cpu is None and chunk_size == 64 and type(chunk_size) is int
            and g.dtype == ct and beta.dtype in (ct, q.dtype)
            and (initial_state is None or (isinstance(initial_state, torch.Tensor) and initial_state.dtype == ct)))


def _run_cp(cp_context, q, k, v, g, beta, scale, h0, need_final: bool, l2norm: bool, backend: str):
    """Route a call with a cp_context to the multi-GPU path: flash_qla.distributed's CPContext runs it (so this
    module never imports that one), any other object is an error that names it."""
    run = getattr(cp_context, "run_chunk_gated_delta_rule", None)
    if run is None:
        kind = f"{type(cp_context).__module__}.{type(cp_context).__qualname__}"
        raise TypeError(f"cp_context must be a flash_qla.distributed.CPContext (made by flash_qla.build_cp_context), "
                        f"got a {kind}: contexts of FLA or FlashQLA describe their own kernels' partition and cannot "
                        f"drive these kernels")
    return run(q, k, v, g, beta, scale, h0, need_final, l2norm, backend)


def _check_output_buffer(output, v: torch.Tensor, problem: Problem) -> None:
    """output= must hold o exactly: [B, T, Hv, V] or packed [B*T, Hv, V], v's dtype and device."""
    B, T, Hv, V = problem.batch, problem.tokens, problem.num_v_heads, problem.head_dim_v
    shapes = ((B, T, Hv, V), (B * T, Hv, V))
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"output must be a torch.Tensor of shape [B, T, Hv, V] = {shapes[0]}, got "
                        f"{type(output).__name__}")
    if tuple(output.shape) not in shapes:
        raise ValueError(f"output must have shape [B, T, Hv, V] = {shapes[0]} or [B*T, Hv, V] = {shapes[1]}, got "
                         f"{tuple(output.shape)}")
    if output.dtype != v.dtype:
        raise TypeError(f"output must have v's dtype {v.dtype} (o's dtype), got {output.dtype}")
    if output.device != v.device:
        raise ValueError(f"output must be on the inputs' device {v.device}, got {output.device}")


def _host_offsets(cu_seqlens: Optional[torch.Tensor],
                  cu_seqlens_cpu: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The offsets' values where the host already has them (cu_seqlens_cpu, or a CPU cu_seqlens), else None: no copy
    from the device."""
    if cu_seqlens_cpu is not None:
        return cu_seqlens_cpu
    return cu_seqlens if cu_seqlens is not None and cu_seqlens.device.type == "cpu" else None


def _host(cu_seqlens: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if cu_seqlens is None else cu_seqlens.cpu()


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, backend="auto"):
    """Forward only, FlashQLA's low-level signature.

    Returns ``(g_cumsum, A, o, h, final_state)``: the chunk-local cumulative g (float32), the gate-free
    inverse A [B, T, Hv, 64] in k's dtype (what the backward consumes), o, ``h = None`` (chunk states are
    never materialised here) and the final state (or None).
    """
    problem = validate_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if select_backend(q.device, backend) == "kernels":
        return _kernel_ops().chunk_gated_delta_rule_fwd(problem, q, k, v, g, beta, initial_state,
                                                        output_final_state, cu_seqlens, use_qk_l2norm_in_kernel)
    cu = _host(cu_seqlens)
    with torch.no_grad():
        g_cumsum = reference.chunk_local_cumsum(g, cu)
        A = reference.gate_free_inverse(k, beta, cu, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                        num_v_heads=problem.num_v_heads)
        o, final = reference.chunked_gated_delta_rule(q, k, v, g, beta, problem.scale, initial_state,
                                                      output_final_state, cu, use_qk_l2norm_in_kernel)
    return g_cumsum, A, o, None, final


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, A, do, dht=None, scale=None, initial_state=None,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, backend="auto", cu_seqlens_cpu=None):
    """Backward only, FlashQLA's low-level signature.

    ``g`` is the chunk-local cumsum returned by :func:`chunk_gated_delta_rule_fwd` and ``A`` its gate-free
    inverse, which the kernels read instead of solving it again (None: solved; the reference recomputes it).
    ``cu_seqlens_cpu`` (optional): cu_seqlens' host copy, whose lengths then plan the backward's chains.
    Returns ``(dq, dk, dv, dbeta, dg, dh0)`` with dg taken with respect to the raw g and dh0 None when there is no
    initial state.
    """
    problem = validate_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if cu_seqlens_cpu is not None:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens_cpu is the host copy of cu_seqlens and needs cu_seqlens")
        check_cu_seqlens_cpu(cu_seqlens_cpu, cu_seqlens, problem.batch, problem.tokens)
    if tuple(do.shape) != tuple(v.shape):
        raise ValueError(f"do must have v's shape {tuple(v.shape)} [B, T, Hv, V], got {tuple(do.shape)}")
    expected_state = (problem.num_seqs, problem.num_v_heads, problem.head_dim_k, problem.head_dim_v)
    if dht is not None and tuple(dht.shape) != expected_state:
        raise ValueError(f"dht must have shape [N, Hv, K, V] = {expected_state}, got {tuple(dht.shape)}")
    if A is not None:
        _check_gate_free_inverse(A, q, problem)
    if select_backend(q.device, backend) == "kernels":
        entry = _kernel_ops().chunk_gated_delta_rule_bwd
        return entry(problem, q, k, v, g, beta, A, do, dht, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                     **kernel_extras(entry, cu_seqlens_cpu=cu_seqlens_cpu))
    return _reference_bwd(problem, q, k, v, g, beta, do, dht, initial_state,
                          cu_seqlens_cpu if cu_seqlens_cpu is not None else _host(cu_seqlens), use_qk_l2norm_in_kernel)


def _check_gate_free_inverse(A, q, problem) -> None:
    """A must be chunk_gated_delta_rule_fwd's gate-free inverse for these inputs: [B, T, Hv, 64] in q's dtype, on
    q's device (the kernels read it in place of solving it again)."""
    want = (problem.batch, problem.tokens, problem.num_v_heads, 64)
    if not isinstance(A, torch.Tensor):
        raise TypeError("A must be a tensor (chunk_gated_delta_rule_fwd's gate-free inverse) or None, got "
                        f"{type(A).__name__}")
    if tuple(A.shape) != want:
        raise ValueError(f"A must have shape [B, T, Hv, 64] = {want} (chunk_gated_delta_rule_fwd's gate-free "
                         f"inverse), got {tuple(A.shape)}")
    if A.dtype != q.dtype:
        raise ValueError(f"A must have q's dtype {q.dtype}, got {A.dtype}")
    if A.device != q.device:
        raise ValueError(f"A must be on q's device {q.device}, got {A.device}")


def _reference_bwd(problem: Problem, q, k, v, g_cumsum, beta, do, dht, initial_state, cu, l2norm):
    """Gradients by autograd through the reference (A is recomputed, not read)."""
    g_raw = reference.chunk_local_diff(g_cumsum, cu)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g_raw, beta)]
    h0 = initial_state.detach().requires_grad_(True) if initial_state is not None else None
    with torch.enable_grad():
        o, final = reference.chunked_gated_delta_rule(*leaves, problem.scale, h0, dht is not None, cu, l2norm)
        outputs, grads = [o], [do]
        if dht is not None:
            outputs.append(final)
            grads.append(dht.to(final.dtype))
        inputs = leaves + ([h0] if h0 is not None else [])
        got = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
    got = [torch.zeros_like(x) if d is None else d for x, d in zip(inputs, got)]
    dq, dk, dv, dg, db = got[:5]
    return dq, dk, dv, db, dg, (got[5] if h0 is not None else None)
