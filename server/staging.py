"""Staging: a request's inputs go to the launch device while it is admitted, on its own request thread.

Host-to-device copies of pageable memory hold the copying thread until the bytes are read; done at admission they
run on many request threads at once and off the single launch thread, whose merge is then one concatenation per
tensor on the device. Waiting requests hold at most ``budget_bytes`` of staged inputs (the launch budget,
``--max-request-mb``); a request beyond it, or one the device has no memory for right now, stays on the host and
is copied when its launch is built. Either way the launch computes the same thing.
"""
from __future__ import annotations

import threading

import torch

from .prefill import PrefillRequest

_INPUTS = ("q", "k", "v", "g", "beta", "initial_state")


class DeviceStaging:
    def __init__(self, device: torch.device, budget_bytes: int):
        self.device = device
        self.budget_bytes = budget_bytes
        self.staged_bytes = 0
        self._lock = threading.Lock()

    def stage(self, request: PrefillRequest) -> bool:
        """Move the request's inputs to the device if the budget and the device allow; True when moved."""
        if self.device.type == "cpu":  # the reference backend computes where the request was decoded
            return False
        tensors = {name: getattr(request, name) for name in _INPUTS if getattr(request, name) is not None}
        nbytes = sum(t.nbytes for t in tensors.values())
        with self._lock:
            if self.staged_bytes + nbytes > self.budget_bytes:
                return False
            self.staged_bytes += nbytes
        try:
            # from pageable memory a copy returns once its source is read: the host tensors may go right after
            moved = {name: t.to(self.device, non_blocking=True) for name, t in tensors.items()}
        except torch.OutOfMemoryError:
            with self._lock:
                self.staged_bytes -= nbytes
            return False
        for name, t in moved.items():
            setattr(request, name, t)
        request.staged_bytes = nbytes
        return True

    def release(self, request: PrefillRequest) -> None:
        """The request is answered (or withdrawn): its staged bytes leave the budget."""
        if request.staged_bytes:
            with self._lock:
                self.staged_bytes -= request.staged_bytes
            request.staged_bytes = 0
