"""The FastAPI application: /v1/prefill, /health, /ready, /metrics (and /docs)."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import Depends, FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

import flash_qla

from .auth import bearer_token_dependency
from .batcher import DynamicBatcher
from .codec import JSON, SAFETENSORS, decode_request, encode_result, media_type
from .config import ServiceConfig
from .engine import PrefillEngine
from .errors import InputError, LimitExceeded, NotReady, RequestTimedOut, ServiceError, install_error_handlers
from .metrics import PrefillStatusMiddleware, ServiceMetrics
from .prefill import PrefillRequest
from .readiness import STARTING, ReadyState, probe
from .schemas import ErrorResponse, HealthResponse, PrefillJSONRequest, PrefillJSONResponse, ReadyResponse

log = logging.getLogger("server")
PREFILL_PATH = "/v1/prefill"

_BINARY = {"schema": {"type": "string", "format": "binary"}}
_PREFILL_OPENAPI = {"requestBody": {"required": True, "content": {
    JSON: {"schema": PrefillJSONRequest.model_json_schema()},
    SAFETENSORS: {**_BINARY, "description": "a safetensors file with tensors q, k, v, g, beta, cu_seqlens "
                                            "[, initial_state] and metadata scale, use_qk_l2norm_in_kernel, "
                                            "output_final_state"}}}}
_PREFILL_RESPONSES = {
    200: {"description": "o and final_state, in the request's encoding",
          "content": {JSON: {"schema": PrefillJSONResponse.model_json_schema()},
                      SAFETENSORS: {**_BINARY, "description": "a safetensors file with o [, final_state]"}}},
    401: {"model": ErrorResponse, "description": "missing or wrong bearer token"},
    413: {"model": ErrorResponse, "description": "body, tokens or sequences over the server's limits"},
    415: {"model": ErrorResponse, "description": "neither JSON nor safetensors"},
    429: {"model": ErrorResponse, "description": "queue full; see Retry-After"},
    503: {"model": ErrorResponse, "description": "backend not ready; reason as on /ready"},
    504: {"model": ErrorResponse, "description": "not answered within --request-timeout-s"},
}


class ServiceState:
    """What the routes share: the settings, the batcher, the metrics and the readiness verdict."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.metrics = ServiceMetrics()
        self.engine = PrefillEngine(config.backend)
        # One worker thread: launches never run on the event loop, and never two at once.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flash-qla-launch")
        self.batcher = DynamicBatcher(self.engine.run, self.executor, self.metrics,
                                      max_batch_tokens=config.max_batch_tokens,
                                      max_wait_s=config.batch_wait_ms / 1000.0, max_queue=config.max_queue)
        self.ready: ReadyState = STARTING

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
        state.batcher.start()
        # The probe runs in the background: /health answers at once, /ready says "starting" until it is done.
        readiness = asyncio.get_running_loop().create_task(state.check_readiness())
        try:
            yield
        finally:
            readiness.cancel()
            await state.batcher.stop()
            state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="flash-qla prefill service", version=flash_qla.__version__, lifespan=lifespan,
                  max_body_size=config.max_body_bytes,
                  description="Gated DeltaNet chunked prefill over HTTP; concurrent requests are merged into "
                              "one varlen launch.")
    app.state.service = state
    install_error_handlers(app, config.max_body_bytes)
    app.add_middleware(PrefillStatusMiddleware, metrics=state.metrics, path=PREFILL_PATH)
    require_token = bearer_token_dependency(config.api_key)

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
        body = await request.body()  # FastAPI's max_body_size turns an oversized body into 413 here
        prefill_request = await _decode(body, encoding)
        _check_size_limits(prefill_request, config)
        try:
            result = await asyncio.wait_for(state.batcher.submit(prefill_request), config.request_timeout_s)
        except asyncio.TimeoutError:
            raise RequestTimedOut(f"no answer within {config.request_timeout_s} s (--request-timeout-s)") from None
        except (ValueError, TypeError) as error:  # the library rejected the launch: the request's fault
            raise InputError.from_api_error(error) from error
        except ServiceError:
            raise
        except Exception as error:  # noqa: BLE001 - a device or library failure: 500 with its text, logged
            log.exception("prefill launch failed")
            raise ServiceError(f"the launch failed: {type(error).__name__}: {error}", reason="launch_failed")
        payload = await run_in_threadpool(encode_result, result, encoding)
        return Response(payload, media_type=encoding)

    return app


async def _decode(body: bytes, encoding: str) -> PrefillRequest:
    """Parse off the event loop (large JSON bodies take a while); pydantic errors become 422 with the field."""
    try:
        return await run_in_threadpool(decode_request, body, encoding)
    except ValidationError as error:
        errors = error.errors(include_url=False, include_context=False, include_input=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


def _check_size_limits(request: PrefillRequest, config: ServiceConfig) -> None:
    if request.num_tokens > config.max_batch_tokens:
        raise LimitExceeded(f"{request.num_tokens} tokens exceed the server's limit of {config.max_batch_tokens} "
                            f"per request (--max-batch-tokens); split the batch", reason="too_many_tokens")
    if request.num_seqs > config.max_seqs_per_request:
        raise LimitExceeded(f"{request.num_seqs} sequences exceed the server's limit of "
                            f"{config.max_seqs_per_request} per request", reason="too_many_sequences")
