"""Plans: each kernel-path call's decisions made once per signature, then replayed with one C crossing.

The first call of a signature (shapes, dtypes, flags, device, tuning generation; see the callers' keys) runs the
forward or backward as written, with a Recorder active: every buffer it allocates (flash_qla.launch.empty), every
launch and every stream join is noted, and each pointer argument is traced back to the buffer it lies in (an input,
a returned output, or the workspace, whose buffers are laid out in one allocation). That sequence becomes a C
program (flash_qla._launcher.program_new). A later call with the same signature then validates, allocates its
outputs and one workspace, and issues the whole program in one ``program_run`` call: no planner, no per-launch
argument building, no Python per kernel.

A call whose recording cannot be replayed (a pointer the recorder cannot trace, inputs that overlap) keeps running
as written; ``stats()`` counts those, and the tests check that the standard paths replay.
"""
from __future__ import annotations

import collections
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .errors import CudaDriverError
from .tuning import settings

ALIGN = 256  # workspace buffers start where a fresh allocation would (TMA and vector loads assume it)
_local = threading.local()
_lock = threading.Lock()
_cache: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()
_stats = collections.Counter()
_reasons: Dict[str, int] = {}  # why recordings could not be replayed (a few, for diagnosis)


def recorder() -> Optional["Recorder"]:
    return getattr(_local, "recorder", None)


def stats() -> Dict[str, int]:
    """Counters: plans recorded, replayed, run as written because they could not be replayed, evicted; cached; and
    the reasons recordings could not be replayed."""
    return dict(_stats, cached=len(_cache), reasons=dict(_reasons))


def clear() -> None:
    with _lock:
        _cache.clear()
    _stats.clear()
    _reasons.clear()


class _Unreplayable(Exception):
    pass


@dataclass
class _Region:
    start: int
    nbytes: int
    slot: int
    offset: int  # of the region inside its slot's buffer


@dataclass(frozen=True)
class _View:
    """A result tensor as (slot, byte offset, shape, stride, dtype), rebuilt from the replay's buffers."""
    slot: int
    offset: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: torch.dtype
    whole: bool  # the slot's buffer itself
    address: bool = False  # returned as its device address (an int), not as a tensor


