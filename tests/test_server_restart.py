"""`python -m server` as its own process: SIGTERM writes every session to --state-dir and a restart continues
them exactly; SIGKILL (a crash) loses exactly the sessions the docs say (those resident in the pool), which then
answer 404, never a stale or zero state."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

# the service's extras ([server,test]): without them (a GPU machine with the kernels only) these tests skip, named
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
import torch

from server.background import BackgroundServer
from server.client import PrefillClient, PrefillError
from server.config import ServiceConfig
from test_server import REPO_ROOT, _free_port, expected, make_inputs, metric_samples, wait_until
from test_server_sessions import STATE_BYTES, assert_close, prefill, split


class ServerProcess:
    def __init__(self, state_dir, *extra):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--backend", "reference", "--port", str(self.port),
             "--state-dir", str(state_dir), "--max-state-mb", repr(2 * STATE_BYTES / 2**20), "--batch-wait-ms", "1",
             "--log-level", "warning", *extra],
            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def ready():
            try:
                return httpx.get(self.url + "/ready", timeout=2.0).status_code == 200
            except httpx.TransportError:
                return False
        if not wait_until(lambda: ready() or self.proc.poll() is not None, 90) or self.proc.poll() is not None:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {self.proc.communicate(timeout=10)[1].decode()[-2000:]}")

    def stop(self, sig) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(10)


def test_sigterm_restart_and_crash(tmp_path, procs):
    inputs = [make_inputs([60], seed=500 + i) for i in range(3)]
    parts = [split(x, [17, 41]) for x in inputs]
    refs = [expected(x) for x in inputs]
    outs = [[] for _ in inputs]

    a = ServerProcess(tmp_path, "--threads", "2")
    procs.append(a)
    assert metric_samples(httpx.get(a.url + "/metrics").text)[("flash_qla_torch_threads", ())] == 2
    with PrefillClient(a.url) as c:
        sids = [c.create_session() for _ in inputs]
        for i in range(3):               # a pool of two rows: the third turn spills the first session
            outs[i].append(prefill(c, parts[i][0], [sids[i]]).o)
        assert c.session(sids[0])["location"] == "disk"
    # uvicorn shuts down gracefully, then re-raises the signal: the exit status is that of SIGTERM
    assert a.stop(signal.SIGTERM) == -signal.SIGTERM
    assert all((tmp_path / f"{s}.safetensors").exists() for s in sids)

    b = ServerProcess(tmp_path)
    procs.append(b)
    with PrefillClient(b.url) as c:
        assert [c.session(s)["tokens"] for s in sids] == [17, 17, 17]
        for i in range(3):               # each read back from disk; the first is spilled again by the third
            outs[i].append(prefill(c, parts[i][1], [sids[i]]).o)
        assert [c.session(s)["location"] for s in sids] == ["disk", "pool", "pool"]
        assert_close(torch.cat(outs[1]), refs[1][0][:41])
    b.stop(signal.SIGKILL)               # a crash: the pool's rows are gone

    # the restart after the crash runs in this process (the same app and uvicorn, a faster start)
    config = ServiceConfig(backend="reference", port=0, batch_wait_ms=1, max_state_mb=2 * STATE_BYTES / 2**20,
                           state_dir=tmp_path)
    with BackgroundServer(config) as restarted, PrefillClient(restarted.url) as c:
        assert restarted.wait_ready(30)
        outs[0].append(prefill(c, parts[0][2], [sids[0]]).o)   # the spilled session survived the crash
        assert_close(torch.cat(outs[0]), refs[0][0])
        assert_close(c.get_state(sids[0]), refs[0][1][0])
        for lost in sids[1:]:
            with pytest.raises(PrefillError) as e:
                prefill(c, parts[1][2], [lost])
            assert e.value.status == 404 and e.value.reason == "session_not_found"
    assert (tmp_path / f"{sids[0]}.safetensors").exists()


def test_cli_rejects_bad_flags_without_a_traceback():
    cases = [(["--port", "99999"], "1..65535"), (["--port", "http"], "expected an integer"),
             (["--max-body-mb", "-1"], "> 0"), (["--max-state-mb", "0"], "> 0"), (["--threads", "0"], ">= 1"),
             (["--timeout-keep-alive", "inf"], "finite"), (["--batch-wait-ms", "-2"], "> 0"),
             (["--session-ttl-s", "nan"], "finite")]
    for argv, message in cases:
        done = subprocess.run([sys.executable, "-m", "server", *argv], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2, (argv, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr, (argv, done.stderr)


def test_missing_server_extra_names_it():
    """Without fastapi (blocked from import) the command says which extra to install, not ModuleNotFoundError."""
    code = ("import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None; "
            "from server.cli import main; main(['--backend', 'reference'])")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "[server] extra" in done.stderr and "pip install 'flash-qla-aot[server]'" in done.stderr
    assert "fastapi" in done.stderr and "Traceback" not in done.stderr


def test_idle_keep_alive_connections_outlive_the_client_pool_expiry():
    """The server keeps idle connections longer than httpx's 5 s pool expiry (default 75 s), so a client never
    reuses a connection the server is closing; with --timeout-keep-alive 0.5 it closes them after 0.5 s."""
    from server.cli import parse_args
    assert parse_args(["--backend", "reference"]).timeout_keep_alive_s > 5.0
    with BackgroundServer(ServiceConfig(backend="reference", port=0, timeout_keep_alive_s=0.5)) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):
                answer += sock.recv(4096)
            assert b"200 OK" in answer
            started = time.monotonic()
            assert sock.recv(4096) == b""            # the server closed the idle connection
            assert 0.3 < time.monotonic() - started < 3.0
