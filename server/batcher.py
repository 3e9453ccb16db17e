"""Dynamic batching: concurrent requests with one batch key become one varlen launch.

The oldest waiting request decides the next launch: it waits at most ``max_wait_s`` for company with its key,
or less once the waiting tokens of that key fill ``max_batch_tokens``. Then every waiting request with that key
that fits the budgets (tokens, and the requests' estimated memory) goes, in arrival order, to one launch.

Launches run on one thread of the batcher's own, which also applies this policy: it takes the next batch the
moment a launch ends, without a round trip through the event loop. Requests are queued on the event loop
(:meth:`DynamicBatcher.submit`), which waits on an asyncio future; a launch's answers go back to the loop in one
callback for the whole batch (one wake-up of the loop, not one per request). One launch at a time: the device
runs one anyway, and requests that arrive meanwhile form the next, larger batch.

Requests on one session are applied in arrival order: a launch never takes a request whose session is also named
by an earlier request that it does not take (another key, over budget, or the same session twice); that request
goes to a later launch. The launch function returns one result per request, or an exception for a request that
failed alone (e.g. its session was deleted meanwhile).

Every submitted request is handed to ``done`` exactly once when the batcher lets go of it: on the launch thread
right after its launch (a batch at a time), or on the event loop when it leaves without one (refused at the door,
withdrawn on a timeout or a cancellation, or dropped at shutdown).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Union

from .errors import NotReady, QueueFull
from .metrics import ServiceMetrics
from .prefill import PrefillRequest, PrefillResult

log = logging.getLogger("server.batcher")

# one answer per request: its result (or its encoded body), or the exception it failed with
LaunchFn = Callable[[List[PrefillRequest]], List[Union[PrefillResult, bytes, BaseException]]]
DoneFn = Callable[[List[PrefillRequest]], None]


@dataclass(eq=False)  # compared by identity: the fields hold tensors
class _Waiting:
    request: PrefillRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued_at: float = field(default_factory=time.perf_counter)
    launched: bool = False  # set under the batcher's lock when a launch takes it


class DynamicBatcher:
    def __init__(self, launch: LaunchFn, metrics: ServiceMetrics, *, max_batch_tokens: int, max_wait_s: float,
                 max_queue: int, max_batch_bytes: Optional[int] = None, done: Optional[DoneFn] = None):
        self._launch = launch
        self._metrics = metrics
        self._done = done
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
        """Finish the launch in progress (its results are delivered), then answer every waiting request with
        503 ``shutting_down``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        with self._cond:
            waiting, self._waiting = self._waiting, []
            self._metrics.queue_depth.set(0)
        _deliver(waiting, [NotReady("the service is shutting down", reason="shutting_down") for _ in waiting])

    async def submit(self, request: PrefillRequest, timeout: Optional[float] = None) -> Union[PrefillResult, bytes]:
        """Queue ``request`` (on the event loop) and wait for its slice of a launch.

        Raises QueueFull or NotReady at the door, ``TimeoutError`` when no answer came within ``timeout`` seconds
        (the request is withdrawn unless a launch has taken it: a taken one runs and its answer is dropped), and
        the launch's error for this request."""
        loop = asyncio.get_running_loop()
        try:
            item = self._put(request, loop)
        except BaseException:
            self._release([request])
            raise
        timer = None if timeout is None else loop.call_later(timeout, _expire, item.future)
        try:
            return await item.future
        except BaseException:
            self._withdraw(item)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _put(self, request: PrefillRequest, loop: asyncio.AbstractEventLoop) -> _Waiting:
        with self._cond:
            if self._stopping:
                raise NotReady("the service is shutting down", reason="shutting_down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (--max-queue {self.max_queue}); "
                                f"retry later")
            item = _Waiting(request, loop.create_future(), loop)
            self._waiting.append(item)
            self._metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()
        return item

    def _withdraw(self, item: _Waiting) -> None:
        """The caller stopped waiting: take the request out of the queue unless a launch has taken it."""
        with self._cond:
            if item.launched:
                return  # its launch hands it to ``done``
            if item in self._waiting:
                self._waiting.remove(item)
                self._metrics.queue_depth.set(len(self._waiting))
        self._release([item.request])

    def _release(self, requests: List[PrefillRequest]) -> None:
        if self._done is not None and requests:
            try:
                self._done(requests)
            except Exception:  # noqa: BLE001 - bookkeeping must not turn an answer into an error
                log.exception("releasing finished requests failed")

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
        request names (so each session sees its requests in arrival order). A request whose caller stopped
        waiting (its future is done) leaves the queue; its caller releases it."""
        taken, tokens, nbytes = [], 0, 0
        held = set()  # sessions named by an earlier waiting request, taken or not
        for item in self._waiting:
            if item.future.done():
                continue
            request = item.request
            sessions = request.session_ids or ()
            fits = request.key == key and not held.intersection(sessions) and (not taken or (
                tokens + request.num_tokens <= self.max_batch_tokens
                and (self.max_batch_bytes is None or nbytes + request.memory_bytes <= self.max_batch_bytes)))
            held.update(sessions)
            if not fits:
                continue
            item.launched = True  # from here its caller can no longer withdraw it
            taken.append(item)
            tokens += request.num_tokens
            nbytes += request.memory_bytes
        self._waiting = [w for w in self._waiting if not w.launched and not w.future.done()]
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
            self._metrics.kernel_seconds.observe(time.perf_counter() - started)
            self._release(requests)
            _deliver(batch, [error] * len(batch))
            if not isinstance(error, Exception):
                raise
            return
        self._metrics.kernel_seconds.observe(time.perf_counter() - started)
        self._release(requests)
        _deliver(batch, results)


def _deliver(items: List[_Waiting], outcomes: List[Union[PrefillResult, BaseException]]) -> None:
    """Answer ``items`` (from any thread): one callback on each event loop for all of its items."""
    by_loop: Dict[asyncio.AbstractEventLoop, list] = {}
    for item, outcome in zip(items, outcomes):
        by_loop.setdefault(item.loop, []).append((item.future, outcome))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve, pairs)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


def _resolve(pairs) -> None:
    """(On the futures' loop.) A future already done was given up by its caller (timeout, cancellation)."""
    for future, outcome in pairs:
        if future.done():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(TimeoutError())
