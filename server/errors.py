"""The service's error types and the HTTP answers they become.

Every answer other than 422 has the body ``{"detail": {"reason": <machine-readable code>, "message": <text>}}``;
422 keeps FastAPI's own shape, ``{"detail": [{"loc": ["body", <field>], "msg": <reason>, "type": ...}]}``, so a
client sees one format whether pydantic or flash_qla's validation rejected the field.
"""
from __future__ import annotations

import re
from typing import Dict, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# The request's fields, in the order a message is searched for the one it is about.
REQUEST_FIELDS = ("initial_state", "session_ids", "cu_seqlens", "beta", "scale", "q", "k", "v", "g",
                  "use_qk_l2norm_in_kernel", "output_final_state", "dtype")


class ServiceError(Exception):
    """An error the client should see with ``status_code`` and a machine-readable ``reason``."""
    status_code = 500
    reason = "internal_error"

    def __init__(self, message: str, reason: Optional[str] = None, headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        self.headers = headers


class UnsupportedMediaType(ServiceError):
    status_code = 415
    reason = "unsupported_media_type"


class LimitExceeded(ServiceError):
    status_code = 413


class QueueFull(ServiceError):
    status_code = 429
    reason = "queue_full"

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class NotReady(ServiceError):
    status_code = 503


class RequestTimedOut(ServiceError):
    status_code = 504
    reason = "timeout"


class SessionNotFound(ServiceError):
    """An unknown, deleted or expired session id (reason ``session_not_found`` or ``session_expired``)."""
    status_code = 404
    reason = "session_not_found"


class SessionConflict(ServiceError):
    """The request does not fit the session: another head configuration, or no state yet."""
    status_code = 409
    reason = "session_config_mismatch"


class StateMemoryFull(ServiceError):
    """The state pool cannot take the session's state (budget, no spill directory, or session count)."""
    status_code = 507
    reason = "state_memory_full"


class InputError(ValueError):
    """A malformed or inconsistent request field; becomes 422 naming ``field``."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message

    @classmethod
    def from_api_error(cls, error: Exception) -> "InputError":
        """Wrap a ValueError/TypeError from flash_qla, naming the field its message is about."""
        message = str(error)
        return cls(field_named_in(message), message)

    def as_validation_error(self) -> RequestValidationError:
        return RequestValidationError([{"type": "value_error", "loc": ("body", self.field), "msg": self.message,
                                        "input": None}])


def field_named_in(message: str) -> str:
    """The request field a flash_qla.validation message is about: it names it first (``"q must ..."``),
    or mentions it (``"the number of v heads ..."``); ``"body"`` when it names none."""
    first = re.match(r"\s*([A-Za-z_]+)", message)
    if first and first.group(1) in REQUEST_FIELDS:
        return first.group(1)
    hits = [(m.start(), name) for name in REQUEST_FIELDS
            for m in [re.search(rf"(?<![A-Za-z_.]){re.escape(name)}(?![A-Za-z_])", message)] if m]
    return min(hits)[1] if hits else "body"


def service_error_response(exc: ServiceError) -> JSONResponse:
    return JSONResponse({"detail": {"reason": exc.reason, "message": exc.message}}, status_code=exc.status_code,
                        headers=exc.headers)


def install_error_handlers(app: FastAPI, max_body_bytes: int) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return service_error_response(exc)

    @app.exception_handler(InputError)
    async def _input_error(request: Request, exc: InputError) -> JSONResponse:
        from fastapi.exception_handlers import request_validation_exception_handler
        return await request_validation_exception_handler(request, exc.as_validation_error())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's body limit raises a bare 413 "Content Too Large"; say which limit and how to change it.
        if exc.status_code == 413:
            return service_error_response(LimitExceeded(
                f"request body exceeds the limit of {max_body_bytes} bytes (--max-body-mb)", reason="body_too_large"))
        reason = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"detail": {"reason": reason, "message": str(exc.detail)}}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))