class Address:
    """A result that a replay returns as its device address alone (an int: no tensor view is built, ~10 us less of
    host time each), for a caller that only passes it on to a later launch; the recording's own call gets the
    tensor. The caller keeps the replay's buffers alive through a tensor result of the same call."""
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class Recorder:
    """Collects one call's allocations, launches and joins (see the module docstring)."""

    def __init__(self, inputs: Sequence[Optional[torch.Tensor]], main_stream: int):
        self.inputs = list(inputs)
        self.regions: List[_Region] = []
        self.outputs: List[Tuple[Tuple[int, ...], torch.dtype]] = []
        self._output_tensors: List[torch.Tensor] = []
        self.workspace = 0
        self.ops: List[tuple] = []
        self.names: List[str] = []
        self.streams: Dict[int, int] = {main_stream: 0}
        self.stream_names: List[Optional[str]] = [None]
        self.failure: Optional[str] = None
        for i, t in enumerate(self.inputs):
            if t is not None and t.numel() > 0:
                self._add(t.data_ptr(), _span(t), i, 0, f"input {i}")

    # -- what the kernel path reports ---------------------------------------------------------------------
    def allocation(self, t: torch.Tensor, output: Optional[str]) -> None:
        nbytes = _span(t)
        if output is not None:
            slot = len(self.inputs) + len(self.outputs)
            self.outputs.append((tuple(t.shape), t.dtype))
            self._output_tensors.append(t)
            if nbytes:
                self._add(t.data_ptr(), nbytes, slot, 0, output)
            return
        if nbytes:
            self._add(t.data_ptr(), nbytes, -1, self.workspace, "workspace")
            self.workspace += -(-nbytes // ALIGN) * ALIGN

    def side_stream(self, handle: int, name: str) -> None:
        if handle not in self.streams:
            self.streams[handle] = len(self.stream_names)
            self.stream_names.append(name)

    def join(self, waiting: int, on: int) -> None:
        try:
            self.ops.append(("join", self._stream(waiting), self._stream(on)))
            self.names.append("join")
        except _Unreplayable as e:
            self.failure = self.failure or str(e)

    def launch(self, kernel, function: int, grid: tuple, stream: int, args: tuple) -> None:
        if self.failure is not None:
            return
        try:
            templ = tuple(self._template(c, a) for c, a in zip(kernel.signature.decode(), args))
            self.ops.append(("launch", function, grid, kernel.block, kernel.smem, self._stream(stream),
                             kernel.signature, templ))
            self.names.append(kernel.key)
        except _Unreplayable as e:
            self.failure = f"{kernel.key}: {e}"

    # -- turning the recording into a plan ------------------------------------------------------------------
    def view(self, t) -> Optional[_View]:
        if isinstance(t, Address):
            v = self.view(t.tensor)
            return _View(v.slot, v.offset, v.shape, v.stride, v.dtype, v.whole, True)
        if t is None:
            return None
        for j, out in enumerate(self._output_tensors):
            if t is out:
                return _View(len(self.inputs) + j, 0, tuple(t.shape), tuple(t.stride()), t.dtype, True)
        if t.numel() == 0:
            return _View(-2, 0, tuple(t.shape), tuple(t.stride()), t.dtype, False)
        slot, offset = self._locate(t.data_ptr())
        return _View(slot, offset, tuple(t.shape), tuple(t.stride()), t.dtype, False)

    def plan(self, results: Sequence[Optional[torch.Tensor]], finish: Callable, device: torch.device) -> "Plan":
        if self.failure is not None:
            raise _Unreplayable(self.failure)
        if self.workspace > settings.plan_workspace_max:
            raise _Unreplayable(f"workspace of {self.workspace} bytes above tuning.plan_workspace_max "
                                f"({settings.plan_workspace_max})")
        views = tuple(self.view(t) for t in results)
        from .loader import native
        nslots = len(self.inputs) + len(self.outputs) + 1
        ops = [op if op[0] == "join" else op[:7] + (tuple(_slot_fix(a, nslots) for a in op[7]),) for op in self.ops]
        program = native().program_new(ops, nslots, len(self.stream_names))
        return Plan(program, tuple(self.names), len(self.inputs), tuple(self.outputs), self.workspace,
                    tuple(self.stream_names[1:]), views, finish, device)

    # -- helpers ----------------------------------------------------------------------------------------------
    def _add(self, start: int, nbytes: int, slot: int, offset: int, what: str) -> None:
        fresh = slot >= len(self.inputs) or slot == -1
        kept = []
        for r in self.regions:
            if start < r.start + r.nbytes and r.start < start + nbytes:
                if fresh and (r.slot >= len(self.inputs) or r.slot == -1):
                    # the allocator reused a buffer the call had already freed: launches recorded since then name
                    # the new one (the replay gives each its own space)
                    continue
                self.failure = self.failure or f"{what} overlaps another buffer of the call"  # e.g. an input twice
            kept.append(r)
        kept.append(_Region(start, nbytes, slot, offset))
        self.regions = kept

    def _locate(self, address: int) -> Tuple[int, int]:
        for r in self.regions:
            if r.start <= address < r.start + r.nbytes:
                return r.slot, r.offset + address - r.start
        raise _Unreplayable(f"address {address:#x} lies in no input, output or workspace buffer")

    def _template(self, kind: str, arg):
        if kind == "p":
            return arg if not arg else self._locate(arg)
        if kind == "m":
            address = arg[2]
            return arg if not address else arg[:2] + (self._locate(address),) + arg[3:]
        return arg

    def _stream(self, handle: int) -> int:
        if handle not in self.streams:
            raise _Unreplayable(f"stream {handle:#x} is neither the caller's nor a named side stream")
        return self.streams[handle]


def _span(t: torch.Tensor) -> int:
    """Bytes from t's first element to one past its last (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def _slot_fix(arg, nslots: int):
    """The workspace's slot is the last one: the recorder marks it -1 until the slot count is known."""
    if isinstance(arg, tuple) and len(arg) == 2 and arg[0] == -1:
        return (nslots - 1, arg[1])
    if isinstance(arg, tuple) and len(arg) == 11 and isinstance(arg[2], tuple) and arg[2][0] == -1:
        return arg[:2] + ((nslots - 1, arg[2][1]),) + arg[3:]
    return arg


@dataclass
class Plan:
    program: Any
    names: Tuple[str, ...]              # one per op: the kernel key, or "join"
    num_inputs: int
    outputs: Tuple[Tuple[Tuple[int, ...], torch.dtype], ...]
    workspace: int                      # bytes
    side_streams: Tuple[str, ...]       # the named side streams, in the program's stream order after the caller's
    results: Tuple[Optional[_View], ...]
    finish: Callable
    device: torch.device

    def bind(self, inputs: Sequence[Optional[torch.Tensor]], stream: int, side_stream: Callable):
        """A call's buffers and program arguments: (outputs, workspace, streams, pointers)."""
        dev = self.device
        if settings.poison_outputs:
            outs = [poisoned(shape, dtype, dev) for shape, dtype in self.outputs]
            ws = torch.full((self.workspace,), 255, device=dev, dtype=torch.uint8) if self.workspace else None
        else:
            outs = [torch.empty(shape, device=dev, dtype=dtype) for shape, dtype in self.outputs]
            ws = torch.empty(self.workspace, device=dev, dtype=torch.uint8) if self.workspace else None
        pointers = [0 if t is None else t.data_ptr() for t in inputs]
        pointers += [o.data_ptr() for o in outs]
        pointers.append(0 if ws is None else ws.data_ptr())
        if self.side_streams:
            streams = (stream,) + tuple(side_stream(dev, name).cuda_stream for name in self.side_streams)
        else:
            streams = (stream,)
        return outs, ws, streams, tuple(pointers)

    def replay(self, inputs: Sequence[Optional[torch.Tensor]], stream: int, side_stream: Callable):
        dev = self.device
        outs, ws, streams, pointers = self.bind(inputs, stream, side_stream)
        try:
            _native().program_run(self.program, streams, pointers)
        except CudaDriverError as e:  # name the kernel: the launcher knows only the op's index
            op = re.match(r"program op (\d+)", e.what)
            which = f"kernel {self.names[int(op.group(1))]}" if op else "a recorded plan"
            raise CudaDriverError(f"{which} on {dev}: {e.what}", e.code, e.name, e.description) from None
        return self.finish(*[self._result(v, inputs, outs, ws) for v in self.results])

    def _result(self, v: Optional[_View], inputs, outs, ws):
        if v is None:
            return None
        if v.whole:
            out = outs[v.slot - self.num_inputs]
            return out.data_ptr() if v.address else out
        if v.slot == -2:
            return 0 if v.address else torch.empty(v.shape, device=self.device, dtype=v.dtype)
        if v.slot == -1 or v.slot == self.num_inputs + len(self.outputs):
            base = ws
        elif v.slot < self.num_inputs:
            base = inputs[v.slot]
        else:
            base = outs[v.slot - self.num_inputs]
        if v.address:
            return base.data_ptr() + v.offset
        flat = base.view(-1).view(torch.uint8)[v.offset:] if base.dtype != torch.uint8 else base[v.offset:]
        return flat.view(v.dtype).as_strided(v.shape, v.stride)


def _native():
    from .loader import native
    return native()


def poisoned(shape, dtype, device) -> torch.Tensor:
    """A buffer filled so that an element no kernel writes shows: NaN, or for integer tables the most negative value
    (tuning.poison_outputs)."""
    poison = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, poison, device=device, dtype=dtype)


