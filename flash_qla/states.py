"""Recurrent-state input and output around the kernel call: the state layout, the state pool and output buffers.

The kernels read an initial state ``[N, Hv, K, V]`` float32 and write a final state of the same shape. Callers
keep states in other forms, and this module turns one into the other with device-side torch ops only (no host
synchronisation, no boolean indexing, so a call stays capturable in a CUDA graph):

* layout: ``state_v_first=True`` keeps every state as ``[..., V, K]`` (FLA's and FlashInfer's V-first layout);
* dtype: float16 / bfloat16 (or float64 on the reference path) states are read into the compute dtype and written
  back in their own dtype;
* the pool: ``initial_state`` ``[S, Hv, K, V]`` (``[S, Hv, V, K]`` V-first) indexed by ``indices`` int32 ``[N]``:
  sequence n starts from ``pool[indices[n]]``, or from zeros when ``indices[n] < 0`` (padding). The final states are
  written back into their slots with ``inplace_update=True`` (SGLang's spelling) or into ``output_state`` (FlashInfer's,
  ``output_state is initial_state`` for in place); padding entries write nothing.

In the kernels: a plain forward (every path but intra-card CP) reads and writes the caller's states as they are:
the V-first layout, pool rows through the index table (negative: zero state, nothing written), the final states
into the pool or output_state in place (:class:`StateIO`, flash_qla/forward.py native_state_io), and the backward
reads h0 / dht and writes dh0 V-first. Where the kernels cannot (an intra-card CP plan, half-precision or
non-contiguous states, autograd through a pool), :func:`initial_states` and :func:`finish` do it here with torch:
the V-first transposes, the pool gather (index_select) and the slot write-back (index_copy_).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .validation import Problem

# the kernels' state_mode bits (aot/kernels/state_io.py; a CPU test compares the two)
V_FIRST = 1        # the caller's states are [.., Hv, V, K]
READ_INDEXED = 2   # sequence n's initial state is row index[n] of a pool (negative: zero state)
WRITE_INDEXED = 4  # sequence n's final state goes to row index[n] (negative: nothing is written)


@dataclass(frozen=True)
class StateIO:
    """What a plain forward's kernels do with the caller's states (flash_qla/forward.py): read the initial state in
    the caller's layout (V-first or not) from its rows, or from pool rows ``index[n]`` (``pool_read``); store the
    final states into ``write`` (rows ``index[n]`` of a pool with ``index``, else [N, ...]) or, without it, into a
    new [N, ...] tensor in the caller's layout. ``index``: int32 [N] on the device, negative entries pad."""
    v_first: bool = False
    index: Optional[torch.Tensor] = None
    pool_read: bool = False
    write: Optional[torch.Tensor] = None

    @property
    def mode(self) -> int:
        """The kernels' state_mode."""
        indexed = self.index is not None
        return ((V_FIRST if self.v_first else 0) | (READ_INDEXED if indexed and self.pool_read else 0)
                | (WRITE_INDEXED if indexed and self.write is not None else 0))

    def index_ptr(self, stand_in: torch.Tensor) -> int:
        """The index table's address, or stand_in's (the kernels read the table only under an indexed mode)."""
        return (self.index if self.index is not None else stand_in).data_ptr()


PLAIN_IO = StateIO()

def _layout(v_first: bool, first: str) -> str:
    return f"[{first}, Hv, V, K]" if v_first else f"[{first}, Hv, K, V]"


def _check_state_like(name: str, x, problem: Problem, v_first: bool, rows: Optional[int], device) -> None:
    """A 4-D floating state tensor in the call's layout on the inputs' device: [rows, Hv, ., .], or a pool of any
    number of slots (rows None). The messages are built only on failure: this runs on every call."""
    K, V, Hv = problem.head_dim_k, problem.head_dim_v, problem.num_v_heads
    inner = (V, K) if v_first else (K, V)
    if isinstance(x, torch.Tensor) and x.dtype.is_floating_point and x.dim() == 4 and x.device == device:
        shape = tuple(x.shape)
        if (shape == (rows, Hv, *inner)) if rows is not None else (shape[1:] == (Hv, *inner) and shape[0] >= 1):
            return
    letters = _layout(v_first, "N" if rows is not None else "S")
    layout = " (state_v_first=True)" if v_first else ""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {letters}, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {str(x.dtype).replace('torch.', '')}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have 4 dims {letters}{layout}, got shape {tuple(x.shape)}")
    if rows is None:
        if tuple(x.shape[1:]) != (Hv, *inner) or x.shape[0] < 1:
            raise ValueError(f"{name} must have shape {letters} = (S, {Hv}, {inner[0]}, {inner[1]}) with S >= 1 "
                             f"slots{layout}, got {tuple(x.shape)}")
    elif tuple(x.shape) != (rows, Hv, *inner):
        n_is = "len(cu_seqlens) - 1" if problem.varlen else "B"
        raise ValueError(f"{name} must have shape {letters} = {(rows, Hv, *inner)} (N = {n_is}){layout}, "
                         f"got {tuple(x.shape)}")
    raise ValueError(f"{name} must be on the inputs' device {device}, got {x.device}")


