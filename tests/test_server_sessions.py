"""Sessions of the prefill service, end to end on the reference backend: real uvicorn servers on 127.0.0.1.

A session's sequence split over several requests must equal the one-shot answer to fp32 round-off, whether the
state stayed in the pool, went to disk and back (LRU eviction), or crossed a graceful restart.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

# the service's extras ([server,test]): without them (a GPU machine with the kernels only) these tests skip, named
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
import torch
from safetensors.torch import load as load_safetensors

from flash_qla.reference import relative_l2
from server.background import BackgroundServer
from server.client import PrefillClient, PrefillError
from server.codec import encode_safetensors_request, safetensors_metadata
from server.config import ServiceConfig
from server.sessions import SessionStore
from test_server import CLIENT_TIMEOUT, HQ, HV, K, TOLERANCE, V, expected, make_inputs, wait_until

STATE_BYTES = HV * K * V * 4


def split(x, bounds):
    """One sequence's tensors cut at token offsets ``bounds`` into consecutive one-sequence requests."""
    edges = [0, *bounds, x["q"].shape[0]]
    parts = []
    for t0, t1 in zip(edges[:-1], edges[1:]):
        part = {n: x[n][t0:t1] for n in ("q", "k", "v", "g", "beta")}
        part["cu_seqlens"] = torch.tensor([0, t1 - t0], dtype=torch.int64)
        parts.append(part)
    return parts


def prefill(client: PrefillClient, part, session_ids, **options):
    return client.prefill(*(part[n] for n in ("q", "k", "v", "g", "beta")), part["cu_seqlens"],
                          session_ids=session_ids, **options)


def assert_close(actual, reference):
    assert actual.shape == reference.shape
    assert relative_l2(actual, reference) < TOLERANCE, relative_l2(actual, reference)


@pytest.fixture(scope="module")
def server():
    config = ServiceConfig(backend="reference", port=0, batch_wait_ms=5, max_batch_tokens=4096)
    with BackgroundServer(config) as s:
        assert s.wait_ready(30), s.service.ready
        yield s


@pytest.fixture
def client(server):
    with PrefillClient(server.url, timeout=30.0) as c:
        yield c


def test_three_requests_in_one_session_equal_the_one_shot_answer(server, client):
    x = make_inputs([150], seed=11)           # crosses chunk boundaries inside and between requests
    o_ref, final_ref = expected(x)
    one_shot = prefill(client, x, None)        # the service's own stateless answer, for the same comparison
    assert_close(one_shot.o, o_ref)

    sid = client.create_session()
    outs = []
    for i, part in enumerate(split(x, [37, 101])):
        out = prefill(client, part, [sid])
        assert out.final_state is None          # sessions keep their states; nothing comes back by default
        outs.append(out.o)
        assert out.session_tokens == [[37, 101, 150][i]]
    assert_close(torch.cat(outs), o_ref)
    assert_close(torch.cat(outs), one_shot.o)
    assert_close(client.get_state(sid), final_ref[0])
    info = client.session(sid)
    assert info["tokens"] == 150 and info["location"] == "pool"
    assert info["head_config"] == {"num_qk_heads": HQ, "num_v_heads": HV, "head_dim_k": K, "head_dim_v": V,
                                   "state_dtype": "float32"}


