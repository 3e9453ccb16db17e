#!/usr/bin/env python
"""Benchmark the prefill service against calling the Python API directly.

Starts ``python -m server`` on 127.0.0.1 (its own process, so the clients do not share its GIL), waits for
/ready, fires ``--clients`` concurrent clients with mixed sequence lengths for ``--duration-s`` seconds, then
runs the same requests through ``flash_qla.chunk_gated_delta_rule`` one call at a time in this process (with
the host<->device copies the service also does), and writes one JSON object with tokens/s and p50/p99 latency
of both.

GPU (the evidence run):   python scripts/service_bench.py --backend kernels --out bench/service_h100.json
CPU (does it work at all): python scripts/service_bench.py --backend reference --head-dim 16 --heads 2 4 \
                               --max-len 64 --clients 8 --duration-s 5 --out /tmp/service_cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import flash_qla  # noqa: E402
from flash_qla.reference import relative_l2  # noqa: E402
from server.codec import decode_safetensors_response, encode_safetensors_request  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("kernels", "reference"), default="kernels")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients")
    p.add_argument("--duration-s", type=float, default=20.0, help="how long each side is measured")
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--heads", type=int, nargs=2, default=(2, 8), metavar=("HQ", "HV"))
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="q/k/v dtype (default bfloat16 for kernels, float32 for reference)")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=2048, help="sequence lengths are drawn log-uniformly")
    p.add_argument("--max-seqs", type=int, default=4, help="1..max-seqs sequences per request")
    p.add_argument("--distinct-requests", type=int, default=64, help="payloads prepared up front and reused")
    p.add_argument("--max-batch-tokens", type=int, default=65536)
    p.add_argument("--batch-wait-ms", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON file (printed to stdout as well)")
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.backend == "kernels" else "float32")
    return args


def make_requests(args) -> List[Dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(args.seed)
    Hq, Hv = args.heads
    K = V = args.head_dim
    log_lo, log_hi = torch.log(torch.tensor(float(args.min_len))), torch.log(torch.tensor(float(args.max_len)))
    out = []
    for _ in range(args.distinct_requests):
        n = int(torch.randint(1, args.max_seqs + 1, (1,), generator=gen))
        lengths = torch.exp(log_lo + (log_hi - log_lo) * torch.rand(n, generator=gen)).round().long().tolist()
        T = sum(lengths)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
        x = {"q": torch.nn.functional.normalize(torch.randn(T, Hq, K, generator=gen), dim=-1),
             "k": torch.nn.functional.normalize(torch.randn(T, Hq, K, generator=gen), dim=-1),
             "v": torch.randn(T, Hv, V, generator=gen)}
        x = {name: t.to(DTYPES[args.dtype]) for name, t in x.items()}
        x.update(g=torch.nn.functional.logsigmoid(torch.randn(T, Hv, generator=gen)),
                 beta=torch.rand(T, Hv, generator=gen), cu_seqlens=cu,
                 initial_state=0.1 * torch.randn(n, Hv, K, V, generator=gen))
        out.append(x)
    return out


def percentiles(latencies_s: List[float]) -> Dict[str, float]:
    if not latencies_s:
        return {"p50_ms": None, "p99_ms": None, "mean_ms": None}
    ordered = sorted(latencies_s)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return {"p50_ms": pick(0.50), "p99_ms": pick(0.99), "mean_ms": statistics.fmean(ordered) * 1e3}


# -- the service ---------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server", "--backend", args.backend, "--host", "127.0.0.1", "--port", str(port),
           "--max-batch-tokens", str(args.max_batch_tokens), "--batch-wait-ms", str(args.batch_wait_ms),
           "--max-body-mb", "1024", "--max-queue", str(max(1024, 4 * args.clients)), "--log-level", "warning"]
    return subprocess.Popen(cmd, cwd=REPO_ROOT)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {proc.returncode}")
            try:
                r = client.get(url + "/ready")
                verdict = r.json()
                if r.status_code == 200:
                    return verdict
                if verdict.get("reason") != "starting":
                    raise RuntimeError(f"the server is not ready: {verdict}")
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"the server was not ready within {timeout_s} s")


async def drive_clients(url: str, bodies: List[bytes], tokens: List[int], clients: int, duration_s: float):
    """Each client posts the next payload as soon as its previous answer arrived, until the time is up."""
    latencies, statuses, done_tokens = [], {}, 0
    next_index = 0
    stop_at = time.perf_counter() + duration_s
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        async def one_client():
            nonlocal next_index, done_tokens
            while time.perf_counter() < stop_at:
                i = next_index % len(bodies)
                next_index += 1
                started = time.perf_counter()
                r = await client.post(url + "/v1/prefill", content=bodies[i],
                                      headers={"content-type": "application/octet-stream"})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - started)
                    done_tokens += tokens[i]

        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        elapsed = time.perf_counter() - started
    return {"requests": len(latencies), "tokens": done_tokens, "seconds": elapsed,
            "tokens_per_s": done_tokens / elapsed, "requests_per_s": len(latencies) / elapsed,
            "status_counts": {str(k): v for k, v in sorted(statuses.items())}, **percentiles(latencies)}


def launch_stats(url: str) -> Dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10.0).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    launches = samples.get("flash_qla_launches_total", 0.0)
    merged = samples.get("flash_qla_batch_requests_sum", 0.0)
    return {"launches": launches, "requests_launched": merged,
            "mean_requests_per_launch": merged / launches if launches else None,
            "mean_tokens_per_launch": samples.get("flash_qla_batch_tokens_sum", 0.0) / launches if launches else None}


# -- the Python API directly ---------------------------------------------------------------------------------------

def call_api(x: Dict[str, torch.Tensor], backend: str, device: torch.device):
    """One request as its own API call, with the host<->device copies the service also pays."""
    moved = {n: t.to(device, non_blocking=True) for n, t in x.items()}
    with torch.inference_mode():
        o, final = flash_qla.chunk_gated_delta_rule(
            *(moved[n][None] for n in ("q", "k", "v", "g", "beta")), initial_state=moved["initial_state"],
            output_final_state=True, cu_seqlens=moved["cu_seqlens"].to(torch.int32), backend=backend)
    return o[0].cpu(), final.cpu()  # .cpu() synchronises


def drive_api(requests, tokens: List[int], backend: str, device: torch.device, duration_s: float):
    latencies, done_tokens, i = [], 0, 0
    started = time.perf_counter()
    while time.perf_counter() - started < duration_s:
        t0 = time.perf_counter()
        call_api(requests[i % len(requests)], backend, device)
        latencies.append(time.perf_counter() - t0)
        done_tokens += tokens[i % len(requests)]
        i += 1
    elapsed = time.perf_counter() - started
    return {"requests": len(latencies), "tokens": done_tokens, "seconds": elapsed,
            "tokens_per_s": done_tokens / elapsed, "requests_per_s": len(latencies) / elapsed,
            **percentiles(latencies)}


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if args.backend == "kernels" else "cpu")
    requests = make_requests(args)
    tokens = [x["q"].shape[0] for x in requests]
    bodies = [encode_safetensors_request(x) for x in requests]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    try:
        readiness = wait_ready(url, proc)
        # one answer checked against the direct call: the service computes the same thing
        r = httpx.post(url + "/v1/prefill", content=bodies[0], timeout=120.0,
                       headers={"content-type": "application/octet-stream"})
        r.raise_for_status()
        o_srv, final_srv = decode_safetensors_response(r.content)
        o_api, final_api = call_api(requests[0], args.backend, device)
        agreement = {"o_rel_l2": relative_l2(o_srv, o_api), "final_state_rel_l2": relative_l2(final_srv, final_api)}
        if args.warmup_s > 0:
            asyncio.run(drive_clients(url, bodies, tokens, args.clients, args.warmup_s))
        before = launch_stats(url)
        service = asyncio.run(drive_clients(url, bodies, tokens, args.clients, args.duration_s))
        after = launch_stats(url)
        launches = after["launches"] - before["launches"]
        merged = after["requests_launched"] - before["requests_launched"]
        service["launches"] = launches
        service["mean_requests_per_launch"] = merged / launches if launches else None
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    if args.warmup_s > 0:
        drive_api(requests, tokens, args.backend, device, min(args.warmup_s, 2.0))
    direct = drive_api(requests, tokens, args.backend, device, args.duration_s)

    result = {
        "bench": "service_vs_direct_api",
        "backend": args.backend,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "flash_qla": flash_qla.__version__,
        "host_cpus": os.cpu_count(),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "out"},
        "requests_prepared": {"count": len(requests), "tokens_min": min(tokens), "tokens_max": max(tokens),
                              "tokens_mean": statistics.fmean(tokens)},
        "readiness": readiness,
        "service_vs_api_agreement": agreement,
        "service": service,
        "direct_api": direct,
        "service_over_direct_tokens_per_s": service["tokens_per_s"] / direct["tokens_per_s"],
    }
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
