"""End-to-end tests of the prefill service (server/) on the reference backend, CPU only.

Real uvicorn servers on 127.0.0.1 with ephemeral ports run in background threads (one subprocess for the CLI);
every wait is bounded. Sizes are tiny (K = V = 16, a few dozen tokens) because the reference is slow.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# the service's extras ([server,test]): without them (a GPU machine with the kernels only) these tests skip, named
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
import torch

import flash_qla
from prometheus_client.parser import text_string_to_metric_families

from flash_qla.reference import recurrent_gated_delta_rule, relative_l2
from server.background import BackgroundServer
from server.batcher import DynamicBatcher
from server.codec import decode_safetensors_response, encode_safetensors_request
from server.config import ServiceConfig
from server.errors import NotReady, QueueFull, field_named_in
from server.merge import merge_requests, split_outputs
from server.metrics import ServiceMetrics
from server.prefill import PrefillResult, prepare_request

REPO_ROOT = Path(__file__).resolve().parents[1]
HQ, HV, K, V = 2, 4, 16, 16
TOLERANCE = 1e-5
CLIENT_TIMEOUT = httpx.Timeout(30.0)


# -- helpers ----------------------------------------------------------------------------------------------------

def make_inputs(lengths, seed=0, with_state=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    x = {"q": torch.nn.functional.normalize(torch.randn(T, HQ, K, generator=gen), dim=-1),
         "k": torch.nn.functional.normalize(torch.randn(T, HQ, K, generator=gen), dim=-1),
         "v": torch.randn(T, HV, V, generator=gen),
         "g": torch.nn.functional.logsigmoid(torch.randn(T, HV, generator=gen)),
         "beta": torch.rand(T, HV, generator=gen),
         "cu_seqlens": torch.tensor(cu, dtype=torch.int64)}
    for name in ("q", "k", "v"):
        x[name] = x[name].to(dtype)
    if with_state:
        x["initial_state"] = 0.1 * torch.randn(N, HV, K, V, generator=gen)
    return x


def expected(x, scale=None, l2norm=False):
    h0 = x.get("initial_state")
    o, final = recurrent_gated_delta_rule(*(x[n][None] for n in ("q", "k", "v", "g", "beta")), scale=scale,
                                          initial_state=h0, output_final_state=True, cu_seqlens=x["cu_seqlens"],
                                          use_qk_l2norm_in_kernel=l2norm)
    return o[0], final


def json_body(x, dtype="float32", **scalars):
    body = {name: t.tolist() for name, t in x.items()}
    body["dtype"] = dtype
    body.update(scalars)
    return body


def post_json(client, url, body, **kwargs):
    return client.post(url + "/v1/prefill", json=body, **kwargs)


def post_safetensors(client, url, x, **kwargs):
    scalars = {k: kwargs.pop(k) for k in ("scale", "use_qk_l2norm_in_kernel", "output_final_state") if k in kwargs}
    return client.post(url + "/v1/prefill", content=encode_safetensors_request(x, **scalars),
                       headers={"content-type": "application/octet-stream", **kwargs.pop("headers", {})}, **kwargs)


def metric_samples(text):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def error_fields(response):
    """The field each 422 entry names: loc is ["body", field, index...], or ["body"] for the body as a whole."""
    return [e["loc"][1] if len(e["loc"]) > 1 else e["loc"][0] for e in response.json()["detail"]]


def wait_until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def reference_server():
    config = ServiceConfig(backend="reference", port=0, batch_wait_ms=10, max_batch_tokens=4096)
    with BackgroundServer(config) as server:
        assert server.wait_ready(30), server.service.ready
        yield server


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=CLIENT_TIMEOUT, limits=httpx.Limits(max_connections=64)) as c:
        yield c


# -- correctness and batching -------------------------------------------------------------------------------------

def test_concurrent_clients_are_batched_and_get_their_own_answers(reference_server, client):
    """40 concurrent clients, mixed lengths/encodings/flags; each answer matches the token-by-token reference."""
    url = reference_server.url
    before = metric_samples(client.get(url + "/metrics").text)
    cases = []
    for i in range(40):
        lengths = [1 + (7 * i + 3 * j) % 37 for j in range(1 + i % 3)]
        cases.append({"x": make_inputs(lengths, seed=100 + i, with_state=(i % 4 == 1)),
                      "encoding": "json" if i % 2 else "safetensors",
                      "l2norm": i % 5 == 0,                       # a second batch key
                      "output_final_state": i % 7 != 3})

    def call(case):
        kwargs = {"use_qk_l2norm_in_kernel": case["l2norm"], "output_final_state": case["output_final_state"]}
        if case["encoding"] == "json":
            r = post_json(client, url, json_body(case["x"], **kwargs))
            assert r.status_code == 200, r.text
            assert r.headers["content-type"].startswith("application/json")
            data = r.json()
            final = None if data["final_state"] is None else torch.tensor(data["final_state"])
            return torch.tensor(data["o"]), final
        r = post_safetensors(client, url, case["x"], **kwargs)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/octet-stream"
        return decode_safetensors_response(r.content)

    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        answers = list(pool.map(call, cases, timeout=120))

    for case, (o, final) in zip(cases, answers):
        o_ref, final_ref = expected(case["x"], l2norm=case["l2norm"])
        assert o.shape == o_ref.shape and o.dtype == torch.float32
        assert relative_l2(o, o_ref) < TOLERANCE
        if case["output_final_state"]:
            assert final.shape == final_ref.shape
            assert relative_l2(final, final_ref) < TOLERANCE
        else:
            assert final is None

    after = metric_samples(client.get(url + "/metrics").text)
    delta = {name: after.get((name, ()), 0) - before.get((name, ()), 0)
             for name in ("flash_qla_launches_total", "flash_qla_batch_requests_count", "flash_qla_tokens_total")}
    assert delta["flash_qla_batch_requests_count"] == delta["flash_qla_launches_total"]
    assert delta["flash_qla_launches_total"] < len(cases), f"no requests were merged: {delta}"
    print("batching:", delta)
    assert delta["flash_qla_tokens_total"] == sum(c["x"]["q"].shape[0] for c in cases)


def test_json_and_safetensors_round_trips_agree(reference_server, client):
    x = make_inputs([5, 12], seed=7, with_state=True)
    r_json = post_json(client, reference_server.url, json_body(x, scale=0.3))
    r_st = post_safetensors(client, reference_server.url, x, scale=0.3)
    assert r_json.status_code == r_st.status_code == 200
    o_st, final_st = decode_safetensors_response(r_st.content)
    o_ref, final_ref = expected(x, scale=0.3)
    assert torch.equal(torch.tensor(r_json.json()["o"]), o_st)
    assert torch.equal(torch.tensor(r_json.json()["final_state"]), final_st)
    assert relative_l2(o_st, o_ref) < TOLERANCE and relative_l2(final_st, final_ref) < TOLERANCE


def test_bfloat16_request_answers_in_bfloat16(reference_server, client):
    x = make_inputs([9], seed=3, dtype=torch.bfloat16)
    r = post_safetensors(client, reference_server.url, x)
    assert r.status_code == 200, r.text
    o, final = decode_safetensors_response(r.content)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    r = post_json(client, reference_server.url, json_body(x, dtype="bfloat16"))
    assert r.status_code == 200 and r.json()["dtype"] == "bfloat16"


# -- errors ---------------------------------------------------------------------------------------------------------

def _bad_json_bodies():
    x = make_inputs([4, 6], seed=1)
    good = json_body(x)
    yield "k", {**good, "k": x["k"][:, :1].tolist()}                                   # k shape != q shape
    yield "cu_seqlens", {**good, "cu_seqlens": [0, 4, 9]}                               # does not end at T
    yield "cu_seqlens", {**good, "cu_seqlens": [0, 6, 4, 10]}                           # decreasing
    yield "q", {**good, "q": [good["q"][0], good["q"][1][:1]] + good["q"][2:]}          # ragged
    yield "beta", {k: v for k, v in good.items() if k != "beta"}                        # missing
    yield "dtype", {**good, "dtype": "int8"}
    yield "initial_state", {**good, "initial_state": torch.zeros(3, HV, K, V).tolist()}  # N mismatch
    yield "v", {**good, "v": "not a list"}
    yield "surprise", {**good, "surprise": 1}                                           # unknown field
    yield "q", {**good, "q": torch.zeros(10, HQ).tolist()}                              # wrong rank
    yield "v", {**good, "v": x["v"][:, :3].tolist(), "g": x["g"][:, :3].tolist(),       # Hv not multiple of Hq
                   "beta": x["beta"][:, :3].tolist()}


@pytest.mark.parametrize("field,body", list(_bad_json_bodies()), ids=lambda v: v if isinstance(v, str) else "")
def test_malformed_json_is_422_naming_the_field(reference_server, client, field, body):
    r = post_json(client, reference_server.url, body)
    assert r.status_code == 422, r.text
    assert field in error_fields(r), r.text
    assert all(e["msg"] for e in r.json()["detail"])


def test_malformed_safetensors_is_422_naming_the_field(reference_server, client):
    url = reference_server.url
    x = make_inputs([4, 6], seed=2)
    cases = [
        ("body", b"definitely not safetensors"),
        ("body", b"\xff" * 8 + b"{}"),
        ("q", encode_safetensors_request({**x, "q": x["q"].to(torch.int32)})),
        ("scale", encode_safetensors_request(x, scale=float("nan"))),
        ("cu_seqlens", encode_safetensors_request({**x, "cu_seqlens": x["cu_seqlens"].float()})),
        ("g", encode_safetensors_request({n: t for n, t in x.items() if n != "g"})),
        ("extra", encode_safetensors_request({**x, "extra": torch.zeros(1)})),
    ]
    for field, body in cases:
        r = client.post(url + "/v1/prefill", content=body, headers={"content-type": "application/octet-stream"})
        assert r.status_code == 422, (field, r.text)
        assert field in error_fields(r), (field, r.text)


def test_invalid_json_and_wrong_media_type_are_client_errors(reference_server, client):
    url = reference_server.url
    r = client.post(url + "/v1/prefill", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and error_fields(r) == ["body"]
    r = client.post(url + "/v1/prefill", content=b"q=1", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["detail"]["reason"] == "unsupported_media_type"


def test_validation_messages_map_to_fields():
    assert field_named_in("q, k and v must share one dtype, got ...") == "q"
    assert field_named_in("the number of v heads Hv = 3 (v.shape[2]) must be a multiple of ...") == "v"
    assert field_named_in("initial_state must have shape [N, Hv, K, V]") == "initial_state"
    assert field_named_in("head dims (K=16, V=16) are not built for sm_90a") == "body"


@pytest.fixture(scope="module")
def small_limits_server():
    config = ServiceConfig(backend="reference", port=0, max_body_mb=48 / 1024, max_batch_tokens=32,
                           max_seqs_per_request=3)
    with BackgroundServer(config) as server:
        assert server.wait_ready(30)
        yield server


def test_body_over_the_limit_is_413(small_limits_server, client):
    url = small_limits_server.url + "/v1/prefill"
    big = b"\0" * (64 * 1024)
    r = client.post(url, content=big, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 413
    # without Content-Length (chunked upload) the bytes are counted as they arrive
    r = client.post(url, content=iter([big[:16384]] * 4), headers={"content-type": "application/octet-stream"})
    assert r.status_code == 413
    assert r.json()["detail"]["reason"] == "body_too_large"


def test_too_many_tokens_or_sequences_is_413_with_reason(small_limits_server, client):
    r = post_safetensors(client, small_limits_server.url, make_inputs([20, 20]))
    assert r.status_code == 413 and r.json()["detail"]["reason"] == "too_many_tokens"
    r = post_safetensors(client, small_limits_server.url, make_inputs([1, 1, 1, 1]))
    assert r.status_code == 413 and r.json()["detail"]["reason"] == "too_many_sequences"
    r = post_safetensors(client, small_limits_server.url, make_inputs([10, 10]))
    assert r.status_code == 200


@pytest.fixture(scope="module")
def slow_batching_server():
    """A request waits 5 s for company but times out after 0.5 s; one waiting request fills the queue."""
    config = ServiceConfig(backend="reference", port=0, max_queue=1, batch_wait_ms=5000, request_timeout_s=0.5)
    with BackgroundServer(config) as server:
        assert server.wait_ready(30)
        yield server


def test_full_queue_is_429_with_retry_after(slow_batching_server, client):
    x = make_inputs([3])
    first = {}
    thread = threading.Thread(target=lambda: first.setdefault("r", post_safetensors(client, slow_batching_server.url, x)))
    thread.start()
    assert wait_until(lambda: slow_batching_server.service.batcher.queue_depth == 1)
    r = post_safetensors(client, slow_batching_server.url, x)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1" and r.json()["detail"]["reason"] == "queue_full"
    thread.join(10)
    assert first["r"].status_code == 504  # the waiting one hit the request timeout


def test_request_timeout_is_504_and_withdraws_the_request(slow_batching_server, client):
    r = post_safetensors(client, slow_batching_server.url, make_inputs([3]))
    assert r.status_code == 504 and r.json()["detail"]["reason"] == "timeout"
    assert wait_until(lambda: slow_batching_server.service.batcher.queue_depth == 0, 2)


@pytest.fixture(scope="module")
def token_server():
    with BackgroundServer(ServiceConfig(backend="reference", port=0, api_key="s3cret")) as server:
        assert server.wait_ready(30)
        yield server


def test_bearer_token(token_server, client):
    url = token_server.url
    x = make_inputs([4])
    r = post_safetensors(client, url, x)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert post_safetensors(client, url, x, headers={"authorization": "Bearer nope"}).status_code == 401
    assert post_safetensors(client, url, x, headers={"authorization": "Bearer s3cret"}).status_code == 200
    assert client.get(url + "/metrics").status_code == 401
    assert client.get(url + "/metrics", headers={"authorization": "Bearer s3cret"}).status_code == 200
    assert client.get(url + "/health").status_code == 200   # probes stay open
    assert client.get(url + "/ready").status_code == 200


# -- probes, metrics, docs -------------------------------------------------------------------------------------------

def test_health_ready_metrics_and_docs(reference_server, client):
    url = reference_server.url
    assert client.get(url + "/health").json() == {"status": "ok"}
    ready = client.get(url + "/ready")
    assert ready.status_code == 200
    assert ready.json()["ready"] is True and ready.json()["backend"] == "reference" and ready.json()["reason"] == "ok"

    post_json(client, url, {"dtype": "float32"})  # one 422
    assert post_safetensors(client, url, make_inputs([2])).status_code == 200
    text = client.get(url + "/metrics").text
    samples = metric_samples(text)
    assert samples[("flash_qla_requests_total", (("status", "422"),))] >= 1
    assert samples[("flash_qla_requests_total", (("status", "200"),))] >= 1
    assert samples[("flash_qla_ready", ())] == 1
    assert ("flash_qla_queue_depth", ()) in samples
    for histogram in ("flash_qla_queue_seconds", "flash_qla_kernel_seconds", "flash_qla_request_seconds",
                      "flash_qla_batch_tokens", "flash_qla_batch_requests"):
        assert samples[(histogram + "_count", ())] >= 1, histogram

    assert client.get(url + "/docs").status_code == 200
    spec = client.get(url + "/openapi.json").json()
    content = spec["paths"]["/v1/prefill"]["post"]["requestBody"]["content"]
    assert set(content) == {"application/json", "application/octet-stream"}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the not-ready answer of a host without a GPU")
def test_kernels_backend_without_gpu_is_not_ready_503():
    """`python -m server --backend kernels` on a CPU host starts, stays up, and answers 503 with the reason."""
    port = _free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, "-m", "server", "--backend", "kernels", "--port", str(port),
                             "--log-level", "warning"], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=5.0) as c:
            def ready_verdict():
                try:
                    r = c.get(url + "/ready")
                except httpx.TransportError:
                    return False
                return r.status_code == 503 and r.json()["reason"] != "starting"
            assert wait_until(ready_verdict, 60), proc.stderr.read1().decode() if proc.poll() is not None else ""
            assert c.get(url + "/health").status_code == 200
            ready = c.get(url + "/ready").json()
            assert ready == {**ready, "ready": False, "backend": "kernels", "reason": "no_gpu"}
            r = post_safetensors(c, url, make_inputs([4]))
            assert r.status_code == 503 and r.json()["detail"]["reason"] == "no_gpu"
            metrics = metric_samples(c.get(url + "/metrics").text)
            assert metrics[("flash_qla_ready", ())] == 0
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_server_never_answers_500_to_garbage(reference_server, client):
    url = reference_server.url + "/v1/prefill"
    bodies = [(b"", "application/json"), (b"null", "application/json"), (b"[]", "application/json"),
              (b'{"q": 1e999}', "application/json"), (b"", "application/octet-stream"),
              (b"\x08" + b"\0" * 7 + b"{\"a\":1}", "application/octet-stream"),
              (json.dumps(json_body(make_inputs([3]), scale=float("inf"))).encode(), "application/json")]
    for body, content_type in bodies:
        r = client.post(url, content=body, headers={"content-type": content_type})
        assert 400 <= r.status_code < 500, (body[:40], r.status_code, r.text)


# -- units: merge/split and the batcher without HTTP ----------------------------------------------------------------

def _prepared(lengths, seed, **kwargs):
    x = make_inputs(lengths, seed=seed, with_state=kwargs.pop("with_state", False))
    return x, prepare_request(dict(x), kwargs.get("scale"), kwargs.get("l2norm", False), True)


def test_merge_then_split_equals_separate_launches():
    import flash_qla
    pairs = [_prepared([3, 5], 1, with_state=True), _prepared([7], 2), _prepared([1, 1, 4], 3, with_state=True)]
    requests = [r for _, r in pairs]
    batch = merge_requests(requests)
    assert batch.cu_seqlens.tolist() == [0, 3, 8, 15, 16, 17, 21]
    assert batch.initial_state.shape == (6, HV, K, V) and batch.initial_state[2].abs().sum() == 0
    o, final = flash_qla.chunk_gated_delta_rule(batch.q, batch.k, batch.v, batch.g, batch.beta, scale=batch.scale,
                                                initial_state=batch.initial_state, output_final_state=True,
                                                cu_seqlens=batch.cu_seqlens, backend="reference")
    for (x, _), result in zip(pairs, split_outputs(batch, requests, o, final)):
        o_ref, final_ref = expected(x)
        assert relative_l2(result.o, o_ref) < TOLERANCE and relative_l2(result.final_state, final_ref) < TOLERANCE


def test_batcher_merges_by_key_within_the_token_budget_and_shares_errors():
    launched = []

    def launch(requests):
        launched.append([r.num_tokens for r in requests])
        if any(r.scale == 0.5 for r in requests):
            raise ValueError("q is wrong somehow")
        return [PrefillResult(torch.full((r.num_tokens,), float(r.num_tokens)), None) for r in requests]

    async def scenario():
        batcher = DynamicBatcher(launch, ServiceMetrics(), max_batch_tokens=20, max_wait_s=0.05, max_queue=100)
        batcher.start()
        try:
            same = [_prepared([n], i)[1] for i, n in enumerate([4, 5, 6, 7])]    # 22 tokens > budget 20
            other = _prepared([3], 9, l2norm=True)[1]                            # another key
            failing = [_prepared([2], 10 + i, scale=0.5)[1] for i in range(2)]
            results = await asyncio.wait_for(asyncio.gather(
                *(batcher.submit(r) for r in same + [other] + failing), return_exceptions=True), 10)
        finally:
            await batcher.stop()
        return results

    results = asyncio.run(scenario())
    assert [r.o[0].item() for r in results[:5]] == [4, 5, 6, 7, 3]
    assert all(isinstance(r, ValueError) for r in results[5:])
    assert sorted(map(sorted, launched)) == sorted([[4, 5, 6], [7], [3], [2, 2]])


def test_batcher_releases_every_request_once_and_withdraws_what_timed_out():
    """Each submitted request reaches ``done`` exactly once: after its launch, or when it leaves without one
    (timed out while waiting, refused by a full queue, dropped at stop). A timed-out request never launches."""
    released, launched = [], []
    gate = threading.Event()

    def launch(requests):
        gate.wait(10)
        launched.extend(requests)
        return [PrefillResult(r.q, None) for r in requests]

    async def scenario():
        batcher = DynamicBatcher(launch, ServiceMetrics(), max_batch_tokens=1000, max_wait_s=0.0, max_queue=2,
                                 done=released.extend)
        batcher.start()
        try:
            first = _prepared([2], 1)[1]
            running = asyncio.ensure_future(batcher.submit(first))  # launches at once, held by the gate
            assert await asyncio.to_thread(wait_until, lambda: batcher.queue_depth == 0 and released == [] and
                                           batcher.launches == 1, 5)
            late = _prepared([3], 2)[1]
            with pytest.raises(TimeoutError):
                await batcher.submit(late, timeout=0.05)           # waits behind the held launch, then gives up
            assert released == [late] and batcher.queue_depth == 0
            waiting = [asyncio.ensure_future(batcher.submit(_prepared([4], 3 + i)[1])) for i in range(2)]
            await asyncio.sleep(0.05)
            refused = _prepared([5], 9)[1]
            with pytest.raises(QueueFull):
                await batcher.submit(refused)
            assert released == [late, refused]
            gate.set()
            assert (await running).o is first.q
            await asyncio.gather(*waiting)
        finally:
            gate.set()
            await batcher.stop()
        return waiting

    waiting = asyncio.run(scenario())
    assert [r.num_tokens for r in launched] == [2, 4, 4]  # the timed-out request never ran
    assert len(released) == 5 and len({id(r) for r in released}) == 5
    assert all(w.done() for w in waiting)


def test_batcher_stop_answers_waiting_requests_shutting_down():
    released = []

    async def scenario():
        batcher = DynamicBatcher(lambda rs: [PrefillResult(r.q, None) for r in rs], ServiceMetrics(),
                                 max_batch_tokens=1000, max_wait_s=30.0, max_queue=10, done=released.extend)
        batcher.start()
        request = _prepared([2], 1)[1]
        waiting = asyncio.ensure_future(batcher.submit(request))
        await asyncio.sleep(0.05)
        await batcher.stop()
        with pytest.raises(NotReady, match="shutting down"):
            await waiting
        return request

    request = asyncio.run(scenario())
    assert released == [request]


def _st_tensors(dtype, gen):
    return {"o": torch.randn(5, 3, 7, generator=gen).to(dtype),
            "final_state": torch.randn(2, 3, 4, 4, generator=gen).to(dtype)[:, :, 1:3, :].contiguous(),
            "empty": torch.zeros(0, 3, dtype=dtype)}


def test_safetensors_views_write_files_safetensors_reads():
    """Answers are sent as a header and the tensors' own bytes; joined, they are a safetensors file that the
    library reads back exactly (every dtype an answer has, an empty tensor, metadata or none)."""
    from safetensors.torch import load

    from server.codec import safetensors_metadata
    from server.safetensors_views import dump_buffers
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        tensors = _st_tensors(dtype, gen)
        for metadata in (None, {"session_tokens": "[5, 0]"}):
            buffers = dump_buffers(tensors, metadata)
            header_len = int.from_bytes(buffers[0][:8], "little")
            assert (8 + header_len) % 8 == 0 and len(buffers[0]) == 8 + header_len
            body = b"".join(buffers)
            loaded = load(body)
            assert loaded.keys() == tensors.keys()
            assert all(loaded[n].dtype == t.dtype and torch.equal(loaded[n], t) for n, t in tensors.items())
            assert safetensors_metadata(body) == (metadata or {})
    sliced = torch.arange(24.0).reshape(6, 4)[2:5]  # a launch's outputs are slices of one buffer
    assert torch.equal(load(b"".join(dump_buffers({"o": sliced})))["o"], sliced)
    with pytest.raises(ValueError, match="host tensor"):
        dump_buffers({"o": torch.zeros(2, dtype=torch.complex64)})


def test_safetensors_views_read_files_safetensors_writes_as_views():
    """A request's tensors are views of its body (no copy), equal to what safetensors wrote."""
    from safetensors.torch import save

    from server.safetensors_views import load_views
    gen = torch.Generator().manual_seed(4)
    tensors = {**_st_tensors(torch.bfloat16, gen), "cu": torch.tensor([0, 3, 5]), "x32": torch.randn(3, 2),
               "flags": torch.tensor([True, False])}
    body = bytearray(save(tensors, metadata={"scale": "0.5"}))
    views, metadata = load_views(body)
    assert metadata == {"scale": "0.5"} and views.keys() == tensors.keys()
    assert all(views[n].dtype == t.dtype and torch.equal(views[n], t) for n, t in tensors.items())
    base = torch.frombuffer(body, dtype=torch.uint8).data_ptr()
    assert all(base <= v.data_ptr() < base + len(body) for v in views.values() if v.numel())


