"""The /v1/sessions routes: create, inspect, read the state of, and delete a session."""
from __future__ import annotations

from typing import Callable

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from safetensors.torch import save as save_safetensors

from .schemas import ErrorResponse, SessionCreateRequest, SessionInfo
from .sessions import Session, SessionStore

_ERRORS = {401: {"model": ErrorResponse, "description": "missing or wrong bearer token"},
           404: {"model": ErrorResponse, "description": "unknown, deleted or expired session "
                                                        "(reason session_not_found / session_expired)"}}


def session_info(session: Session) -> SessionInfo:
    location = "pool" if session.slot is not None else "disk" if session.on_disk else "none"
    return SessionInfo(session_id=session.session_id, tokens=session.tokens, ttl_s=session.ttl_s,
                       created_at=session.created_at, last_used=session.last_used, location=location,
                       head_config=None if session.config is None else session.config._asdict())


def session_router(store: SessionStore, require_token: Callable) -> APIRouter:
    router = APIRouter(prefix="/v1/sessions", dependencies=[Depends(require_token)], tags=["sessions"])

    @router.post("", status_code=201, response_model=SessionInfo, summary="create a session",
                 responses={**_ERRORS, 507: {"model": ErrorResponse, "description": "--max-sessions reached"}},
                 openapi_extra={"requestBody": {"required": False, "content": {
                     "application/json": {"schema": SessionCreateRequest.model_json_schema()}}}})
    async def create(request: Request) -> SessionInfo:
        body = await request.body()  # read here: the body limit's 413 keeps its JSON shape
        try:
            options = SessionCreateRequest.model_validate_json(body) if body.strip() else SessionCreateRequest()
        except ValidationError as error:
            errors = error.errors(include_url=False, include_context=False, include_input=False)
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None
        return session_info(store.create(options.ttl_s))

    @router.get("/{session_id}", response_model=SessionInfo, responses=_ERRORS, summary="a session's record")
    async def info(session_id: str) -> SessionInfo:
        return session_info(await run_in_threadpool(store.get, session_id))

    @router.get("/{session_id}/state", response_class=Response, summary="a session's state (safetensors)",
                responses={**_ERRORS, 409: {"model": ErrorResponse, "description": "no prefill yet (no_state_yet)"},
                           200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                      "format": "binary"}}},
                                 "description": "a safetensors file with tensor state [Hv, K, V] and metadata "
                                                "session_id, tokens"}})
    async def state(session_id: str) -> Response:
        def read() -> bytes:
            tensor, session = store.read_state(session_id)
            return save_safetensors({"state": tensor.contiguous()},
                                    metadata={"session_id": session.session_id, "tokens": str(session.tokens)})
        return Response(await run_in_threadpool(read), media_type="application/octet-stream")

    @router.delete("/{session_id}", status_code=204, response_class=Response, responses=_ERRORS,
                   summary="delete a session and its state")
    async def delete(session_id: str) -> Response:
        await run_in_threadpool(store.delete, session_id)
        return Response(status_code=204)

    return router
