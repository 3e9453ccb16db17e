"""Argument checks for the public API: every message names the argument and what was expected."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNEL_INPUT_DTYPES = (torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Problem:
    """The sizes of one validated call (all run-time values for the kernels)."""
    batch: int
    tokens: int
    num_qk_heads: int
    num_v_heads: int
    head_dim_k: int
    head_dim_v: int
    num_seqs: int
    scale: float
    varlen: bool


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _require_tensor(name: str, x, ndim: int, dims: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {dims}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims {dims}, got shape {tuple(x.shape)}")


def _require_float(name: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor ({', '.join(map(_dtype_name, FLOAT_DTYPES))}), "
                        f"got {_dtype_name(x.dtype)}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, tokens: int) -> int:
    """Validate a packed-varlen offsets tensor; returns the number of sequences.

    Values are read on the host only when the tensor already lives there, so a CUDA ``cu_seqlens``
    costs no device synchronisation (its shape and dtype are still checked).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a 1-D int32/int64 torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in INDEX_DTYPES:
        raise TypeError(f"cu_seqlens must have dtype int32 or int64, got {_dtype_name(cu_seqlens.dtype)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"cu_seqlens requires packed inputs with batch size B == 1, got B = {batch}")
    if cu_seqlens.device.type == "cpu":
        cu = cu_seqlens.tolist()
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {cu[0]}")
        bad = next((i for i in range(1, len(cu)) if cu[i] < cu[i - 1]), None)
        if bad is not None:
            raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{bad}] = {cu[bad]} < "
                             f"cu_seqlens[{bad - 1}] = {cu[bad - 1]}")
        if cu[-1] != tokens:
            raise ValueError(f"cu_seqlens must end at the token count T = {tokens}, got cu_seqlens[-1] = {cu[-1]}")
    return cu_seqlens.numel() - 1


_VALIDATED: dict = {}  # call signature -> its Problem: a signature that passed once passes again


def validate_inputs(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None) -> Problem:
    """Check shapes, dtypes, devices and head counts; return the call's sizes.

    Everything checked is a function of the tensors' shapes, dtypes and devices, and of scale, except the values of a
    cu_seqlens on the CPU: a call whose signature passed before returns its Problem from a small cache (O(1), no
    device synchronisation); host cu_seqlens are checked every time."""
    try:
        key = (q.shape, k.shape, v.shape, g.shape, beta.shape, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
               q.device, k.device, v.device, g.device, beta.device, scale, type(scale),
               None if initial_state is None else (initial_state.shape, initial_state.dtype, initial_state.device),
               None if cu_seqlens is None else (cu_seqlens.shape, cu_seqlens.dtype, cu_seqlens.device))
        problem = _VALIDATED.get(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable scale: the checks below say what is wrong
        key, problem = None, None
    if problem is not None and (cu_seqlens is None or cu_seqlens.device.type != "cpu"):
        return problem
    problem = _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if key is not None:
        if len(_VALIDATED) >= 1024:
            _VALIDATED.clear()
        _VALIDATED[key] = problem
    return problem


def _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens) -> Problem:
    _require_tensor("q", q, 4, "[B, T, Hq, K]")
    _require_tensor("k", k, 4, "[B, T, Hq, K]")
    _require_tensor("v", v, 4, "[B, T, Hv, V]")
    _require_tensor("g", g, 3, "[B, T, Hv]")
    _require_tensor("beta", beta, 3, "[B, T, Hv]")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require_float(name, x)
    B, T, Hq, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)} [B, T, Hq, K], got {tuple(k.shape)}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must share q's batch and token dims (B, T) = {(B, T)}, got v shape {tuple(v.shape)}")
    if min(Hq, Hv, K, V) < 1:
        raise ValueError(f"head counts and head dims must be positive, got Hq={Hq}, Hv={Hv}, K={K}, V={V}")
    if Hv % Hq != 0:
        raise ValueError(f"the number of v heads Hv = {Hv} (v.shape[2]) must be a multiple of the number of "
                         f"q/k heads Hq = {Hq} (q.shape[2])")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, T, Hv):
            raise ValueError(f"{name} must have shape [B, T, Hv] = {(B, T, Hv)}, got {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {_dtype_name(q.dtype)}, k {_dtype_name(k.dtype)}, "
                        f"v {_dtype_name(v.dtype)}")
    devices = {x.device for x in (q, k, v, g, beta)}
    if initial_state is not None and isinstance(initial_state, torch.Tensor):
        devices.add(initial_state.device)
    if len(devices) != 1:
        raise ValueError(f"q, k, v, g, beta and initial_state must be on one device, got {sorted(map(str, devices))}")

    if scale is None:
        scale = K ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float (default K**-0.5), got {scale!r}")

    if cu_seqlens is not None:
        N = check_cu_seqlens(cu_seqlens, B, T)
        if cu_seqlens.device.type != "cpu" and cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens must be on the CPU or on q's device {q.device}, got {cu_seqlens.device}")
    else:
        N = B

    if initial_state is not None:
        _require_tensor("initial_state", initial_state, 4, "[N, Hv, K, V]")
        _require_float("initial_state", initial_state)
        if tuple(initial_state.shape) != (N, Hv, K, V):
            raise ValueError(f"initial_state must have shape [N, Hv, K, V] = {(N, Hv, K, V)} "
                             f"(N = {'len(cu_seqlens) - 1' if cu_seqlens is not None else 'B'}), "
                             f"got {tuple(initial_state.shape)}")
    return Problem(B, T, Hq, Hv, K, V, N, float(scale), cu_seqlens is not None)