def test_safetensors_views_refuse_what_safetensors_refuses():
    """Each malformed file is a SafetensorsFormatError naming the problem (the service answers 422 on body)."""
    import struct

    from safetensors import SafetensorError
    from safetensors.torch import load, save

    from server.safetensors_views import SafetensorsFormatError, load_views
    good = save({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.int64)})
    n = struct.unpack_from("<Q", good)[0]
    header = json.loads(good[8:8 + n])

    def with_header(h, data=None):
        text = json.dumps(h).encode()
        return struct.pack("<Q", len(text)) + text + (good[8 + n:] if data is None else data)

    bad = {
        "too short": b"\x01\x00",
        "header length": struct.pack("<Q", 10 ** 6) + b"{}",
        "not JSON": struct.pack("<Q", 3) + b"{x}",
        "not a JSON object": with_header([1, 2]),
        "dtype": with_header({**header, "a": {**header["a"], "dtype": "Q7"}}),
        "shape": with_header({**header, "a": {**header["a"], "shape": [2, -3]}}),
        "data_offsets": with_header({**header, "a": {**header["a"], "data_offsets": [8, 4]}}),
        "bytes for shape": with_header({**header, "a": {**header["a"], "shape": [3, 3]}}),
        "tile": with_header({**header, "b": {**header["b"], "data_offsets": [header["b"]["data_offsets"][0] + 8,
                                                                             header["b"]["data_offsets"][1] + 8]}}),
        "the file has": good + b"\0" * 8,
        "__metadata__": with_header({**header, "__metadata__": {"k": 1}}),
    }
    for reason, body in bad.items():
        with pytest.raises(SafetensorsFormatError, match=reason):
            load_views(bytearray(body))
        with pytest.raises(SafetensorError):  # as safetensors does
            load(bytes(body))


# -- the readiness probe's reasons on hosts this CI machine is not ---------------------------------------------------

def test_probe_reports_wrong_compute_capability(monkeypatch):
    from server import readiness
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    verdict = readiness.probe("kernels")
    assert not verdict.ready and verdict.reason == "wrong_compute_capability" and "8.0" in verdict.message


def test_probe_reports_kernels_that_do_not_load(monkeypatch):
    from server import readiness
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(sys.modules, "flash_qla.kernel_api", None)  # import fails as if the library were missing
    monkeypatch.delattr(flash_qla, "kernel_api", raising=False)     # ...even when another test imported it already
    verdict = readiness.probe("kernels")
    assert not verdict.ready and verdict.reason == "kernels_unavailable"