def call(key: tuple, inputs: Sequence[Optional[torch.Tensor]], device: torch.device, stream: int,
         record: Callable[[], Tuple[Sequence[Optional[torch.Tensor]], Callable]], side_stream: Callable):
    """Run the plan for ``key`` on ``inputs``, recording it first if there is none. ``side_stream(device, name)``
    gives the named side streams a replay runs on beside the caller's ``stream`` (flash_qla.launch.side_stream).

    ``record()`` runs the call as written and returns (results, finish): the tensors the call produced and the
    function that turns them into what the caller gets (``finish(*results)``); finish must hold no tensors of its
    own, since it runs again on every replay's buffers."""
    if not settings.replay:
        results, finish = record()
        return finish(*_tensors(results))
    with _lock:
        plan = _cache.get(key)
        if plan is not None:
            _cache.move_to_end(key)
    if plan is not None:
        if plan is _UNREPLAYABLE:
            _stats["as_written"] += 1
            results, finish = record()
            return finish(*_tensors(results))
        _stats["replayed"] += 1
        return plan.replay(inputs, stream, side_stream)
    rec = Recorder(inputs, stream)
    _local.recorder = rec
    try:
        results, finish = record()
    finally:
        _local.recorder = None
    try:
        entry = rec.plan(results, finish, device)
        _stats["recorded"] += 1
    except _Unreplayable as e:
        entry = _UNREPLAYABLE
        _stats["unreplayable"] += 1
        if len(_reasons) < 16:
            _reasons[str(e)[:200]] = _reasons.get(str(e)[:200], 0) + 1
    with _lock:
        _cache[key] = entry
        while len(_cache) > max(1, settings.plan_cache_size):
            _cache.popitem(last=False)
            _stats["evicted"] += 1
    return finish(*_tensors(results))


def _tensors(results):
    """A run as written hands its own tensors to finish, Address results included (they hold the buffers)."""
    return [r.tensor if isinstance(r, Address) else r for r in results]


_UNREPLAYABLE = object()
