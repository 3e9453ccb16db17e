"""Python client of the prefill service: sessions, safetensors bodies, retries where they are safe.

    from server.client import PrefillClient
    with PrefillClient("http://127.0.0.1:8000") as client:
        sid = client.create_session()
        out = client.prefill(q, k, v, g, beta, session_ids=[sid])      # one sequence, continues the session
        out.o, out.session_tokens

Retries: a 429 (queue full) or a 503 that carries Retry-After (the server is starting) was refused before
anything was applied, and a connection that could not be opened sent nothing, so those are retried after
Retry-After (or a short backoff), up to ``max_retries`` times. Nothing else is retried: a turn on a session is
not idempotent, and an answer lost after the server read the request may have been applied (the session's
``tokens`` tell).
:class:`AsyncPrefillClient` has the same methods as coroutines.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import httpx
import torch
from safetensors.torch import load as load_safetensors

from .codec import SAFETENSORS, encode_safetensors_request, safetensors_metadata

_RETRY_STATUSES = (429, 503)


class PrefillError(Exception):
    """An answer other than success: ``status``, the server's machine-readable ``reason`` and its ``detail``."""

    def __init__(self, status: int, reason: str, message: str, detail=None):
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.detail = detail


@dataclass
class PrefillOutput:
    o: torch.Tensor                           # [T, Hv, V]
    final_state: Optional[torch.Tensor]       # [N, Hv, K, V], or None
    session_tokens: Optional[List[int]]       # with session_ids: tokens each session holds now


def prefill_body(q, k, v, g, beta, cu_seqlens=None, *, session_ids: Optional[Sequence[str]] = None,
                 initial_state=None, scale=None, use_qk_l2norm_in_kernel=False,
                 output_final_state: Optional[bool] = None) -> bytes:
    """The safetensors body of one /v1/prefill request. Tensors may carry a leading batch dim of 1."""
    def unbatched(x, ndim):
        if x is None:
            return None
        x = torch.as_tensor(x)
        if x.dim() == ndim + 1 and x.shape[0] == 1:
            x = x[0]
        return x.detach().to("cpu").contiguous()

    tensors = {"q": unbatched(q, 3), "k": unbatched(k, 3), "v": unbatched(v, 3), "g": unbatched(g, 2),
               "beta": unbatched(beta, 2)}
    T = tensors["q"].shape[0]
    tensors["cu_seqlens"] = (torch.tensor([0, T], dtype=torch.int64) if cu_seqlens is None
                             else torch.as_tensor(cu_seqlens).to("cpu", torch.int64))
    if initial_state is not None:
        tensors["initial_state"] = torch.as_tensor(initial_state).detach().to("cpu").contiguous()
    return encode_safetensors_request(tensors, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                      output_final_state=output_final_state,
                                      session_ids=None if session_ids is None else list(session_ids))


def parse_prefill_answer(body: bytes) -> PrefillOutput:
    tensors = load_safetensors(body)
    tokens = safetensors_metadata(body).get("session_tokens")
    return PrefillOutput(tensors["o"], tensors.get("final_state"), None if tokens is None else json.loads(tokens))


def _error(response: httpx.Response) -> PrefillError:
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text
    if isinstance(detail, dict):
        return PrefillError(response.status_code, detail.get("reason", ""), detail.get("message", ""), detail)
    if isinstance(detail, list):  # 422: one entry per field
        fields = "; ".join(f"{'.'.join(map(str, e.get('loc', [])[1:])) or 'body'}: {e.get('msg')}" for e in detail)
        return PrefillError(response.status_code, "invalid_request", fields, detail)
    return PrefillError(response.status_code, "http_error", str(detail), detail)


def _retry_delay(response: Optional[httpx.Response], attempt: int, cap_s: float) -> Optional[float]:
    """Seconds to wait before retrying, or None when this outcome is not safe to retry."""
    if response is not None:
        after = response.headers.get("retry-after")
        if response.status_code not in _RETRY_STATUSES or after is None:
            return None
        try:
            return min(cap_s, max(0.0, float(after)))
        except ValueError:
            pass
    return min(cap_s, 0.05 * 2 ** attempt)


class _Base:
    def __init__(self, base_url: str, api_key: Optional[str], max_retries: int, max_retry_wait_s: float):
        self.base_url = base_url.rstrip("/")
        self.headers: Dict[str, str] = {} if api_key is None else {"authorization": f"Bearer {api_key}"}
        self.max_retries = max_retries
        self.max_retry_wait_s = max_retry_wait_s


