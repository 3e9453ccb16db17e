"""Service settings (filled by the command line, or directly by tests and embedders)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

BACKENDS = ("kernels", "reference")

# The reference backend computes on the CPU in float32; head dims above this are refused (422) because a
# single sequence's state (Hv x K x V) grows with their product and nothing useful runs there.
REFERENCE_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class ServiceConfig:
    backend: str = "kernels"
    host: str = "127.0.0.1"           # loopback unless the operator asks otherwise
    port: int = 8000
    max_batch_tokens: int = 32768     # token budget of one merged launch (and of one request)
    max_seqs_per_request: int = 1024
    max_body_mb: float = 64.0
    max_request_mb: float = 4096.0    # estimated memory of one request, and of one merged launch
    max_queue: int = 1024             # requests waiting for a launch before 429
    batch_wait_ms: float = 2.0        # how long the oldest waiting request may wait for company
    request_timeout_s: float = 60.0   # queue + launch time before 504
    api_key: Optional[str] = None     # bearer token for /v1/* and /metrics; None = open
    # sessions
    max_state_mb: float = 4096.0      # session states held on the backend's device (the state pool)
    state_dir: Optional[Path] = None  # LRU spill and shutdown snapshot; None = sessions live in memory only
    session_ttl_s: Optional[float] = None      # idle time after which a session expires; None = never
    max_sessions: int = 1_000_000
    # transport and host
    timeout_keep_alive_s: float = 75.0         # longer than clients' idle-connection expiry (httpx: 5 s)
    threads: Optional[int] = None              # torch intra-op threads; None = 1 (reference) / up to 4 (kernels)
    echo_endpoint: bool = False                # POST /v1/echo: the transport's own limit, for benchmarks

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("max_batch_tokens", "max_seqs_per_request", "max_queue", "max_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_body_mb", "max_request_mb", "request_timeout_s", "max_state_mb", "timeout_keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {self.batch_wait_ms}")
        if self.session_ttl_s is not None and not self.session_ttl_s > 0:
            raise ValueError(f"session_ttl_s must be > 0 (or None for no expiry), got {self.session_ttl_s}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.state_dir is not None:
            object.__setattr__(self, "state_dir", Path(self.state_dir))

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * 1024 * 1024)

    @property
    def max_state_bytes(self) -> int:
        return int(self.max_state_mb * 1024 * 1024)

    @property
    def torch_threads(self) -> int:
        """Intra-op threads of torch's CPU work: the reference's math, or the kernels backend's host copies.
        One thread keeps the reference steady on a shared host (torch's default of one thread per core
        spins against other processes)."""
        if self.threads is not None:
            return self.threads
        return 1 if self.backend == "reference" else max(1, min(4, os.cpu_count() or 1))
