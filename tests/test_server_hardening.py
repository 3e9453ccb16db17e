"""Limits and malformed input as a new user meets them, on a real uvicorn on loopback (reference backend)."""
from __future__ import annotations

import json
import re

import pytest

# the service's extras ([server,test]): without them (a GPU machine with the kernels only) these tests skip, named
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
import torch

from server.background import BackgroundServer
from server.client import PrefillClient, PrefillError
from server.config import REFERENCE_MAX_HEAD_DIM, ServiceConfig
from server.limits import check_head_dims, estimate_memory
from server.prefill import prepare_request
from test_server import CLIENT_TIMEOUT, HV, error_fields, json_body, make_inputs, post_json


@pytest.fixture(scope="module")
def server():
    config = ServiceConfig(backend="reference", port=0, batch_wait_ms=1, max_body_mb=1.0, max_request_mb=64.0,
                           echo_endpoint=True)
    with BackgroundServer(config) as s:
        assert s.wait_ready(30)
        yield s


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=CLIENT_TIMEOUT) as c:
        yield c


def strict_json(response):
    """Parse as a strict JSON parser would: NaN / Infinity tokens are errors."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(response.content, parse_constant=refuse)


def _wide_heads_body(T=2, Hq=1, Hv=16, dim=1024):
    """The new user's case: a 0.15 MB body whose answer would hold a 64 MiB final state."""
    zeros = lambda *shape: torch.zeros(shape).tolist()  # noqa: E731
    return {"q": zeros(T, Hq, dim), "k": zeros(T, Hq, dim), "v": zeros(T, Hv, dim), "g": zeros(T, Hv),
            "beta": zeros(T, Hv), "cu_seqlens": [0, T]}


def test_head_dims_over_the_reference_cap_are_422_before_anything_is_allocated(server, http):
    body = _wide_heads_body()
    assert len(json.dumps(body)) < 200_000
    r = post_json(http, server.url, body)
    assert r.status_code == 422 and error_fields(r) == ["q"], r.text
    assert f"limit of {REFERENCE_MAX_HEAD_DIM}" in r.json()["detail"][0]["msg"]


def test_memory_estimate_over_the_limit_is_413_with_the_estimate(server, http):
    # within the head-dim cap, but Hv = 64 heads of 256 x 256 states: 16 MiB of state per sequence
    body = _wide_heads_body(T=2, Hq=1, Hv=64, dim=256)
    r = post_json(http, server.url, body)
    assert r.status_code == 413, r.text
    detail = r.json()["detail"]
    assert detail["reason"] == "request_memory" and "--max-request-mb" in detail["message"]
    assert re.search(r"need about [\d.]+ MiB \(inputs .*states .*workspace .*encoded answer", detail["message"])
    # the same request without its final state in the answer fits
    r = post_json(http, server.url, {**body, "output_final_state": False})
    assert r.status_code == 200, r.text


def test_memory_estimate_counts_the_json_answer():
    x = make_inputs([64, 64], seed=1)
    request = prepare_request(dict(x), None, False, True)
    as_json = estimate_memory(request, "reference", "application/json")
    as_st = estimate_memory(request, "reference", "application/octet-stream")
    answer_numbers = x["v"].numel() + 2 * HV * 16 * 16
    assert as_json.response == 56 * answer_numbers and as_st.response == 4 * answer_numbers
    assert as_json.states == 3 * 2 * HV * 16 * 16 * 4 and as_json.total > as_st.total


@pytest.mark.parametrize("token,field", [("NaN", "q"), ("Infinity", "g"), ("-Infinity", "beta"), ("1e400", "v"),
                                         ("NaN", "scale")])
def test_non_finite_json_numbers_are_422_naming_the_field(server, http, token, field):
    body = json_body(make_inputs([3], seed=2))
    text = json.dumps({**body, field: "@"} if field == "scale" else body)
    if field == "scale":
        text = text.replace('"@"', token)
    else:
        first = json.dumps(body[field])
        mutated = re.sub(r"-?\d+\.\d+(e-?\d+)?", token, first, count=1)
        text = text.replace(first, mutated, 1)
    r = http.post(server.url + "/v1/prefill", content=text, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert error_fields(r) == [field] and "finite" in r.json()["detail"][0]["msg"]
    strict_json(r)


def test_numbers_overflowing_the_dtype_are_422(server, http):
    body = json_body(make_inputs([3], seed=3))
    body["v"][0][0][0] = 1e39                      # finite in JSON, infinite in float32
    r = post_json(http, server.url, body)
    assert r.status_code == 422 and error_fields(r) == ["v"] and "range of float32" in r.text
    body = json_body(make_inputs([3], seed=3, dtype=torch.float16), dtype="float16")
    body["q"][1][0][0] = 70000.0                   # over float16's 65504
    r = post_json(http, server.url, body)
    assert r.status_code == 422 and error_fields(r) == ["q"]


def test_answers_are_strict_json_and_non_finite_results_are_422(server, http):
    x = make_inputs([5], seed=4)
    r = post_json(http, server.url, json_body(x))
    assert r.status_code == 200
    assert set(strict_json(r)) == {"dtype", "o", "final_state", "session_tokens"}
    # finite inputs whose arithmetic overflows float32: one key for every token, v alternating +-3e38
    x["k"] = x["k"][:1].expand_as(x["k"]).contiguous()
    x["v"] = torch.full_like(x["v"], 3e38) * torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])[:, None, None]
    x["beta"] = torch.ones_like(x["beta"])
    r = post_json(http, server.url, json_body(x))
    assert r.status_code == 422 and error_fields(r) == ["body"] and "safetensors" in r.text
    strict_json(r)


