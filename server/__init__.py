"""HTTP prefill service for flash_qla: ``python -m server`` or the ``flash-qla-serve`` console script.

Modules, one job each:
* :mod:`.config`    the settings the command line fills in
* :mod:`.schemas`   pydantic models of the JSON body and the error/probe answers (they drive /docs)
* :mod:`.codec`     request/response bodies <-> tensors (JSON nested lists, or a safetensors file)
* :mod:`.prefill`   one decoded request: checks through flash_qla.validation, the key it batches under
* :mod:`.merge`     many requests -> one varlen launch, and the launch's outputs -> each caller's slices
* :mod:`.batcher`   the dynamic batcher (token budget + short deadline, launches on a worker thread)
* :mod:`.engine`    runs a merged launch on the chosen backend
* :mod:`.readiness` the /ready probe: GPU checks and a tiny launch checked against the reference
* :mod:`.errors`    the service's error types and the HTTP answers they become
* :mod:`.metrics`   Prometheus metrics
* :mod:`.auth`      the optional bearer token
* :mod:`.app`       the FastAPI application
* :mod:`.cli`       command-line entry point (uvicorn)
* :mod:`.background` the service on loopback in a background thread (tests, benchmarks)
"""
from .app import create_app
from .config import ServiceConfig

__all__ = ["create_app", "ServiceConfig"]
