"""Dynamic batching: concurrent requests with one batch key become one varlen launch.

The oldest waiting request decides the next launch: it waits at most ``max_wait_s`` for company with its key,
or less once the waiting tokens of that key fill ``max_batch_tokens``. Then every waiting request with that key
that fits the budgets (tokens, and the requests' estimated memory) goes, in arrival order, to one launch on a
single worker thread (one launch at a time: the device runs one anyway, and requests that arrive meanwhile form
the next, larger batch).

Requests on one session are applied in arrival order: a launch never takes a request whose session is also named
by an earlier request that it does not take (another key, over budget, or the same session twice); that request
goes to a later launch. The launch function returns one result per request, or an exception for a request that
failed alone (e.g. its session was deleted meanwhile).
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Union

from .errors import QueueFull
from .metrics import ServiceMetrics
from .prefill import PrefillRequest, PrefillResult

LaunchFn = Callable[[List[PrefillRequest]], List[Union[PrefillResult, BaseException]]]


@dataclass(eq=False)  # compared by identity: the fields hold tensors
class _Waiting:
    request: PrefillRequest
    future: asyncio.Future
    enqueued_at: float = field(default_factory=time.perf_counter)


class DynamicBatcher:
    def __init__(self, launch: LaunchFn, executor: ThreadPoolExecutor, metrics: ServiceMetrics, *,
                 max_batch_tokens: int, max_wait_s: float, max_queue: int, max_batch_bytes: Optional[int] = None):
        self._launch = launch
        self._executor = executor
        self._metrics = metrics
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.max_batch_bytes = max_batch_bytes
        self._waiting: List[_Waiting] = []
        self._arrived: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self.launches = 0  # merged launches so far (also exported as a metric)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        self._arrived = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="flash-qla-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for item in self._waiting:
            if not item.future.done():
                item.future.cancel()
        self._waiting.clear()

    async def submit(self, request: PrefillRequest) -> PrefillResult:
        """Queue a request and wait for its own slice of a launch. Raises QueueFull when the queue is full;
        cancelling the caller (a timeout) withdraws the request if it has not been launched yet."""
        if len(self._waiting) >= self.max_queue:
            raise QueueFull(f"{len(self._waiting)} requests are waiting (--max-queue {self.max_queue}); retry later")
        item = _Waiting(request, asyncio.get_running_loop().create_future())
        self._waiting.append(item)
        self._metrics.queue_depth.set(len(self._waiting))
        self._arrived.set()
        try:
            return await item.future
        except asyncio.CancelledError:
            self._withdraw(item)
            raise

    def _withdraw(self, item: _Waiting) -> None:
        if item in self._waiting:
            self._waiting.remove(item)
            self._metrics.queue_depth.set(len(self._waiting))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            head = self._waiting[0]
            deadline = head.enqueued_at + self.max_wait_s
            while self._waiting_tokens(head.request.key) < self.max_batch_tokens:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            batch = self._take(head.request.key)
            if batch:
                await self._run_batch(loop, batch)

    def _waiting_tokens(self, key) -> int:
        return sum(w.request.num_tokens for w in self._waiting if w.request.key == key)

    def _take(self, key) -> List[_Waiting]:
        """Waiting requests with ``key`` that fit the budgets, oldest first (the first always fits: requests
        larger than a budget were refused at the door), skipping any whose session an earlier skipped or taken
        request names (so each session sees its requests in arrival order)."""
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
            taken.append(item)
            tokens += request.num_tokens
            nbytes += request.memory_bytes
        self._waiting = [w for w in self._waiting if w not in taken and not w.future.done()]
        self._metrics.queue_depth.set(len(self._waiting))
        return taken

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: List[_Waiting]) -> None:
        now = time.perf_counter()
        for item in batch:
            self._metrics.queue_seconds.observe(now - item.enqueued_at)
        requests = [item.request for item in batch]
        self.launches += 1
        self._metrics.record_launch(len(requests), sum(r.num_tokens for r in requests))
        try:
            results, seconds = await loop.run_in_executor(self._executor, _timed, self._launch, requests)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - every caller of the batch gets the launch's error
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(error)
            return
        self._metrics.kernel_seconds.observe(seconds)
        for item, result in zip(batch, results):
            if item.future.done():  # a caller that timed out meanwhile is simply skipped
                continue
            if isinstance(result, BaseException):
                item.future.set_exception(result)
            else:
                item.future.set_result(result)


def _timed(launch: LaunchFn, requests: List[PrefillRequest]):
    started = time.perf_counter()
    results = launch(requests)
    return results, time.perf_counter() - started