def test_two_sequences_of_one_request_continue_two_sessions(server, client):
    """Two packed sequences continuing two sessions, JSON encoding, final states asked for explicitly."""
    x = make_inputs([20, 33], seed=12)
    a, b = client.create_session(), client.create_session()
    body = {name: t.tolist() for name, t in x.items()}
    r = httpx.post(server.url + "/v1/prefill", json={**body, "session_ids": [a, b], "output_final_state": True},
                   timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    o_ref, final_ref = expected(x)
    assert_close(torch.tensor(r.json()["o"]), o_ref)
    assert_close(torch.tensor(r.json()["final_state"]), final_ref)
    assert r.json()["session_tokens"] == [20, 33]
    assert_close(client.get_state(a), final_ref[0])
    assert_close(client.get_state(b), final_ref[1])


def test_session_and_uploaded_state_requests_share_one_launch():
    """A session turn and a stateless request with its own initial state merged into one launch: both exact."""
    config = ServiceConfig(backend="reference", port=0, batch_wait_ms=300)
    with BackgroundServer(config) as server, PrefillClient(server.url) as client:
        assert server.wait_ready(30)
        sid = client.create_session()
        x, y = make_inputs([40], seed=17), make_inputs([7, 12], seed=18, with_state=True)
        first, second = split(x, [25])
        prefill(client, first, [sid])
        launches = server.service.batcher.launches
        with ThreadPoolExecutor(2) as pool:
            turn = pool.submit(prefill, client, second, [sid])
            stateless = pool.submit(client.prefill, *(y[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")),
                                    initial_state=y["initial_state"])
            turn, stateless = turn.result(30), stateless.result(30)
        assert server.service.batcher.launches - launches == 1
    o_ref, final_ref = expected(x)
    assert_close(turn.o, o_ref[25:])
    y_o, y_final = expected(y)
    assert_close(stateless.o, y_o)
    assert_close(stateless.final_state, y_final)


def test_session_errors_answer_404_409_422_with_reasons(server, client):
    x = make_inputs([5], seed=13)
    with pytest.raises(PrefillError) as e:
        prefill(client, x, ["A" * 22])
    assert e.value.status == 404 and e.value.reason == "session_not_found"
    with pytest.raises(PrefillError) as e:
        prefill(client, x, ["../../etc/passwd"])
    assert e.value.status == 404
    sid = client.create_session()
    with pytest.raises(PrefillError) as e:
        client.get_state(sid)
    assert e.value.status == 409 and e.value.reason == "no_state_yet"
    prefill(client, x, [sid])
    # another head configuration on the same session: 409, and the session is untouched
    other = {**x, "q": x["q"][:, :1], "k": x["k"][:, :1]}        # Hq 2 -> 1
    with pytest.raises(PrefillError) as e:
        prefill(client, other, [sid])
    assert e.value.status == 409 and e.value.reason == "session_config_mismatch" and "Hq=2" in e.value.message
    assert client.session(sid)["tokens"] == 5
    # session_ids with initial_state, a repeated id, or the wrong count: 422 naming session_ids
    two = make_inputs([3, 4], seed=14, with_state=True)
    for ids, body in (([sid, client.create_session()], two), ([sid, sid], {**two, "initial_state": None}),
                      ([sid], {**two, "initial_state": None})):
        r = httpx.post(server.url + "/v1/prefill", content=encode_safetensors_request(body, session_ids=ids),
                       headers={"content-type": "application/octet-stream"}, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "session_ids"], r.text
    client.delete_session(sid)
    with pytest.raises(PrefillError) as e:
        client.session(sid)
    assert e.value.status == 404
    with pytest.raises(PrefillError) as e:
        prefill(client, x, [sid])
    assert e.value.status == 404


def test_expired_session_is_404_with_reason_never_a_zero_state(server, client):
    x = make_inputs([4], seed=15)
    sid = client.create_session(ttl_s=1.0)
    prefill(client, x, [sid])
    threading.Event().wait(1.2)
    with pytest.raises(PrefillError) as e:
        prefill(client, x, [sid])
    assert e.value.status == 404 and e.value.reason == "session_expired"
    r = httpx.post(server.url + "/v1/sessions", json={"ttl_s": -1}, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "ttl_s"]


def test_requests_on_one_session_apply_in_arrival_order():
    """Eight turns of one session queued back to back before any runs: the batcher takes one per launch, in
    arrival order, so the outputs equal the one-shot answer's rows (a reordering would change them)."""
    x = make_inputs([8 * 6], seed=16)
    o_ref, _ = expected(x)
    parts = split(x, [6 * i for i in range(1, 8)])
    config = ServiceConfig(backend="reference", port=0, batch_wait_ms=400)
    with BackgroundServer(config) as server, PrefillClient(server.url) as client:
        assert server.wait_ready(30)
        sid = client.create_session()
        bodies = [encode_safetensors_request(p, session_ids=[sid]) for p in parts]
        answers = [None] * len(bodies)
        batcher = server.service.batcher
        launches_before = batcher.launches
        with httpx.Client(timeout=CLIENT_TIMEOUT, limits=httpx.Limits(max_connections=16)) as http:
            def send(i):
                answers[i] = http.post(server.url + "/v1/prefill", content=bodies[i],
                                       headers={"content-type": "application/octet-stream"})
            threads = []
            for i in range(len(bodies)):  # each send waits until the previous one is queued: arrival order = i
                threads.append(threading.Thread(target=send, args=(i,)))
                threads[-1].start()
                assert wait_until(lambda: batcher.queue_depth == i + 1, 5)
            for t in threads:
                t.join(30)
        assert batcher.launches - launches_before == 8
    assert all(a.status_code == 200 for a in answers)
    tokens = [json.loads(safetensors_metadata(a.content)["session_tokens"]) for a in answers]
    assert tokens == [[6 * (i + 1)] for i in range(8)]
    assert_close(torch.cat([load_safetensors(a.content)["o"] for a in answers]), o_ref)


def test_64_concurrent_clients_continue_their_own_sessions_exactly(server):
    """64 clients, each with its own session, three turns each at the same time; every answer equals the
    one-shot reference of that client's sequence, and every session holds all of its tokens."""
    clients, turns = 64, 3
    inputs = [make_inputs([9 + (5 * i) % 23], seed=1000 + i) for i in range(clients)]
    launches_before = server.service.batcher.launches

    def agent(i):
        with PrefillClient(server.url, timeout=60.0) as c:
            sid = c.create_session()
            x = inputs[i]
            T = x["q"].shape[0]
            outs = [prefill(c, part, [sid]).o for part in split(x, [T // 3, 2 * T // 3])]
            return sid, torch.cat(outs), c.get_state(sid), c.session(sid)["tokens"]

    with ThreadPoolExecutor(max_workers=clients) as pool:
        results = list(pool.map(agent, range(clients), timeout=120))
    for x, (sid, o, state, tokens) in zip(inputs, results):
        o_ref, final_ref = expected(x)
        assert_close(o, o_ref)
        assert_close(state, final_ref[0])
        assert tokens == x["q"].shape[0]
    launches = server.service.batcher.launches - launches_before
    assert launches < clients * turns, "no turns of different sessions were merged"


def test_the_event_loop_never_waits_for_a_busy_session_store(server, client):
    """While another thread holds the session store (a launch reading or writing a state file), a session turn
    is admitted on a request thread: the event loop keeps answering, and the turn completes, exact, once the
    store is free."""
    x = make_inputs([6], seed=950)
    o_ref, _ = expected(x)
    sid = client.create_session()
    store = server.service.store
    held, release = threading.Event(), threading.Event()

    def hold():
        with store._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        with ThreadPoolExecutor(1) as pool:
            turn = pool.submit(prefill, client, x, [sid])
            for _ in range(5):  # the loop answers while the turn waits for the store
                assert httpx.get(server.url + "/health", timeout=2.0).status_code == 200
            assert not turn.done()
            release.set()
            out = turn.result(timeout=10)
    finally:
        release.set()
        holder.join(10)
    assert_close(out.o, o_ref)
    assert out.session_tokens == [6] and client.session(sid)["tokens"] == 6


def test_eviction_to_disk_and_back_is_exact(tmp_path):
    """A pool of two states, five sessions taking turns: states go to disk and come back, answers exact."""
    config = ServiceConfig(backend="reference", port=0, batch_wait_ms=1, max_state_mb=2 * STATE_BYTES / 2**20,
                           state_dir=tmp_path)
    inputs = [make_inputs([45], seed=200 + i) for i in range(5)]
    with BackgroundServer(config) as server, PrefillClient(server.url) as client:
        assert server.wait_ready(30)
        sids = [client.create_session() for _ in inputs]
        outs = [[] for _ in inputs]
        for bounds in ([0, 15], [15, 30], [30, 45]):
            for i, x in enumerate(inputs):
                part = split(x, [bounds[0], bounds[1]])[1]
                outs[i].append(prefill(client, part, [sids[i]]).o)
        stats = server.service.store.stats()
        assert stats["spills"] >= 8 and stats["loads"] >= 6, stats
        assert stats["pool_bytes"] <= 2 * STATE_BYTES and stats["on_disk"] == 3
        on_disk = [s for s in sids if client.session(s)["location"] == "disk"]
        assert len(on_disk) == 3 and all((tmp_path / f"{s}.safetensors").exists() for s in on_disk)
        for i, x in enumerate(inputs):
            o_ref, final_ref = expected(x)
            assert_close(torch.cat(outs[i]), o_ref)
            assert_close(client.get_state(sids[i]), final_ref[0])


def test_full_pool_without_state_dir_is_507_and_nothing_is_lost():
    config = ServiceConfig(backend="reference", port=0, batch_wait_ms=1, max_state_mb=STATE_BYTES / 2**20)
    with BackgroundServer(config) as server, PrefillClient(server.url) as client:
        assert server.wait_ready(30)
        a, b = client.create_session(), client.create_session()
        x = make_inputs([6], seed=300)
        prefill(client, x, [a])
        with pytest.raises(PrefillError) as e:
            prefill(client, x, [b])
        assert e.value.status == 507 and e.value.reason == "state_memory_full" and "--state-dir" in e.value.message
        assert_close(client.get_state(a), expected(x)[1][0])
        client.delete_session(a)
        prefill(client, x, [b])  # the freed row takes the next session
        assert client.session(b)["tokens"] == 6


def test_graceful_restart_in_process_keeps_every_session(tmp_path):
    """Stop (the shutdown SIGTERM triggers) and start again on the same --state-dir, mid-sequence."""
    x = make_inputs([90], seed=400)
    o_ref, final_ref = expected(x)
    parts = split(x, [30, 60])
    config = ServiceConfig(backend="reference", port=0, batch_wait_ms=1, state_dir=tmp_path)
    outs = []
    with BackgroundServer(config) as server, PrefillClient(server.url) as client:
        assert server.wait_ready(30)
        sid = client.create_session()
        fresh = client.create_session()                 # no prefill yet: survives as a record
        outs.append(prefill(client, parts[0], [sid]).o)
    for part in parts[1:]:
        with BackgroundServer(config) as server, PrefillClient(server.url) as client:
            assert server.wait_ready(30)
            assert client.session(fresh)["location"] == "none"
            outs.append(prefill(client, part, [sid]).o)
    assert_close(torch.cat(outs), o_ref)
    with BackgroundServer(config) as server, PrefillClient(server.url) as client:
        assert_close(client.get_state(sid), final_ref[0])


def test_state_dir_takes_one_server_only(tmp_path):
    first = SessionStore(torch.device("cpu"), 2**20, tmp_path)
    first.open()
    try:
        with pytest.raises(RuntimeError, match="in use by another server"):
            SessionStore(torch.device("cpu"), 2**20, tmp_path).open()
    finally:
        first.close()


def test_unreadable_state_file_is_set_aside_not_read(tmp_path):
    (tmp_path / ("B" * 22 + ".safetensors")).write_bytes(b"garbage")
    store = SessionStore(torch.device("cpu"), 2**20, tmp_path)
    assert store.open() == 0
    store.close()
    assert (tmp_path / ("B" * 22 + ".safetensors.unreadable")).exists()


def _session_requests(store, lengths, seed):
    from server.prefill import prepare_request
    requests = []
    for i, n in enumerate(lengths):
        sid = store.create().session_id
        request = prepare_request(dict(make_inputs([n], seed=seed + i)), None, False, None, [sid])
        store.admit([sid], request.session_config)
        requests.append(request)
    return requests


def test_a_launch_makes_as_many_torch_calls_for_16_requests_as_for_2(monkeypatch):
    """The launch thread competes for the GIL with the event loop and the request threads, and every torch call
    releases and re-takes it: for sessions that hold a row, gather, merge, scatter and copies are one call per
    launch, not per request (only the answers' views are per request)."""
    from torch.overrides import TorchFunctionMode

    import flash_qla
    from server.engine import PrefillEngine

    calls = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__qualname__", str(func))
            if "getset_descriptor" not in name and "__getitem__" not in name:  # attributes and views
                calls.append(name)
            return func(*args, **(kwargs or {}))

    def kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
        return v, initial_state  # the kernels' own calls are not the launch thread's bookkeeping

    monkeypatch.setattr(flash_qla, "chunk_gated_delta_rule", kernel)
    store = SessionStore(torch.device("cpu"), 2**30)
    engine = PrefillEngine("reference", store)
    counts = []
    for n in (2, 16):
        requests = _session_requests(store, [3 + i for i in range(n)], seed=500 + n)
        engine.run(requests)  # the sessions' first turn gives each a zeroed row
        for request in requests:
            store.admit(request.session_ids, request.session_config)
        calls.clear()
        with Count():
            results = engine.run(requests)
        assert all(r.session_tokens == [2 * (3 + i)] for i, r in enumerate(results))
        counts.append(len(calls))
    assert counts[0] == counts[1], (counts, calls)


def test_merge_stacks_stored_uploaded_and_zero_states_in_request_order():
    from server.merge import merge_requests, session_rows
    from server.prefill import prepare_request
    store = SessionStore(torch.device("cpu"), 2**30)
    first, second = _session_requests(store, [4, 6], seed=600)
    uploaded = prepare_request(dict(make_inputs([2, 3], seed=610, with_state=True)), None, False, True)
    zero = prepare_request(dict(make_inputs([5], seed=620)), None, False, True)
    stored = torch.randn(2, HV, K, V)
    requests = [first, uploaded, zero, second]
    batch = merge_requests(requests, stored_states=stored)
    assert batch.cu_seqlens.tolist() == [0, 4, 6, 9, 14, 20] and batch.seq_offsets == [0, 1, 3, 4, 5]
    h0 = batch.initial_state
    assert torch.equal(h0[0], stored[0]) and torch.equal(h0[4], stored[1])
    assert torch.equal(h0[1:3], uploaded.initial_state) and not h0[3].any()
    assert torch.equal(session_rows(batch, requests, h0), stored)
    with pytest.raises(ValueError, match="stored_states"):
        merge_requests(requests)


def test_a_session_deleted_during_its_launch_keeps_its_row_until_the_launch_lets_go():
    """Another session of the same launch must not take the row: the launch's one scatter would write it twice."""
    store = SessionStore(torch.device("cpu"), 2**30)
    first, = _session_requests(store, [4], seed=800)
    lease = store.acquire(first.session_ids)
    store.delete(first.session_ids[0])
    second, = _session_requests(store, [4], seed=801)
    other = store.acquire(second.session_ids)
    assert other.slots != lease.slots
    store.release(lease)
    store.release(other)
    third, = _session_requests(store, [4], seed=802)
    assert store.acquire(third.session_ids).slots == lease.slots  # freed once the launch let go


def test_merge_moves_host_inputs_to_the_launch_device_in_one_copy_each():
    """Decoded inputs stay on the host until their launch, whose merge concatenates each input once and moves it
    to the launch device (the meta device stands in for a GPU); uploaded and zero states go with them."""
    from server.merge import merge_requests
    from server.prefill import prepare_request
    requests = [prepare_request(dict(make_inputs([n], seed=700 + n, with_state=n != 4)), None, False, True)
                for n in (8, 4, 6)]
    assert all(r.q.device.type == "cpu" for r in requests)
    batch = merge_requests(requests, torch.device("meta"))
    assert batch.q.is_meta and batch.q.shape == (1, 18, HQ, K) and batch.v.shape == (1, 18, HV, V)
    assert batch.initial_state.is_meta and batch.initial_state.shape == (3, HV, K, V)
    assert batch.cu_seqlens.tolist() == [0, 8, 12, 18]


@pytest.mark.gpu
def test_kernels_backend_session_turns_match_one_direct_call():
    """On an sm_90 GPU: three turns of a session (state in the device pool) against one kernels call over the
    whole sequence, at the kernels' bf16 bar."""
    import flash_qla
    gen = torch.Generator().manual_seed(7)
    T, Hq, Hv, D = 300, 2, 4, 128
    x = {"q": torch.nn.functional.normalize(torch.randn(T, Hq, D, generator=gen), dim=-1).bfloat16(),
         "k": torch.nn.functional.normalize(torch.randn(T, Hq, D, generator=gen), dim=-1).bfloat16(),
         "v": torch.randn(T, Hv, D, generator=gen).bfloat16(),
         "g": torch.nn.functional.logsigmoid(torch.randn(T, Hv, generator=gen)), "beta": torch.rand(T, Hv, generator=gen),
         "cu_seqlens": torch.tensor([0, T])}
    with torch.inference_mode():
        o_ref, final_ref = flash_qla.chunk_gated_delta_rule(
            *(x[n][None].cuda() for n in ("q", "k", "v", "g", "beta")), output_final_state=True,
            cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device="cuda"))
    with BackgroundServer(ServiceConfig(backend="kernels", port=0, batch_wait_ms=1)) as server, \
            PrefillClient(server.url) as client:
        assert server.wait_ready(120), server.service.ready
        sid = client.create_session()
        outs = [prefill(client, part, [sid]).o for part in split(x, [70, 199])]
        state = client.get_state(sid)
    assert relative_l2(torch.cat(outs).float(), o_ref[0].float().cpu()) < 2e-2
    assert relative_l2(state, final_ref[0].cpu()) < 2e-2
