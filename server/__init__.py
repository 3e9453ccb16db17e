"""HTTP prefill service for flash_qla: ``python -m server`` or the ``flash-qla-serve`` console script.

Modules, one job each:
* :mod:`.config`        the settings the command line fills in
* :mod:`.schemas`       pydantic models of the JSON bodies and the error/probe answers (they drive /docs)
* :mod:`.codec`         request/response bodies <-> tensors (JSON nested lists, or a safetensors file)
* :mod:`.prefill`       one decoded request: checks through flash_qla.validation, the key it batches under
* :mod:`.limits`        admission limits: head dims per backend, the per-request memory estimate
* :mod:`.merge`         many requests -> one varlen launch, and the launch's outputs -> each caller's slices
* :mod:`.batcher`       the dynamic batcher (token / memory budget + short deadline, per-session order)
* :mod:`.engine`        runs a merged launch on the chosen backend, sessions' states in and out of the pool
* :mod:`.state_pool`    the device tensor holding resident session states, one row per session
* :mod:`.sessions`      the session store: lifetimes, LRU spill to disk, shutdown snapshot and restore
* :mod:`.state_files`   one session per safetensors file under --state-dir
* :mod:`.session_routes` the /v1/sessions routes
* :mod:`.readiness`     the /ready probe: GPU checks and a tiny launch checked against the reference
* :mod:`.errors`        the service's error types and the HTTP answers they become
* :mod:`.body_limit`    one JSON 413 for every over-limit body
* :mod:`.metrics`       Prometheus metrics
* :mod:`.auth`          the optional bearer token
* :mod:`.app`           the FastAPI application
* :mod:`.cli`           command-line entry point (uvicorn)
* :mod:`.extra`         the check that the ``server`` extra is installed
* :mod:`.client`        a Python client (sessions, safetensors, retries on 429 / 503)
* :mod:`.background`    the service on loopback in a background thread (tests, benchmarks)

The package imports nothing of the ``server`` extra until one of its names is used, so ``flash-qla-serve``
without the extra can say which packages are missing.
"""
from __future__ import annotations

__all__ = ["create_app", "ServiceConfig", "PrefillClient"]


def __getattr__(name):
    if name == "create_app":
        from .app import create_app
        return create_app
    if name == "ServiceConfig":
        from .config import ServiceConfig
        return ServiceConfig
    if name == "PrefillClient":
        from .client import PrefillClient
        return PrefillClient
    raise AttributeError(f"module 'server' has no attribute {name!r}")
