"""Service settings (filled by the command line, or directly by tests and embedders)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

BACKENDS = ("kernels", "reference")


@dataclass(frozen=True)
class ServiceConfig:
    backend: str = "kernels"
    host: str = "127.0.0.1"           # loopback unless the operator asks otherwise
    port: int = 8000
    max_batch_tokens: int = 32768     # token budget of one merged launch (and of one request)
    max_seqs_per_request: int = 1024
    max_body_mb: float = 64.0
    max_queue: int = 1024             # requests waiting for a launch before 429
    batch_wait_ms: float = 2.0        # how long the oldest waiting request may wait for company
    request_timeout_s: float = 60.0   # queue + launch time before 504
    api_key: Optional[str] = None     # bearer token for /v1/prefill and /metrics; None = open

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("max_batch_tokens", "max_seqs_per_request", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_body_mb", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {self.batch_wait_ms}")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)
