"""The FastAPI application: /v1/prefill, /v1/sessions, /health, /ready, /metrics, /docs and /redoc (served from
local assets), and /v1/echo when enabled (the transport's own limit, for benchmarks)."""
from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import List, Optional, Union

import torch
from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

import flash_qla

from .auth import bearer_token_dependency
from .batcher import DynamicBatcher
from .body_limit import BodyLimitMiddleware
from .codec import JSON, SAFETENSORS, decode_request, encode_json, encode_safetensors, media_type
from .config import ServiceConfig
from .engine import PrefillEngine
from .errors import InputError, LimitExceeded, NotReady, RequestTimedOut, ServiceError, install_error_handlers
from .limits import check_head_dims, check_memory
from .metrics import PrefillStatusMiddleware, ServiceMetrics
from .prefill import PrefillRequest, PrefillResult
from .readiness import STARTING, ReadyState, probe
from .schemas import ErrorResponse, HealthResponse, PrefillJSONRequest, PrefillJSONResponse, ReadyResponse
from .session_routes import session_router
from .sessions import SessionStore

log = logging.getLogger("server")
PREFILL_PATH = "/v1/prefill"

_BINARY = {"schema": {"type": "string", "format": "binary"}}
_PREFILL_OPENAPI = {"requestBody": {"required": True, "content": {
    JSON: {"schema": PrefillJSONRequest.model_json_schema()},
    SAFETENSORS: {**_BINARY, "description": "a safetensors file with tensors q, k, v, g, beta, cu_seqlens "
                                            "[, initial_state] and metadata scale, use_qk_l2norm_in_kernel, "
                                            "output_final_state, session_ids (a JSON list)"}}}}
_PREFILL_RESPONSES = {
    200: {"description": "o and final_state, in the request's encoding",
          "content": {JSON: {"schema": PrefillJSONResponse.model_json_schema()},
                      SAFETENSORS: {**_BINARY, "description": "a safetensors file with o [, final_state]; "
                                                              "metadata session_tokens with session_ids"}}},
    401: {"model": ErrorResponse, "description": "missing or wrong bearer token"},
    404: {"model": ErrorResponse, "description": "a session of session_ids is unknown, deleted or expired"},
    409: {"model": ErrorResponse, "description": "a session holds another head configuration"},
    413: {"model": ErrorResponse, "description": "body, tokens, sequences or estimated memory over the server's "
                                                 "limits (reason body_too_large, too_many_tokens, "
                                                 "too_many_sequences, request_memory)"},
    415: {"model": ErrorResponse, "description": "neither JSON nor safetensors"},
    429: {"model": ErrorResponse, "description": "queue full; see Retry-After"},
    503: {"model": ErrorResponse, "description": "backend not ready; reason as on /ready"},
    504: {"model": ErrorResponse, "description": "not answered within --request-timeout-s (with session_ids: "
                                                 "the turn may have been applied; see the session's tokens)"},
    507: {"model": ErrorResponse, "description": "the state pool cannot hold the sessions (state_memory_full)"},
}