def validate_kernel_inputs(problem: Problem, q, g, beta, initial_state, supported_head_dims) -> None:
    """Extra rules of the compiled kernels (sm_90a path): dtypes and the head dims that were built."""
    if q.dtype not in KERNEL_INPUT_DTYPES:
        raise TypeError(f"the sm_90a kernels take q/k/v in bfloat16 or float16, got {_dtype_name(q.dtype)} "
                        f"(use backend='reference' for float32/float64)")
    if g.dtype != torch.float32:
        raise TypeError(f"g must be float32 for the sm_90a kernels, got {_dtype_name(g.dtype)}")
    if beta.dtype not in (torch.float32, q.dtype):
        raise TypeError(f"beta must be float32 or q's dtype {_dtype_name(q.dtype)}, got {_dtype_name(beta.dtype)}")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise TypeError(f"initial_state must be float32 for the sm_90a kernels, got {_dtype_name(initial_state.dtype)}")
    dims = (problem.head_dim_k, problem.head_dim_v)
    if dims not in supported_head_dims:
        listed = ", ".join(f"(K={a}, V={b})" for a, b in sorted(supported_head_dims))
        raise ValueError(f"head dims (K={dims[0]}, V={dims[1]}) are not built for sm_90a; supported: {listed}")


CHUNK_SIZES = (16, 32, 64)  # FLA's accepted chunk sizes; the kernels always run 64 and results do not depend on it


def require_bool(name: str, x) -> None:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}")


