"""Command line: ``python -m server`` / ``flash-qla-serve``.

Imports only the standard library at module level: without the ``server`` extra the command says which
packages to install instead of failing with an ImportError.
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import List, Optional

from .config import BACKENDS, ServiceConfig
from .extra import require_server_extra


def _port(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1..65535, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    if text.strip() in ("0", "0.0"):
        return 0.0
    return _positive_float(text)


def build_parser() -> argparse.ArgumentParser:
    d = ServiceConfig()
    p = argparse.ArgumentParser(prog="flash-qla-serve", description="flash_qla prefill service (FastAPI on uvicorn)")
    p.add_argument("--backend", choices=BACKENDS, default=d.backend,
                   help="kernels: sm_90a GPU (not ready without one); reference: pure PyTorch on the CPU")
    p.add_argument("--host", default=d.host, help="bind address (default loopback only)")
    p.add_argument("--port", type=_port, default=d.port, help=f"TCP port 1..65535 (default {d.port})")
    p.add_argument("--max-batch-tokens", type=_positive_int, default=d.max_batch_tokens,
                   help="token budget of one merged launch, and the most tokens one request may carry")
    p.add_argument("--max-seqs-per-request", type=_positive_int, default=d.max_seqs_per_request)
    p.add_argument("--max-body-mb", type=_positive_float, default=d.max_body_mb,
                   help="request body limit (413 body_too_large above)")
    p.add_argument("--max-request-mb", type=_positive_float, default=d.max_request_mb,
                   help="estimated memory one request (and one merged launch) may use: inputs, outputs, states, "
                        "workspace, encoded answer (413 request_memory above)")
    p.add_argument("--max-queue", type=_positive_int, default=d.max_queue,
                   help="requests waiting for a launch before new ones get 429")
    p.add_argument("--batch-wait-ms", type=_non_negative_float, default=d.batch_wait_ms,
                   help="how long the oldest waiting request waits for others to share its launch")
    p.add_argument("--request-timeout-s", type=_positive_float, default=d.request_timeout_s,
                   help="queue + launch time before 504")
    p.add_argument("--api-key", default=os.environ.get("FLASH_QLA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: $FLASH_QLA_API_KEY)")
    sessions = p.add_argument_group("sessions")
    sessions.add_argument("--max-state-mb", type=_positive_float, default=d.max_state_mb,
                          help="device memory of the session state pool; least recently used sessions move to "
                               "--state-dir beyond it (507 without a --state-dir)")
    sessions.add_argument("--state-dir", type=Path, default=None,
                          help="where sessions are spilled and written at shutdown (SIGTERM), and read back at "
                               "start; without it sessions live in memory only")
    sessions.add_argument("--session-ttl-s", type=_positive_float, default=None,
                          help="default idle time after which a session expires (default: never)")
    sessions.add_argument("--max-sessions", type=_positive_int, default=d.max_sessions)
    transport = p.add_argument_group("transport and host")
    transport.add_argument("--timeout-keep-alive", type=_positive_float, default=d.timeout_keep_alive_s,
                           help="seconds an idle keep-alive connection stays open; keep it above your clients' "
                                "idle-connection expiry (httpx: 5 s) so they never reuse a closing connection")
    transport.add_argument("--threads", type=_positive_int, default=None,
                           help="torch intra-op threads for CPU work (the reference backend's math, the kernels "
                                "backend's host copies); default 1 for reference, min(4, cores) for kernels")
    transport.add_argument("--echo-endpoint", action="store_true",
                           help="serve POST /v1/echo (benchmarks: the HTTP stack's own throughput)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def parse_args(argv: Optional[List[str]] = None) -> ServiceConfig:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        config = ServiceConfig(backend=args.backend, host=args.host, port=args.port,
                               max_batch_tokens=args.max_batch_tokens, max_seqs_per_request=args.max_seqs_per_request,
                               max_body_mb=args.max_body_mb, max_request_mb=args.max_request_mb,
                               max_queue=args.max_queue, batch_wait_ms=args.batch_wait_ms,
                               request_timeout_s=args.request_timeout_s, api_key=args.api_key,
                               max_state_mb=args.max_state_mb, state_dir=args.state_dir,
                               session_ttl_s=args.session_ttl_s, max_sessions=args.max_sessions,
                               timeout_keep_alive_s=args.timeout_keep_alive, threads=args.threads,
                               echo_endpoint=args.echo_endpoint)
    except ValueError as error:
        p.error(str(error))
    if config.state_dir is not None and config.state_dir.exists() and not config.state_dir.is_dir():
        p.error(f"--state-dir {config.state_dir} exists and is not a directory")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return config


def main(argv: Optional[List[str]] = None) -> None:
    config = parse_args(argv)
    require_server_extra()
    import torch
    import uvicorn

    from .app import create_app

    torch.set_num_threads(config.torch_threads)
    # uvicorn turns SIGTERM / SIGINT into a graceful shutdown: open requests finish, then the app's shutdown
    # writes every session to --state-dir.
    uvicorn.run(create_app(config), host=config.host, port=config.port,
                timeout_keep_alive=config.timeout_keep_alive_s,
                timeout_graceful_shutdown=config.request_timeout_s,
                log_level=logging.getLevelName(logging.getLogger().level).lower())


if __name__ == "__main__":
    main()