class ServiceState:
    """What the routes share: the settings, the batcher, the metrics and the readiness verdict."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.metrics = ServiceMetrics()
        self.metrics.torch_threads.set(torch.get_num_threads())
        device = torch.device("cuda") if config.backend == "kernels" else torch.device("cpu")
        self.store = SessionStore(device, config.max_state_bytes, config.state_dir, config.session_ttl_s,
                                  config.max_sessions)
        self.engine = PrefillEngine(config.backend, self.store)
        # The readiness probe's thread; launches run on the batcher's own thread (never on the event loop, and
        # never two at once).
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flash-qla-probe")
        # Decoding and checking a /v1/prefill body (and encoding a JSON answer): a few threads, which never wait
        # for a launch; every thread that wants Python's GIL delays the event loop, which moves the bodies.
        self.request_threads = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 1)),
                                                  thread_name_prefix="flash-qla-request")
        self.batcher = DynamicBatcher(self.launch, self.metrics,
                                      max_batch_tokens=config.max_batch_tokens,
                                      max_wait_s=config.batch_wait_ms / 1000.0, max_queue=config.max_queue,
                                      max_batch_bytes=config.max_request_bytes, done=self.release)
        self.ready: ReadyState = STARTING
        self._kernel_head_dims = None

    def kernel_head_dims(self):
        """The (K, V) pairs the precompiled kernels were built for (loaded once the backend is ready)."""
        if self.config.backend != "kernels":
            return None
        if self._kernel_head_dims is None:
            from flash_qla import kernel_api
            self._kernel_head_dims = kernel_api.supported_head_dims()
        return self._kernel_head_dims

    def launch(self, requests: List[PrefillRequest]) -> List[Union[PrefillResult, bytes, BaseException]]:
        """One merged launch (on the batcher's thread) and, there too, each safetensors answer's body: the outputs
        are copied once, into bytes that the event loop sends as they are (the loop moves every body of the
        process; the launch thread waits for the device most of the time). JSON answers are encoded on a request
        thread."""
        results = self.engine.run(requests)
        return [b"".join(encode_safetensors(result)) if request.encoding == SAFETENSORS
                and isinstance(result, PrefillResult) else result for request, result in zip(requests, results)]

    def release(self, requests: List[PrefillRequest]) -> None:
        """The batcher let go of ``requests`` (after their launch on its thread, or without one on the event
        loop): their sessions may expire again. The loop never waits for the store: when a launch holds it, a
        request thread finishes them."""
        session_ids = [sid for r in requests if r.session_ids for sid in r.session_ids]
        if session_ids and not self.store.finish(session_ids, blocking=False):
            self.request_threads.submit(self.store.finish, session_ids)

    async def check_readiness(self) -> None:
        self.ready = await asyncio.get_running_loop().run_in_executor(self.executor, probe, self.config.backend)
        self.metrics.ready.set(1 if self.ready.ready else 0)
        log.info("backend %s ready=%s (%s) %s", self.config.backend, self.ready.ready, self.ready.reason,
                 self.ready.message)


def create_app(config: Optional[ServiceConfig] = None) -> FastAPI:
    config = config or ServiceConfig()
    state = ServiceState(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        loop = asyncio.get_running_loop()
        restored = await loop.run_in_executor(None, state.store.open)
        if restored:
            log.info("%d sessions restored from %s", restored, config.state_dir)
        state.batcher.start()
        # The probe runs in the background: /health answers at once, /ready says "starting" until it is done.
        readiness = loop.create_task(state.check_readiness())
        sweeper = loop.create_task(_expire_sessions(state.store))
        try:
            yield
        finally:
            readiness.cancel()
            sweeper.cancel()
            await state.batcher.stop()  # the launch in progress finishes and stores its states first
            await loop.run_in_executor(None, lambda: state.executor.shutdown(wait=True, cancel_futures=True))
            await loop.run_in_executor(None, lambda: state.request_threads.shutdown(wait=True, cancel_futures=True))
            written = await loop.run_in_executor(None, state.store.close)
            log.info("%d sessions written to %s", written, config.state_dir)

    app = FastAPIOffline(title="flash-qla prefill service", version=flash_qla.__version__, lifespan=lifespan,
                         description="Gated DeltaNet chunked prefill over HTTP, with sessions whose recurrent "
                                     "state stays in the server; concurrent requests are merged into one varlen "
                                     "launch.")
    app.state.service = state
    install_error_handlers(app, config.max_body_bytes)
    app.add_middleware(PrefillStatusMiddleware, metrics=state.metrics, path=PREFILL_PATH)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)
    require_token = bearer_token_dependency(config.api_key)
    app.include_router(session_router(state.store, require_token))

    @app.get("/health", response_model=HealthResponse, summary="the process is up")
    async def health() -> HealthResponse:
        return HealthResponse()

    @app.get("/ready", response_model=ReadyResponse, responses={503: {"model": ReadyResponse}},
             summary="the backend loaded and a tiny launch matched the reference")
    async def ready() -> JSONResponse:
        verdict = state.ready
        body = ReadyResponse(ready=verdict.ready, backend=config.backend, reason=verdict.reason,
                             message=verdict.message)
        return JSONResponse(body.model_dump(), status_code=200 if verdict.ready else 503)

    @app.get("/metrics", dependencies=[Depends(require_token)], summary="Prometheus metrics",
             response_class=Response)
    async def metrics() -> Response:
        state.metrics.record_sessions(await run_in_threadpool(state.store.stats))
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post(PREFILL_PATH, dependencies=[Depends(require_token)], openapi_extra=_PREFILL_OPENAPI,
              responses=_PREFILL_RESPONSES, response_class=Response,
              summary="chunked GDN prefill of a batch of packed sequences")
    async def prefill(request: Request) -> Response:
        verdict = state.ready
        if not verdict.ready:
            raise NotReady(verdict.message, reason=verdict.reason,
                           headers={"Retry-After": "1"} if verdict is STARTING else None)
        encoding = media_type(request.headers.get("content-type"))
        # A bytearray: a safetensors request's tensors are views of it. BodyLimitMiddleware makes an oversized
        # body a 413 while it is read.
        body = bytearray().join([chunk async for chunk in request.stream()])
        loop = asyncio.get_running_loop()
        # Every other thread that takes Python's GIL makes the event loop, which moves all bodies, wait for it.
        # A safetensors body is decoded and checked right here (its tensors are views of it); only JSON (pydantic,
        # nested lists) and a session store busy with a state file go to a request thread. The loop then queues
        # the request; a launch answers all its requests in one callback on the loop.
        if encoding == SAFETENSORS:
            prefill_request = checked(body, encoding)
        else:
            prefill_request = await loop.run_in_executor(state.request_threads, checked, body, encoding)
        sessions = prefill_request.session_ids
        if sessions and not state.store.admit(sessions, prefill_request.session_config, blocking=False):
            await loop.run_in_executor(state.request_threads, state.store.admit, sessions,
                                       prefill_request.session_config)
        try:
            result = await state.batcher.submit(prefill_request, timeout=config.request_timeout_s)
        except Exception as error:  # noqa: BLE001 - mapped to the client's answer
            mapped = _launch_error(error)
            if mapped is error:
                raise
            raise mapped from error
        if encoding == SAFETENSORS:  # encoded by the launch thread
            return Response(result, media_type=SAFETENSORS)
        return Response(await loop.run_in_executor(state.request_threads, encode_json, result), media_type=JSON)

    def checked(body: bytearray, encoding: str) -> PrefillRequest:
        """Decode and check the request before it may queue: sizes, head dims, the memory estimate. (Its
        sessions are admitted next: they stay pending, unable to expire, until the batcher releases it.)"""
        prefill_request = _decode(body, encoding)
        _check_size_limits(prefill_request, config)
        check_head_dims(prefill_request, config.backend, state.kernel_head_dims())
        prefill_request.memory_bytes = check_memory(prefill_request, config.backend, encoding,
                                                    config.max_request_bytes).total
        prefill_request.encoding = encoding
        return prefill_request

    if config.echo_endpoint:
        zeros = {"buffer": b""}  # grown, never resized in place: answers in flight hold views of it

        @app.post("/v1/echo", dependencies=[Depends(require_token)], response_class=Response,
                  summary="benchmark only (--echo-endpoint): read the body, answer response_bytes zero bytes")
        async def echo(request: Request, response_bytes: int = Query(0, ge=0, le=config.max_body_bytes)) -> Response:
            await request.body()
            if len(zeros["buffer"]) < response_bytes:
                zeros["buffer"] = bytes(response_bytes)
            return Response(memoryview(zeros["buffer"])[:response_bytes], media_type=SAFETENSORS)

    return app


async def _expire_sessions(store: SessionStore, every_s: float = 5.0) -> None:
    """Drop idle sessions past their TTL now and then (a lookup also expires them on the spot)."""
    while True:
        await asyncio.sleep(every_s)
        try:
            await run_in_threadpool(store.expire_idle)
        except Exception:  # noqa: BLE001 - a failed sweep is logged and retried; it never stops the server
            log.exception("session expiry sweep failed")


def _decode(body: bytearray, encoding: str) -> PrefillRequest:
    """pydantic errors become 422 with the field."""
    try:
        return decode_request(body, encoding)
    except ValidationError as error:
        errors = error.errors(include_url=False, include_context=False, include_input=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


def _launch_error(error: BaseException) -> BaseException:
    """What a failed wait for the launch becomes for the client."""
    if isinstance(error, TimeoutError):
        return RequestTimedOut("no answer within the request timeout (--request-timeout-s); with session_ids the "
                               "turn may have been applied: the session's tokens tell")
    if isinstance(error, ServiceError) or not isinstance(error, Exception):
        return error
    if isinstance(error, (ValueError, TypeError)):  # the library rejected the launch: the request's fault
        return InputError.from_api_error(error)
    log.error("prefill launch failed", exc_info=error)  # a device or library failure: 500 with its text
    return ServiceError(f"the launch failed: {type(error).__name__}: {error}", reason="launch_failed")


def _check_size_limits(request: PrefillRequest, config: ServiceConfig) -> None:
    if request.num_tokens > config.max_batch_tokens:
        raise LimitExceeded(f"{request.num_tokens} tokens exceed the server's limit of {config.max_batch_tokens} "
                            f"per request (--max-batch-tokens); split the batch", reason="too_many_tokens")
    if request.num_seqs > config.max_seqs_per_request:
        raise LimitExceeded(f"{request.num_seqs} sequences exceed the server's limit of "
                            f"{config.max_seqs_per_request} per request", reason="too_many_sequences")