def check_indices(indices, problem: Problem, pool_slots: int, device, name: str = "initial_state_indices") -> None:
    """int32/int64 [N] on the inputs' device. Values are read only when they live on the CPU (no device sync):
    each must be < S, negative means padding, and no slot may be named twice."""
    N = problem.num_seqs
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor of N = {N} pool slots, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 (or int64), got {str(indices.dtype).replace('torch.', '')}")
    if indices.dim() != 1 or indices.numel() != N:
        raise ValueError(f"{name} must be 1-D with one slot per sequence (N = {N}), got shape {tuple(indices.shape)}")
    if indices.device != device:
        raise ValueError(f"{name} must be on the inputs' device {device}, got {indices.device}")
    if indices.device.type == "cpu":
        vals = indices.tolist()
        big = [i for i in vals if i >= pool_slots]
        if big:
            raise ValueError(f"{name} names slot {big[0]} of a pool of S = {pool_slots} slots "
                             f"(valid: 0..{pool_slots - 1}, or -1 for padding)")
        live = [i for i in vals if i >= 0]
        if len(set(live)) != len(live):
            dup = next(i for i in live if live.count(i) > 1)
            raise ValueError(f"{name} names slot {dup} for more than one sequence; each slot holds one "
                             f"sequence's state")


class StatePlan(NamedTuple):
    """How the states of one call are read and written (built by :func:`plan`)."""
    v_first: bool
    pool: Optional[torch.Tensor]        # initial_state as a pool (with indices)
    indices: Optional[torch.Tensor]     # [N] slots, negative = padding
    write_to: Optional[torch.Tensor]    # where final states go by slot (pool) or row (dense): inplace / output_state
    return_written: bool                # the call returns write_to (output_state) as its final state
    need_final: bool                    # the kernel must produce the final states
    copy_h0: bool                       # the initial state is overwritten in place but autograd reads it: copy it


def plan(problem: Problem, device: torch.device, initial_state, indices, state_v_first: bool, inplace_update: bool,
         output_state, output_final_state: bool, needs_grad: bool = False) -> StatePlan:
    """Check every state argument against the call's sizes and layout; say what the call reads and writes.
    needs_grad: autograd records this call (the backward then reads the initial state it was given)."""
    if indices is not None:
        if initial_state is None:
            raise ValueError("initial_state_indices (state_indices) needs initial_state: the pool [S, Hv, K, V] "
                             "([S, Hv, V, K] with state_v_first) it indexes")
        _check_state_like("initial_state (the state pool)", initial_state, problem, state_v_first, None, device)
        check_indices(indices, problem, initial_state.shape[0], device)
    elif initial_state is not None:
        _check_state_like("initial_state", initial_state, problem, state_v_first, problem.num_seqs, device)
    if inplace_update and output_state is not None:
        raise ValueError("pass inplace_update=True (write into initial_state) or output_state (write there), not both")
    write_to = None
    if inplace_update:
        if initial_state is None:
            raise ValueError("inplace_update=True writes the final states into initial_state, which is None")
        write_to = initial_state
    elif output_state is not None:
        if not output_final_state:
            raise ValueError("output_state receives the final states, which only output_final_state=True produces "
                             "(FlashInfer's rule); pass output_final_state=True")
        rows = None if indices is not None else problem.num_seqs
        _check_state_like("output_state", output_state, problem, state_v_first, rows, device)
        write_to = output_state
    if write_to is not None and write_to.requires_grad and torch.is_grad_enabled():
        raise ValueError("the final states are written in place into a tensor that requires grad; in-place state "
                         "writes are for inference (pass a detached pool, or run under torch.no_grad())")
    copy_h0 = needs_grad and indices is None and write_to is not None and write_to is initial_state
    return StatePlan(state_v_first, initial_state if indices is not None else None, indices, write_to,
                     output_state is not None, output_final_state or write_to is not None, copy_h0)