class PrefillClient(_Base):
    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 120.0, max_retries: int = 8,
                 max_retry_wait_s: float = 10.0, http: Optional[httpx.Client] = None):
        super().__init__(base_url, api_key, max_retries, max_retry_wait_s)
        self._own_http = http is None
        self.http = http or httpx.Client(timeout=timeout)

    def close(self) -> None:
        if self._own_http:
            self.http.close()

    def __enter__(self) -> "PrefillClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        for attempt in range(self.max_retries + 1):
            try:
                response = self.http.request(method, self.base_url + path, headers=headers, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                if attempt == self.max_retries:
                    raise
                time.sleep(_retry_delay(None, attempt, self.max_retry_wait_s))
                continue
            delay = _retry_delay(response, attempt, self.max_retry_wait_s) if response.status_code >= 400 else None
            if delay is None or attempt == self.max_retries:
                if response.status_code >= 400:
                    raise _error(response)
                return response
            time.sleep(delay)
        raise AssertionError("unreachable")

    def create_session(self, ttl_s: Optional[float] = None) -> str:
        body = {} if ttl_s is None else {"ttl_s": ttl_s}
        return self._request("POST", "/v1/sessions", json=body).json()["session_id"]

    def session(self, session_id: str) -> dict:
        return self._request("GET", f"/v1/sessions/{session_id}").json()

    def get_state(self, session_id: str) -> torch.Tensor:
        return load_safetensors(self._request("GET", f"/v1/sessions/{session_id}/state").content)["state"]

    def delete_session(self, session_id: str) -> None:
        self._request("DELETE", f"/v1/sessions/{session_id}")

    def prefill(self, q, k, v, g, beta, cu_seqlens=None, **options) -> PrefillOutput:
        """``options``: session_ids, initial_state, scale, use_qk_l2norm_in_kernel, output_final_state."""
        body = prefill_body(q, k, v, g, beta, cu_seqlens, **options)
        response = self._request("POST", "/v1/prefill", content=body, headers={"content-type": SAFETENSORS})
        return parse_prefill_answer(response.content)

    def ready(self) -> dict:
        return self.http.get(self.base_url + "/ready").json()


class AsyncPrefillClient(_Base):
    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 120.0, max_retries: int = 8,
                 max_retry_wait_s: float = 10.0, http: Optional[httpx.AsyncClient] = None):
        super().__init__(base_url, api_key, max_retries, max_retry_wait_s)
        self._own_http = http is None
        self.http = http or httpx.AsyncClient(timeout=timeout)

    async def aclose(self) -> None:
        if self._own_http:
            await self.http.aclose()

    async def __aenter__(self) -> "AsyncPrefillClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        for attempt in range(self.max_retries + 1):
            try:
                response = await self.http.request(method, self.base_url + path, headers=headers, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                if attempt == self.max_retries:
                    raise
                await asyncio.sleep(_retry_delay(None, attempt, self.max_retry_wait_s))
                continue
            delay = _retry_delay(response, attempt, self.max_retry_wait_s) if response.status_code >= 400 else None
            if delay is None or attempt == self.max_retries:
                if response.status_code >= 400:
                    raise _error(response)
                return response
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def create_session(self, ttl_s: Optional[float] = None) -> str:
        body = {} if ttl_s is None else {"ttl_s": ttl_s}
        return (await self._request("POST", "/v1/sessions", json=body)).json()["session_id"]

    async def session(self, session_id: str) -> dict:
        return (await self._request("GET", f"/v1/sessions/{session_id}")).json()

    async def get_state(self, session_id: str) -> torch.Tensor:
        return load_safetensors((await self._request("GET", f"/v1/sessions/{session_id}/state")).content)["state"]

    async def delete_session(self, session_id: str) -> None:
        await self._request("DELETE", f"/v1/sessions/{session_id}")

    async def prefill(self, q, k, v, g, beta, cu_seqlens=None, **options) -> PrefillOutput:
        body = prefill_body(q, k, v, g, beta, cu_seqlens, **options)
        response = await self._request("POST", "/v1/prefill", content=body, headers={"content-type": SAFETENSORS})
        return parse_prefill_answer(response.content)

    async def ready(self) -> dict:
        return (await self.http.get(self.base_url + "/ready")).json()