def check_keywords(*, head_first, chunk_size, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                   allow_neg_eigval, cu_seqlens, cu_seqlens_cpu, chunk_indices, flags: dict) -> None:
    """The FLA / FlashQLA keywords beyond the tensors: types, the combinations they allow, clear errors otherwise
    (checked before the tensors, so head_first=True is named before its shapes mislead). flags: every remaining
    bool keyword by name. The common call (every keyword at its default) returns after one pass of comparisons."""
    if (head_first is False and type(chunk_size) is int and chunk_size == 64 and use_gate_in_kernel is False
            and A_log is None and dt_bias is None and use_beta_sigmoid_in_kernel is False and allow_neg_eigval is False
            and chunk_indices is None and cu_seqlens_cpu is None and all(type(x) is bool for x in flags.values())):
        return
    for name, value in dict(flags, head_first=head_first, use_gate_in_kernel=use_gate_in_kernel,
                            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                            allow_neg_eigval=allow_neg_eigval).items():
        require_bool(name, value)
    if head_first:
        raise ValueError("head_first=True ([B, H, T, ...] inputs) is not supported, as in FLA and FlashQLA: pass "
                         "[B, T, H, ...] tensors (x.transpose(1, 2)) with head_first=False")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES} (FLA's sizes), got {chunk_size!r}; the results do "
                         f"not depend on it: the kernels always use chunks of 64")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True scales sigmoid(beta) to [0, 2) and so requires "
                         "use_beta_sigmoid_in_kernel=True (as in FLA)")
    if use_gate_in_kernel and A_log is None:
        raise ValueError("use_gate_in_kernel=True computes g = -exp(A_log) * softplus(g + dt_bias) and requires A_log "
                         "[Hv]")
    if not use_gate_in_kernel and (A_log is not None or dt_bias is not None):
        given = " and ".join(n for n, x in (("A_log", A_log), ("dt_bias", dt_bias)) if x is not None)
        raise ValueError(f"{given} given with use_gate_in_kernel=False: they are read only when g is the raw gate "
                         f"(use_gate_in_kernel=True); pass that, or compute g yourself and leave them out")
    if chunk_indices is not None:
        if cu_seqlens is None:
            raise ValueError("chunk_indices describes the chunks of a packed varlen batch and needs cu_seqlens")
        if not isinstance(chunk_indices, torch.Tensor) or chunk_indices.dtype not in INDEX_DTYPES \
                or chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2:
            shown = (f"{_dtype_name(chunk_indices.dtype)} {tuple(chunk_indices.shape)}"
                     if isinstance(chunk_indices, torch.Tensor) else type(chunk_indices).__name__)
            raise ValueError(f"chunk_indices must be an int32/int64 tensor [num_chunks, 2] (FLA's (sequence, chunk) "
                             f"pairs), got {shown}")
    if cu_seqlens_cpu is not None and cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu is the host copy of cu_seqlens and needs cu_seqlens")


class HostLengths(NamedTuple):
    """What the forward's plan takes from lengths known on the host."""
    longest: int      # the longest sequence's tokens
    unordered: bool   # not longest first: a longer sequence follows a shorter one


def host_lengths(cu_seqlens_cpu: torch.Tensor, tokens: int) -> Optional[HostLengths]:
    """The longest sequence of a host cu_seqlens whose shape and dtype passed before (the API's fast lane), and
    whether the lengths are out of longest-first order, after checking its values as check_cu_seqlens does; None for
    a single sequence (its length is the token count)."""
    cu = cu_seqlens_cpu.tolist()
    if cu[0] != 0 or cu[-1] != tokens or any(b < a for a, b in zip(cu, cu[1:])):
        check_cu_seqlens(cu_seqlens_cpu, 1, tokens)  # names the problem
    if len(cu) <= 2:
        return None
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    return HostLengths(max(lengths), any(a < b for a, b in zip(lengths, lengths[1:])))


def check_cu_seqlens_cpu(cu_seqlens_cpu, cu_seqlens: torch.Tensor, batch: int, tokens: int) -> None:
    """The host copy of cu_seqlens: a CPU tensor of cu_seqlens' shape whose values are valid offsets (read for free
    on the host), equal to cu_seqlens' values where those are on the host too (never a device sync)."""
    if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu":
        where = cu_seqlens_cpu.device if isinstance(cu_seqlens_cpu, torch.Tensor) else type(cu_seqlens_cpu).__name__
        raise ValueError(f"cu_seqlens_cpu must be a CPU tensor (the host copy of cu_seqlens), got {where}")
    if cu_seqlens_cpu.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens_cpu must have cu_seqlens' shape {tuple(cu_seqlens.shape)}, got "
                         f"{tuple(cu_seqlens_cpu.shape)}")
    check_cu_seqlens(cu_seqlens_cpu, batch, tokens)
    if cu_seqlens.device.type == "cpu" and not torch.equal(cu_seqlens_cpu.long(), cu_seqlens.long()):
        raise ValueError("cu_seqlens_cpu must hold the values of cu_seqlens")
