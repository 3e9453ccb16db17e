"""Prometheus metrics of one service instance (its own registry, so several apps can live in one process)."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = tuple(2 ** i for i in range(4, 21))


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("flash_qla_requests", "Prefill requests answered, by HTTP status",
                                ["status"], registry=r)
        self.request_seconds = Histogram("flash_qla_request_seconds", "Total time of a prefill request "
                                         "(body read to response)", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("flash_qla_queue_seconds", "Time a request waited for its launch",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.kernel_seconds = Histogram("flash_qla_kernel_seconds", "Time of one merged launch on the worker "
                                        "thread (host<->device copies and the safetensors answers included)", buckets=_LATENCY_BUCKETS,
                                        registry=r)
        self.batch_tokens = Histogram("flash_qla_batch_tokens", "Tokens in one merged launch",
                                      buckets=_TOKEN_BUCKETS, registry=r)
        self.batch_requests = Histogram("flash_qla_batch_requests", "Requests merged into one launch",
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.launches = Counter("flash_qla_launches", "Merged launches", registry=r)
        self.tokens = Counter("flash_qla_tokens", "Tokens computed", registry=r)
        self.queue_depth = Gauge("flash_qla_queue_depth", "Requests waiting for a launch", registry=r)
        self.ready = Gauge("flash_qla_ready", "1 when /ready answers 200", registry=r)
        self.torch_threads = Gauge("flash_qla_torch_threads", "torch intra-op threads of the process", registry=r)
        self.sessions = Gauge("flash_qla_sessions", "Live sessions, by where their state is "
                              "(pool: the device's state pool; disk: --state-dir; none: no prefill yet)",
                              ["location"], registry=r)
        self.state_pool_bytes = Gauge("flash_qla_state_pool_bytes", "Bytes of the state pool tensors on the "
                                      "device (bounded by --max-state-mb)", registry=r)
        self.state_spills = Gauge("flash_qla_state_spills", "States written to --state-dir to make room in the "
                                  "pool, since start", registry=r)
        self.state_loads = Gauge("flash_qla_state_loads", "Spilled states read back into the pool, since start",
                                 registry=r)

    def record_sessions(self, stats: dict) -> None:
        self.sessions.labels(location="pool").set(stats["resident"])
        self.sessions.labels(location="disk").set(stats["on_disk"])
        self.sessions.labels(location="none").set(stats["sessions"] - stats["resident"] - stats["on_disk"])
        self.state_pool_bytes.set(stats["pool_bytes"])
        self.state_spills.set(stats["spills"])
        self.state_loads.set(stats["loads"])

    def record_launch(self, num_requests: int, num_tokens: int) -> None:
        self.launches.inc()
        self.tokens.inc(num_tokens)
        self.batch_requests.observe(num_requests)
        self.batch_tokens.observe(num_tokens)


class PrefillStatusMiddleware:
    """Pure ASGI middleware: counts every answer of ``path`` by status and times it, whichever layer answered
    (auth 401, body limit 413, validation 422, queue 429, not-ready 503, timeout 504, or 200)."""

    def __init__(self, app, metrics: ServiceMetrics, path: str):
        self.app = app
        self.metrics = metrics
        self.path = path

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering

        async def send_recording_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_recording_status)
        finally:
            self.metrics.requests.labels(status=str(status)).inc()
            self.metrics.request_seconds.observe(time.perf_counter() - started)
