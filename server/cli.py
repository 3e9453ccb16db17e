"""Command line: ``python -m server`` / ``flash-qla-serve``."""
from __future__ import annotations

import argparse
import logging
from typing import List, Optional

import uvicorn

from .app import create_app
from .config import BACKENDS, ServiceConfig


def parse_args(argv: Optional[List[str]] = None) -> ServiceConfig:
    defaults = ServiceConfig()
    p = argparse.ArgumentParser(prog="flash-qla-serve", description="flash_qla prefill service (FastAPI on uvicorn)")
    p.add_argument("--backend", choices=BACKENDS, default=defaults.backend,
                   help="kernels: sm_90a GPU (not ready without one); reference: pure PyTorch on the CPU")
    p.add_argument("--host", default=defaults.host, help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=defaults.port)
    p.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens,
                   help="token budget of one merged launch, and the most tokens one request may carry")
    p.add_argument("--max-seqs-per-request", type=int, default=defaults.max_seqs_per_request)
    p.add_argument("--max-body-mb", type=float, default=defaults.max_body_mb, help="request body limit (413 above)")
    p.add_argument("--max-queue", type=int, default=defaults.max_queue,
                   help="requests waiting for a launch before new ones get 429")
    p.add_argument("--batch-wait-ms", type=float, default=defaults.batch_wait_ms,
                   help="how long the oldest waiting request waits for others to share its launch")
    p.add_argument("--request-timeout-s", type=float, default=defaults.request_timeout_s,
                   help="queue + launch time before 504")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/prefill and /metrics")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = p.parse_args(argv)
    try:
        config = ServiceConfig(backend=args.backend, host=args.host, port=args.port,
                               max_batch_tokens=args.max_batch_tokens, max_seqs_per_request=args.max_seqs_per_request,
                               max_body_mb=args.max_body_mb, max_queue=args.max_queue,
                               batch_wait_ms=args.batch_wait_ms, request_timeout_s=args.request_timeout_s,
                               api_key=args.api_key)
    except ValueError as error:
        p.error(str(error))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return config


def main(argv: Optional[List[str]] = None) -> None:
    config = parse_args(argv)
    uvicorn.run(create_app(config), host=config.host, port=config.port,
                log_level=logging.getLevelName(logging.getLogger().level).lower())


if __name__ == "__main__":
    main()
