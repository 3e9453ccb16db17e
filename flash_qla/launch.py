"""Launch primitives of the kernel path: kernel handles, allocation, streams.

Everything the forward and backward issue goes through ``empty``, ``launch`` and ``join``, so that a plan's first
call can record it (flash_qla/plans.py) and later calls replay it with one crossing into the C launcher.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import loader, plans
from .tuning import settings

CHUNK = 64
RECOMPUTE_KERNEL = "gdn_bwd_recompute"  # the backward's recompute chain (stores each chunk's state, W and Vnew)
CHAIN_KERNEL = "gdn_fwd_chain"           # the forward chain: the output pass and the CP pre-pass (state / trans)
FUSED_KERNEL = "gdn_fwd_fused"           # the whole forward in one kernel (no CP, no saved intermediates)
PICK_KERNEL = "gdn_state_pick"           # intra-card CP: each sequence's state from its segments'
L2NORM_KERNEL = "gdn_l2norm"             # use_qk_l2norm_in_kernel as a pass ahead of the plain kernels
DTYPE_TAG = {torch.bfloat16: "bf16", torch.float16: "fp16"}

_CACHE: dict = {}  # manifest-derived look-ups, built once per process (the manifest never changes at run time)
_SMS: dict = {}


def supported_head_dims() -> set:
    if "dims" not in _CACHE:
        _CACHE["dims"] = {(v["K"], v["V"]) for v in loader.library().variants(RECOMPUTE_KERNEL)}
    return _CACHE["dims"]


def num_sms(device: torch.device) -> int:
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


def built_blocks(kernel: str, mode: Optional[str], tag: str, K: int, V: int, l2norm: Optional[int] = None) -> list:
    """The V blocks built for a kernel's variant (l2norm: only the builds with that flag, gdn_fwd_fused's axis)."""
    key = ("bv", kernel, mode, tag, K, V, l2norm)
    if key not in _CACHE:
        blocks = [v["BV"] for v in loader.library().variants(kernel)
                  if (v["dtype"], v["K"], v["V"]) == key[3:6] and v.get("mode") == mode
                  and (l2norm is None or v.get("l2norm") == l2norm)]
        _CACHE[key] = list(dict.fromkeys(blocks))  # once each (gdn_fwd_fused's order axis repeats them)
    return _CACHE[key]


def current_stream(device: torch.device) -> int:
    """The caller's current CUDA stream as a raw handle (torch.cuda.current_stream builds a Python object)."""
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else
                                              torch.cuda.current_device())


def empty(*shape, device, dtype, output: Optional[str] = None) -> torch.Tensor:
    """A buffer the kernels fill. ``output`` names a tensor the call returns; the rest is workspace, which a
    replayed plan takes from one allocation."""
    if settings.poison_outputs:
        t = plans.poisoned(shape, dtype, device)
    else:
        t = torch.empty(*shape, device=device, dtype=dtype)
    rec = plans.recorder()
    if rec is not None:
        rec.allocation(t, output)
    return t


def launch(name: str, variant: dict, device: torch.device, sizes: dict, pointers: dict, stream=None) -> None:
    key = (name, tuple(variant.items()))
    kernel = _CACHE.get(key)
    if kernel is None:  # resolved once: the manifest look-up costs microseconds per launch otherwise
        kernel = _CACHE[key] = loader.library().kernel(name, **variant)
    if stream is None:
        stream = current_stream(device)
    grid, args = kernel.launch(device.index, stream, sizes, pointers)
    rec = plans.recorder()
    if rec is not None:
        rec.launch(kernel, kernel.load(device.index), grid, stream, args)


_SIDE_STREAMS: dict = {}  # device index -> {name: [streams]}


# side streams above the default priority (torch's -1 is above its default 0): where two kernels become ready at once,
# the device hands out the higher-priority one's CTAs first. The backward's save chain: which of it and the dh chain
# went first varied from process to process in eager calls, and with the dh chain's CTAs first there was no room for
# its own beside them on some rows (H200, hk4_hv8 32k_8seq: 0.81 ms a backward against 0.73 where it went first, as
# CUDA-graph replay's order has it)
SIDE_PRIORITY = {"save_chain": -1}


def side_stream(device: torch.device, name: str = "side") -> torch.cuda.Stream:
    """A stream for work beside the caller's, distinct from the caller's current stream and from every other named
    side stream. torch.cuda.Stream() hands out its 32-stream pool round-robin, so a cached side stream can be the
    very stream a later caller runs on (a CUDA-graph capture stream, say): the "parallel" branches then ran in
    order. Created at the name's SIDE_PRIORITY."""
    current = current_stream(device)
    named = _SIDE_STREAMS.setdefault(device.index, {})
    chosen = None
    for stream in named.get(name, ()):
        if stream.cuda_stream != current:
            chosen = stream
            break
    if chosen is None:
        taken = {s.cuda_stream for streams in named.values() for s in streams} | {current}
        for _ in range(64):  # the pool wraps after 32: one of them is free
            stream = torch.cuda.Stream(device, priority=SIDE_PRIORITY.get(name, 0))
            if stream.cuda_stream not in taken:
                named.setdefault(name, []).append(stream)
                chosen = stream
                break
        else:
            raise RuntimeError(f"no CUDA stream distinct from {len(taken)} in use for side stream {name!r}")
    rec = plans.recorder()
    if rec is not None:
        rec.side_stream(chosen.cuda_stream, name)
    return chosen


def join(waiting: torch.cuda.Stream, on: torch.cuda.Stream) -> None:
    """``waiting`` waits for the work queued so far on ``on`` (fork / join by events: a CUDA graph captures the two
    as parallel branches)."""
    waiting.wait_stream(on)
    rec = plans.recorder()
    if rec is not None:
        rec.join(waiting.cuda_stream, on.cuda_stream)


def address(x) -> int:
    """The device address of a tensor, or an address already (plans.Address results of a replay)."""
    return x if isinstance(x, int) else x.data_ptr()


def packed(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> contiguous [B*T, ...] (a view when already contiguous)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def dense(x: torch.Tensor) -> torch.Tensor:
    """x in its own layout, contiguous: the same memory as the packed [B*T, ...] view (pointer use only)."""
    return x if x.is_contiguous() else x.contiguous()
