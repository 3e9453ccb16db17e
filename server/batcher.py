"""Dynamic batching: concurrent requests with one batch key become one varlen launch.

The oldest waiting request decides the next launch: it waits at most ``max_wait_s`` for company with its key,
or less once the waiting tokens of that key fill ``max_batch_tokens``. Then every waiting request with that key
that fits the budgets (tokens, and the requests' estimated memory) goes, in arrival order, to one launch.

Launches run on one thread of the batcher's own, which also applies this policy: it takes the next batch the
moment a launch ends, without a round trip through the event loop (which, under load, is busy moving bodies and
would leave the device idle meanwhile). Requests are queued from any thread (:meth:`DynamicBatcher.enqueue`:
the request threads queue them as soon as they are admitted) and answered through ``concurrent.futures``
futures; one launch at a time (the device runs one anyway, and requests that arrive meanwhile form the next,
larger batch).

Requests on one session are applied in arrival order: a launch never takes a request whose session is also named
by an earlier request that it does not take (another key, over budget, or the same session twice); that request
goes to a later launch. The launch function returns one result per request, or an exception for a request that
failed alone (e.g. its session was deleted meanwhile).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Union

from .errors import NotReady, QueueFull
from .metrics import ServiceMetrics
from .prefill import PrefillRequest, PrefillResult

log = logging.getLogger("server.batcher")

LaunchFn = Callable[[List[PrefillRequest]], List[Union[PrefillResult, BaseException]]]


@dataclass(eq=False)  # compared by identity: the fields hold tensors
class _Waiting:
    request: PrefillRequest
    future: Future
    enqueued_at: float = field(default_factory=time.perf_counter)


class DynamicBatcher:
    def __init__(self, launch: LaunchFn, metrics: ServiceMetrics, *, max_batch_tokens: int, max_wait_s: float,
                 max_queue: int, max_batch_bytes: Optional[int] = None):
        self._launch = launch
        self._metrics = metrics
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.max_batch_bytes = max_batch_bytes
        self._waiting: List[_Waiting] = []
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self.launches = 0  # merged launches so far (also exported as a metric)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="flash-qla-launch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Finish the launch in progress (its results are delivered), then cancel every waiting request."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        with self._cond:
            waiting, self._waiting = self._waiting, []
            self._metrics.queue_depth.set(0)
        for item in waiting:
            item.future.cancel()

    def enqueue(self, request: PrefillRequest) -> Future:
        """Queue a request (from any thread); its future gets its own slice of a launch. Raises QueueFull when the
        queue is full. Cancelling the future withdraws the request if it has not been launched yet."""
        with self._cond:
            if self._stopping:
                raise NotReady("the service is shutting down", reason="shutting_down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (--max-queue {self.max_queue}); "
                                f"retry later")
            item = _Waiting(request, Future())
            self._waiting.append(item)
            self._metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()
        item.future.add_done_callback(lambda future: self._withdraw(item) if future.cancelled() else None)
        return item.future

    async def submit(self, request: PrefillRequest) -> PrefillResult:
        """:meth:`enqueue` and wait; cancelling the caller (a timeout) withdraws a request not yet launched."""
        return await asyncio.wrap_future(self.enqueue(request))

    def _withdraw(self, item: _Waiting) -> None:
        with self._cond:
            if item in self._waiting:
                self._waiting.remove(item)
                self._metrics.queue_depth.set(len(self._waiting))

    # -- the launch thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                batch = self._next_batch()
                if batch is None:
                    return
            if batch:
                self._run_batch(batch)

    def _next_batch(self) -> Optional[List[_Waiting]]:
        """(Lock held.) Wait for the oldest request's deadline or a full token budget; None when stopping."""
        while True:
            if self._stopping:
                return None
            if not self._waiting:
                self._cond.wait()
                continue
            head = self._waiting[0]
            if self._waiting_tokens(head.request.key) >= self.max_batch_tokens:
                return self._take(head.request.key)
            remaining = head.enqueued_at + self.max_wait_s - time.perf_counter()
            if remaining <= 0:
                return self._take(head.request.key)
            self._cond.wait(remaining)

    def _waiting_tokens(self, key) -> int:
        return sum(w.request.num_tokens for w in self._waiting if w.request.key == key)

    def _take(self, key) -> List[_Waiting]:
        """Waiting requests with ``key`` that fit the budgets, oldest first (the first always fits: requests
        larger than a budget were refused at the door), skipping any whose session an earlier skipped or taken
        request names (so each session sees its requests in arrival order)."""
        taken, tokens, nbytes = [], 0, 0
        held = set()  # sessions named by an earlier waiting request, taken or not
        for item in self._waiting:
            if item.future.done():  # cancelled: its callback removes it
                continue
            request = item.request
            sessions = request.session_ids or ()
            fits = request.key == key and not held.intersection(sessions) and (not taken or (
                tokens + request.num_tokens <= self.max_batch_tokens
                and (self.max_batch_bytes is None or nbytes + request.memory_bytes <= self.max_batch_bytes)))
            held.update(sessions)
            if not fits or not item.future.set_running_or_notify_cancel():  # from here it can no longer cancel
                continue
            taken.append(item)
            tokens += request.num_tokens
            nbytes += request.memory_bytes
        self._waiting = [w for w in self._waiting if w not in taken and not w.future.done()]
        self._metrics.queue_depth.set(len(self._waiting))
        return taken

    def _run_batch(self, batch: List[_Waiting]) -> None:
        started = time.perf_counter()
        for item in batch:
            self._metrics.queue_seconds.observe(started - item.enqueued_at)
        requests = [item.request for item in batch]
        self.launches += 1
        self._metrics.record_launch(len(requests), sum(r.num_tokens for r in requests))
        try:
            results = self._launch(requests)
        except BaseException as error:  # every caller of the batch gets the launch's error
            for item in batch:
                item.future.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        finally:
            self._metrics.kernel_seconds.observe(time.perf_counter() - started)
        for item, result in zip(batch, results):
            if isinstance(result, BaseException):
                item.future.set_exception(result)
            else:
                item.future.set_result(result)
