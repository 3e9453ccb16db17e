"""Run the service on loopback in a background thread (tests, benchmarks, notebooks)."""
from __future__ import annotations

import socket
import threading
import time
from typing import Optional

import uvicorn

from .app import create_app
from .config import ServiceConfig


class BackgroundServer:
    """``with BackgroundServer(config) as server: httpx.get(server.url + "/health")``.

    The socket is bound before uvicorn starts (port 0 = an ephemeral port), so the URL is known at once and
    no other process can take the port in between.
    """

    def __init__(self, config: ServiceConfig, startup_timeout_s: float = 30.0):
        self.config = config
        self.app = create_app(config)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((config.host, config.port))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://{config.host}:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on",
                                                     timeout_keep_alive=config.timeout_keep_alive_s))
        self._thread: Optional[threading.Thread] = None
        self._startup_timeout_s = startup_timeout_s

    @property
    def service(self):
        """The app's shared state (batcher, metrics, readiness), for white-box checks."""
        return self.app.state.service

    def start(self) -> "BackgroundServer":
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="flash-qla-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the service did not start within {self._startup_timeout_s} s")
            time.sleep(0.01)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Wait until the readiness probe has a verdict (ready or not); True when ready."""
        deadline = time.monotonic() + timeout_s
        while self.service.ready.reason == "starting" and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.service.ready.ready

    def stop(self, timeout_s: float = 10.0) -> None:
        """A graceful shutdown, as on SIGTERM: open requests finish, sessions are written to the state dir."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
