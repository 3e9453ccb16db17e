"""One 413 answer for every body over ``--max-body-mb``, whatever the upload looks like.

With a Content-Length over the limit the answer comes before the body is read; without one (chunked uploads)
the bytes are counted as they arrive and the route's read fails with :class:`~server.errors.LimitExceeded`. Both
answer ``{"detail": {"reason": "body_too_large", "message": ...}}``.
"""
from __future__ import annotations

from .errors import LimitExceeded, service_error_response


class BodyLimitMiddleware:
    def __init__(self, app, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _error(self) -> LimitExceeded:
        return LimitExceeded(f"request body exceeds the limit of {self.max_body_bytes} bytes (--max-body-mb)",
                             reason="body_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_body_bytes:
            await service_error_response(self._error())(scope, receive, send)
            return
        received = 0
        started = False

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._error()
            return message

        async def recording_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, recording_send)
        except LimitExceeded as error:  # raised outside a route's handlers (e.g. while the framework read the body)
            if started:
                raise
            await service_error_response(error)(scope, receive, send)