def test_every_over_limit_body_gets_one_json_413(server, http):
    limit = 1024 * 1024
    big = b"\0" * (limit + 1)
    shapes = []
    for path, content_type in (("/v1/prefill", "application/octet-stream"), ("/v1/prefill", "application/json"),
                               ("/v1/sessions", "application/json"), ("/v1/echo", "application/octet-stream")):
        with_length = http.post(server.url + path, content=big, headers={"content-type": content_type})
        chunked = http.post(server.url + path, content=iter([big[:65536]] * 17),
                            headers={"content-type": content_type})
        for r in (with_length, chunked):
            assert r.status_code == 413, (path, r.status_code, r.text[:200])
            assert r.headers["content-type"] == "application/json"
            shapes.append(strict_json(r))
    assert all(s == {"detail": {"reason": "body_too_large",
                                "message": f"request body exceeds the limit of {limit} bytes (--max-body-mb)"}}
               for s in shapes)


def test_docs_and_redoc_load_their_assets_from_the_server(server, http):
    for page, asset in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
        html = http.get(server.url + page)
        assert html.status_code == 200
        scripts = re.findall(r'src="([^"]+)"', html.text)
        assert scripts and all(not s.startswith(("http://", "https://", "//")) for s in scripts), scripts
        assert not re.search(r"https?://cdn", html.text)
        js = [s for s in scripts if s.endswith(asset)]
        assert js, scripts
        r = http.get(server.url + js[0])
        assert r.status_code == 200 and len(r.content) > 100_000
    spec = http.get(server.url + "/openapi.json").json()
    assert {"/v1/prefill", "/v1/sessions", "/v1/sessions/{session_id}", "/v1/sessions/{session_id}/state"} <= set(
        spec["paths"])
    assert "/v1/echo" in spec["paths"]  # only with echo_endpoint (--echo-endpoint), as here


def test_kernels_backend_admits_only_built_head_dims_and_dtypes():
    x = make_inputs([4], seed=5, dtype=torch.bfloat16)
    request = prepare_request(dict(x), None, False, True)
    check_head_dims(request, "kernels", {(16, 16)})
    with pytest.raises(ValueError, match="not built for sm_90a"):
        check_head_dims(request, "kernels", {(128, 128)})
    request32 = prepare_request(dict(make_inputs([4], seed=5)), None, False, True)
    with pytest.raises(ValueError, match="bfloat16 or float16") as e:
        check_head_dims(request32, "kernels", {(16, 16)})
    assert e.value.field == "q"


# -- the client's retries --------------------------------------------------------------------------------------------

def _mock_client(statuses, **kwargs):
    calls = []

    def handler(request):
        calls.append(request)
        status, headers = statuses[min(len(calls) - 1, len(statuses) - 1)]
        if status == 201:
            return httpx.Response(201, json={"session_id": "S" * 22})
        return httpx.Response(status, headers=headers, json={"detail": {"reason": "queue_full", "message": "busy"}})

    http = httpx.Client(transport=httpx.MockTransport(handler))
    return PrefillClient("http://service", http=http, **kwargs), calls


def test_client_retries_429_and_starting_503_after_retry_after():
    client, calls = _mock_client([(429, {"retry-after": "0"}), (503, {"retry-after": "0"}), (201, {})])
    assert client.create_session() == "S" * 22 and len(calls) == 3
    client, calls = _mock_client([(429, {"retry-after": "0"})], max_retries=2)
    with pytest.raises(PrefillError) as e:
        client.create_session()
    assert e.value.status == 429 and e.value.reason == "queue_full" and len(calls) == 3
    client, calls = _mock_client([(503, {}), (201, {})])     # not ready for good (no Retry-After): no retry
    with pytest.raises(PrefillError):
        client.create_session()
    assert len(calls) == 1
    client, calls = _mock_client([(500, {"retry-after": "0"}), (201, {})])
    with pytest.raises(PrefillError):
        client.create_session()
    assert len(calls) == 1


def test_client_retries_a_real_full_queue(tmp_path):
    """max_queue 1 and a long batching wait: the second request gets 429 + Retry-After, the client waits and
    gets its answer."""
    import threading
    config = ServiceConfig(backend="reference", port=0, max_queue=1, batch_wait_ms=300)
    x = make_inputs([4], seed=6)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")]
    with BackgroundServer(config) as server, PrefillClient(server.url, max_retry_wait_s=0.2) as client:
        assert server.wait_ready(30)
        first = threading.Thread(target=client.prefill, args=args)
        first.start()
        from test_server import wait_until
        assert wait_until(lambda: server.service.batcher.queue_depth == 1, 5)
        out = client.prefill(*args)
        first.join(10)
        samples = httpx.get(server.url + "/metrics").text
    assert out.o.shape == x["v"].shape
    assert re.search(r'flash_qla_requests_total\{status="429"\} [1-9]', samples)
