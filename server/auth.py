"""Optional bearer token: with ``--api-key`` set, protected routes need ``Authorization: Bearer <key>``."""
from __future__ import annotations

import secrets
from typing import Callable, Optional

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

_bearer = HTTPBearer(auto_error=False, description="required when the server was started with --api-key")


def bearer_token_dependency(api_key: Optional[str]) -> Callable:
    """A FastAPI dependency that lets everything through when ``api_key`` is None, else checks the token."""

    async def require_token(credentials: Optional[HTTPAuthorizationCredentials] = Depends(_bearer)) -> None:
        if api_key is None:
            return
        # compare_digest: the time taken does not tell how much of a guess was right
        if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), api_key.encode()):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    return require_token