def native_io(p: StatePlan, initial_state: Optional[torch.Tensor], output_final_state: bool,
              needs_grad: bool) -> Optional[StateIO]:
    """The StateIO with which the kernels do this call's state reads and writes themselves (flash_qla/forward.py,
    where native_state_io allows), or None where :func:`initial_states` / :func:`finish` must: a state tensor that is
    not float32 and contiguous, a pool under autograd (the backward reads the gathered initial states), an initial
    state both read by autograd and overwritten (copy_h0), or final states wanted both in a pool and as a dense
    result. int64 indices are taken as an int32 copy (a tiny device op, no sync)."""
    def plain(t: Optional[torch.Tensor]) -> bool:
        return t is None or (t.dtype == torch.float32 and t.is_contiguous())
    if not (plain(initial_state) and plain(p.write_to)) or p.copy_h0:
        return None
    if p.indices is not None and needs_grad:
        return None
    if p.write_to is not None and output_final_state and not p.return_written:
        return None
    index = p.indices
    if index is not None and index.dtype != torch.int32:
        index = index.to(torch.int32)
    if index is not None and not index.is_contiguous():
        index = index.contiguous()
    return StateIO(v_first=p.v_first, index=index, pool_read=p.pool is not None, write=p.write_to)


def _swap(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def initial_states(p: StatePlan, initial_state: Optional[torch.Tensor],
                   dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
    """The kernels' initial state: [N, Hv, K, V] in ``dtype`` (float32; float64 on the reference's float64 path),
    or None. Differentiable."""
    if initial_state is None:
        return None
    if p.indices is None:
        h0 = initial_state.clone() if p.copy_h0 else initial_state
    else:  # gather the slots; padding (negative) entries read slot 0 and are zeroed
        valid = (p.indices >= 0).view(-1, 1, 1, 1)
        rows = p.pool.index_select(0, p.indices.clamp_min(0).long())
        h0 = torch.where(valid, rows, rows.new_zeros(()))
    h0 = h0 if h0.dtype == dtype else h0.to(dtype)
    return _swap(h0) if p.v_first else h0


def _write_rows(target: torch.Tensor, indices: Optional[torch.Tensor], rows: torch.Tensor) -> None:
    """target[indices[n]] = rows[n] for every indices[n] >= 0 (target[n] = rows[n] without indices).

    No host sync and no data-dependent shapes: every entry writes the row its slot must end with, so entries that
    share a slot (padding entries are sent to slot 0) write identical bytes. The sequence owning slot s is the
    largest n with indices[n] == s (scatter_reduce amax), or none; an unowned slot gets its own old row back."""
    with torch.no_grad():
        rows = rows.to(target.dtype)
        if indices is None:
            target.copy_(rows)
            return
        n = indices.numel()
        slot = indices.clamp_min(0).long()
        seq = torch.arange(n, device=indices.device, dtype=torch.long)
        owner = torch.full((target.shape[0],), -1, device=indices.device, dtype=torch.long)
        owner.scatter_reduce_(0, slot, torch.where(indices >= 0, seq, -1), reduce="amax", include_self=True)
        winner = owner.index_select(0, slot)
        new = rows.index_select(0, winner.clamp_min(0))
        keep = target.index_select(0, slot)
        target.index_copy_(0, slot, torch.where((winner >= 0).view(-1, 1, 1, 1), new, keep))


def finish(p: StatePlan, final: Optional[torch.Tensor], output_final_state: bool) -> Optional[torch.Tensor]:
    """Write the kernels' final states ([N, Hv, K, V]) where the plan says; return the call's final-state result:
    output_state when given, else the final states in the caller's layout (contiguous) when asked for, else None."""
    if not p.need_final:
        return None
    out = _swap(final).contiguous() if p.v_first else final
    if p.write_to is not None:
        _write_rows(p.write_to, p.indices, out)
        if p.return_written:
            return p.write_to
    return out if output_final_state else None


__all__ = ["StatePlan", "StateIO", "PLAIN_IO", "plan", "check_indices", "native_io", "initial_states", "finish"]
