#!/usr/bin/env python
"""Throughput of the prefill service against its transport's own limit.

Starts ``python -m server --echo-endpoint`` on 127.0.0.1 and drives it with agent turns: each of ``--clients``
clients owns a session and sends short batches of new tokens (lengths log-uniform in [--min-len, --max-len]),
one turn after the other. The same bodies are then posted to ``/v1/echo``, which reads them and answers as many
bytes as the service answered, over the same HTTP stack (uvicorn, the app's middleware, auth): the throughput a
service with free compute would reach. Two modes are timed, each against its own echo:

* ``sessions``:  the turn names its session (session_ids); the state stays in the server's pool;
* ``stateless``: the turn uploads its initial state and downloads its final state (2 x Hv x K x V x 4 bytes more).

The clients run in ``--client-procs`` processes (so the client side is not the limit); phases alternate
echo / service for ``--rounds`` rounds. Writes one JSON object: tokens/s, requests/s, p50/p99 latency and bytes
per turn of every phase, the CPU time the server and the clients used (cores busy, and the server's per
request), and service/echo per mode. Before timing, eight concurrent agents' session turns (three each) and
stateless turns are checked against direct ``flash_qla.chunk_gated_delta_rule`` calls over the same tokens.
``--profile-dir`` adds, after the timed rounds, one service phase per mode under ``py-spy record --gil`` (which
thread holds Python's GIL, and where), written there as collapsed stacks.

GPU:  python scripts/service_bench.py --backend kernels --out bench/results/h100/service.json
CPU:  python scripts/service_bench.py --backend reference --heads 2 4 --head-dim 16 --min-len 4 --max-len 32 \\
          --clients 8 --client-procs 1 --duration-s 2 --rounds 1 --out /tmp/service_cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import flash_qla  # noqa: E402
from flash_qla.reference import relative_l2  # noqa: E402
from server.codec import encode_safetensors_request  # noqa: E402
from server.client import PrefillClient  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MODES = ("sessions", "stateless")
MAX_REL_L2 = 2e-2  # the kernels' bf16 bar against the same call (fp32 round-off on the reference)
OCTET = {"content-type": "application/octet-stream"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("kernels", "reference"), default="kernels")
    p.add_argument("--clients", type=int, default=64, help="concurrent agents, one session each")
    p.add_argument("--client-procs", type=int, default=4, help="processes the clients are spread over")
    p.add_argument("--turns-per-client", type=int, default=6, help="distinct turn payloads per client, cycled")
    p.add_argument("--duration-s", type=float, default=8.0, help="length of each timed phase")
    p.add_argument("--rounds", type=int, default=2, help="echo / service alternations per mode")
    p.add_argument("--heads", type=int, nargs=2, default=(16, 32), metavar=("HQ", "HV"))
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="q/k/v dtype (default bfloat16 for kernels, float32 for reference)")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512, help="new tokens of a turn, drawn log-uniformly")
    p.add_argument("--max-batch-tokens", type=int, default=65536)
    p.add_argument("--batch-wait-ms", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON file (printed to stdout as well)")
    p.add_argument("--profile-dir", type=Path, default=None,
                   help="after the timed rounds, record the server under py-spy --gil for one service phase per "
                        "mode (needs py-spy and the right to read the server's memory)")
    p.add_argument("--profile-s", type=float, default=5.0, help="length of each profiled phase")
    p.add_argument("--commit", default=None, help="the code's commit, recorded in the JSON")
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.backend == "kernels" else "float32")
    args.client_procs = max(1, min(args.client_procs, args.clients))
    return args


# -- the turns --------------------------------------------------------------------------------------------------

def turn_tensors(args, client: int, turn: int) -> Dict[str, torch.Tensor]:
    """One turn's new tokens (deterministic in (seed, client, turn), so every process builds the same ones)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + client * 1009 + turn)
    Hq, Hv = args.heads
    K = V = args.head_dim
    lo, hi = math.log(args.min_len), math.log(args.max_len)
    T = int(round(math.exp(lo + (hi - lo) * float(torch.rand((), generator=gen)))))
    x = {"q": torch.nn.functional.normalize(torch.randn(T, Hq, K, generator=gen), dim=-1),
         "k": torch.nn.functional.normalize(torch.randn(T, Hq, K, generator=gen), dim=-1),
         "v": torch.randn(T, Hv, V, generator=gen)}
    x = {n: t.to(DTYPES[args.dtype]) for n, t in x.items()}
    x.update(g=torch.nn.functional.logsigmoid(torch.randn(T, Hv, generator=gen)), beta=torch.rand(T, Hv, generator=gen),
             cu_seqlens=torch.tensor([0, T], dtype=torch.int64))
    return x


def turn_body(args, client: int, turn: int, mode: str, session_id: str) -> bytes:
    x = turn_tensors(args, client, turn)
    if mode == "sessions":
        return encode_safetensors_request(x, session_ids=[session_id])
    gen = torch.Generator().manual_seed(client * 7919 + turn)
    Hv, K = args.heads[1], args.head_dim
    x["initial_state"] = 0.1 * torch.randn(1, Hv, K, K, generator=gen)
    return encode_safetensors_request(x, output_final_state=True)


# -- the client processes ---------------------------------------------------------------------------------------

def _percentiles(latencies: List[float]) -> Dict[str, float]:
    if not latencies:
        return {"p50_ms": None, "p99_ms": None, "mean_ms": None}
    ordered = sorted(latencies)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return {"p50_ms": pick(0.50), "p99_ms": pick(0.99), "mean_ms": statistics.fmean(ordered) * 1e3}


async def _drive(url: str, turns: List[list], start_at: float, duration_s: float):
    """Each client posts its next turn as soon as its previous answer arrived, until the time is up."""
    latencies, statuses = [], {}
    tokens = sent = received = 0
    cpu_before = time.process_time()
    limits = httpx.Limits(max_connections=len(turns), max_keepalive_connections=len(turns))
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        async def one(client_turns):
            nonlocal tokens, sent, received
            j = 0
            while time.time() < start_at + duration_s:
                path, body, n_tokens = client_turns[j % len(client_turns)]
                j += 1
                t0 = time.perf_counter()
                r = await client.post(url + path, content=body, headers=OCTET)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)
                    tokens += n_tokens
                    sent += len(body)
                    received += len(r.content)

        await asyncio.sleep(max(0.0, start_at - time.time()))
        await asyncio.gather(*(one(t) for t in turns))
    return {"latencies": latencies, "statuses": statuses, "tokens": tokens, "sent": sent, "received": received,
            "cpu_s": time.process_time() - cpu_before}


def _worker(conn, args, clients: List[int], session_ids: Dict[int, str]):
    torch.set_num_threads(1)
    bodies = {(mode, c): [turn_body(args, c, j, mode, session_ids[c]) for j in range(args.turns_per_client)]
              for mode in MODES for c in clients}
    tokens = {c: [turn_tensors(args, c, j)["q"].shape[0] for j in range(args.turns_per_client)] for c in clients}
    conn.send({"ready": True})
    while True:
        command = conn.recv()
        if command is None:
            return
        mode, target, url, start_at, duration_s, answer_bytes = command
        turns = []
        for c in clients:
            per_client = []
            for j, body in enumerate(bodies[(mode, c)]):
                if target == "echo":
                    path = f"/v1/echo?response_bytes={answer_bytes[(mode, c, j)]}"
                else:
                    path = "/v1/prefill"
                per_client.append((path, body, tokens[c][j]))
            turns.append(per_client)
        conn.send(asyncio.run(_drive(url, turns, start_at, duration_s)))


# -- the server ------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server", "--backend", args.backend, "--host", "127.0.0.1", "--port", str(port),
           "--max-batch-tokens", str(args.max_batch_tokens), "--batch-wait-ms", str(args.batch_wait_ms),
           "--max-body-mb", "1024", "--max-queue", str(max(1024, 4 * args.clients)), "--echo-endpoint",
           "--log-level", "warning"]
    return subprocess.Popen(cmd, cwd=REPO_ROOT)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            r = httpx.get(url + "/ready", timeout=5.0)
            if r.status_code == 200:
                return r.json()
            if r.json().get("reason") != "starting":
                raise RuntimeError(f"the server is not ready: {r.json()}")
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server was not ready within {timeout_s} s")


def server_counters(url: str) -> Dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10.0).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def check_against_direct_call(args, url: str, agents: int = 8) -> Dict[str, float]:
    """Concurrent agents (so that their turns share launches): each continues its own session for three turns and
    sends one stateless turn from an uploaded state. Every answer against a direct call over the same tokens;
    the worst relative L2 of each kind is returned, and one over ``MAX_REL_L2`` stops the benchmark."""
    Hv, K = args.heads[1], args.head_dim
    names = ("q", "k", "v", "g", "beta", "cu_seqlens")

    def agent(i: int):
        parts = [turn_tensors(args, 10_000 + 10 * i + j, 0) for j in range(3)]
        h0 = 0.1 * torch.randn(1, Hv, K, K, generator=torch.Generator().manual_seed(20_000 + i))
        with PrefillClient(url) as client:
            sid = client.create_session()
            outs = [client.prefill(*(x[n] for n in names), session_ids=[sid]).o for x in parts]
            state = client.get_state(sid)
            client.delete_session(sid)
            stateless = client.prefill(*(parts[0][n] for n in names), initial_state=h0, output_final_state=True)
        return parts, outs, state, h0, stateless

    with ThreadPoolExecutor(agents) as pool:
        answers = list(pool.map(agent, range(agents)))
    device = torch.device("cuda" if args.backend == "kernels" else "cpu")

    def direct(x, h0=None):
        T = x["q"].shape[0]
        with torch.inference_mode():
            o, final = flash_qla.chunk_gated_delta_rule(
                *(x[n][None].to(device) for n in ("q", "k", "v", "g", "beta")), output_final_state=True,
                initial_state=None if h0 is None else h0.to(device),
                cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device=device), backend=args.backend)
        return o[0].cpu(), final.cpu()

    worst = {"o_rel_l2": 0.0, "final_state_rel_l2": 0.0, "stateless_o_rel_l2": 0.0,
             "stateless_final_state_rel_l2": 0.0}
    tokens = 0
    for parts, outs, state, h0, stateless in answers:
        whole = {n: torch.cat([x[n] for x in parts]) for n in ("q", "k", "v", "g", "beta")}
        tokens += whole["q"].shape[0]
        o, final = direct(whole)
        o1, final1 = direct(parts[0], h0)
        for key, value in (("o_rel_l2", relative_l2(torch.cat(outs), o)),
                           ("final_state_rel_l2", relative_l2(state, final[0])),
                           ("stateless_o_rel_l2", relative_l2(stateless.o, o1)),
                           ("stateless_final_state_rel_l2", relative_l2(stateless.final_state, final1))):
            worst[key] = max(worst[key], value)
    if max(worst.values()) > MAX_REL_L2:
        raise RuntimeError(f"the service's answers differ from direct calls: {worst}")
    return {"agents": agents, "tokens": tokens, **worst}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


PY_SPY_RATE = 250  # samples a second
THREAD_ROLES = (("MainThread", "event_loop"), ("flash-qla-launch", "launch_thread"),
                ("flash-qla-request", "request_threads"))


def py_spy_gil(pid: int, duration_s: float, out: Path) -> subprocess.Popen:
    """py-spy sampling which thread holds the GIL (and its stack) for ``duration_s``, into ``out``."""
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--gil", "--threads", "--nonblocking",
                             "--rate", str(PY_SPY_RATE), "--duration", str(int(math.ceil(duration_s))),
                             "--format", "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def gil_summary(profile: Path, seconds: float, requests: float) -> dict:
    """From a py-spy --gil --threads raw profile covering ``seconds`` of load that answered ``requests``: the
    fraction of the time some thread held the GIL, and each thread role's GIL milliseconds per request."""
    by_role: Dict[str, int] = {}
    for line in profile.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        thread = stack.split(";", 1)[0]
        role = next((r for name, r in THREAD_ROLES if name in thread), "other")
        by_role[role] = by_role.get(role, 0) + int(count)
    held_s = sum(by_role.values()) / PY_SPY_RATE
    return {"gil_held_fraction": held_s / seconds,
            "gil_ms_per_request": {role: 1e3 * n / PY_SPY_RATE / requests for role, n in sorted(by_role.items())}}


def summarize(parts: List[dict], seconds: float) -> dict:
    latencies = [x for p in parts for x in p["latencies"]]
    statuses: Dict[str, int] = {}
    for p in parts:
        for k, v in p["statuses"].items():
            statuses[str(k)] = statuses.get(str(k), 0) + v
    tokens, sent, received = (sum(p[k] for p in parts) for k in ("tokens", "sent", "received"))
    n = len(latencies)
    return {"requests": n, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "requests_per_s": n / seconds, "mbytes_per_s": (sent + received) / seconds / 1e6,
            "client_cores_busy": sum(p["cpu_s"] for p in parts) / seconds,
            "client_max_core_busy": max(p["cpu_s"] for p in parts) / seconds,
            "request_bytes_per_turn": sent / n if n else None, "answer_bytes_per_turn": received / n if n else None,
            "status_counts": statuses, **_percentiles(latencies)}


def main() -> None:
    args = parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    workers = []
    try:
        readiness = wait_ready(url, proc)
        agreement = check_against_direct_call(args, url)
        with PrefillClient(url) as client:
            session_ids = {c: client.create_session() for c in range(args.clients)}
        # one pass over every turn: warms the service up and records each answer's size for the echo
        answer_bytes = {}
        with httpx.Client(timeout=120.0) as http:
            for mode in MODES:
                for c in range(args.clients):
                    for j in range(args.turns_per_client):
                        r = http.post(url + "/v1/prefill", content=turn_body(args, c, j, mode, session_ids[c]),
                                      headers=OCTET)
                        r.raise_for_status()
                        answer_bytes[(mode, c, j)] = len(r.content)
        ctx = mp.get_context("spawn")
        for w in range(args.client_procs):
            parent, child = ctx.Pipe()
            mine = [c for c in range(args.clients) if c % args.client_procs == w]
            p = ctx.Process(target=_worker, args=(child, args, mine, {c: session_ids[c] for c in mine}), daemon=True)
            p.start()
            workers.append((p, parent))
        for _, conn in workers:
            conn.recv()

        def phase(mode: str, target: str, duration_s: float) -> dict:
            before = server_counters(url)
            start_at = time.time() + 0.5
            for _, conn in workers:
                conn.send((mode, target, url, start_at, duration_s, answer_bytes))
            cpu_before = process_cpu_s(proc.pid)
            parts = [conn.recv() for _, conn in workers]
            seconds = max(duration_s, time.time() - start_at)
            server_cpu_s = process_cpu_s(proc.pid) - cpu_before  # from the clients' start (0.5 s idle before)
            result = summarize(parts, seconds)
            result.update(server_cores_busy=server_cpu_s / seconds,
                          server_cpu_ms_per_request=1e3 * server_cpu_s / max(1, result["requests"]))
            after = server_counters(url)
            launches = after.get("flash_qla_launches_total", 0) - before.get("flash_qla_launches_total", 0)
            if target == "service" and launches:
                merged = after["flash_qla_batch_requests_sum"] - before["flash_qla_batch_requests_sum"]
                result.update(launches=launches, mean_requests_per_launch=merged / launches,
                              mean_launch_ms=1e3 * (after["flash_qla_kernel_seconds_sum"]
                                                    - before["flash_qla_kernel_seconds_sum"]) / launches,
                              mean_queue_ms=1e3 * (after["flash_qla_queue_seconds_sum"]
                                                   - before["flash_qla_queue_seconds_sum"]) / merged)
                answered = after["flash_qla_request_seconds_count"] - before["flash_qla_request_seconds_count"]
                if answered:  # in the app: from the request's headers to its answer (the body's upload included)
                    result.update(mean_in_app_ms=1e3 * (after["flash_qla_request_seconds_sum"]
                                                        - before["flash_qla_request_seconds_sum"]) / answered)
            return result

        for mode in MODES:  # a short untimed run of each, then the timed alternation
            phase(mode, "echo", 1.0)
            phase(mode, "service", 1.0)
        rounds = {mode: {"echo": [], "service": []} for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                for target in ("echo", "service"):
                    rounds[mode][target].append(phase(mode, target, args.duration_s))
        profiles = {}
        if args.profile_dir is not None:  # after the timed rounds: sampling slows the server a little
            args.profile_dir.mkdir(parents=True, exist_ok=True)
            for mode in MODES:
                out = args.profile_dir / f"service_{mode}_gil.txt"
                try:  # from before the phase's clients start (0.5 s) to after they stop
                    spy = py_spy_gil(proc.pid, args.profile_s + 2.0, out)
                except OSError as error:  # no py-spy: the timed results stand without profiles
                    profiles[mode] = {"error": f"py-spy did not start: {error}"}
                    continue
                profiled = phase(mode, "service", args.profile_s)
                _, err = spy.communicate(timeout=args.profile_s + 60)
                profiles[mode] = {"file": out.name, "requests": profiled["requests"], "seconds": profiled["seconds"],
                                  "py_spy_exit": spy.returncode, "py_spy_stderr": err[-400:]}
                if spy.returncode == 0:
                    profiles[mode].update(gil_summary(out, profiled["seconds"], profiled["requests"]))
    finally:
        for p, conn in workers:
            try:
                conn.send(None)
            except OSError:
                pass
            p.join(10)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    def total(results: List[dict]) -> dict:
        seconds = sum(r["seconds"] for r in results)
        tokens = sum(r["tokens"] for r in results)
        return {"tokens_per_s": tokens / seconds, "requests_per_s": sum(r["requests"] for r in results) / seconds}

    modes = {}
    for mode in MODES:
        echo, service = total(rounds[mode]["echo"]), total(rounds[mode]["service"])
        modes[mode] = {"echo": echo, "service": service,
                       "service_over_echo_tokens_per_s": service["tokens_per_s"] / echo["tokens_per_s"],
                       "rounds": rounds[mode]}
    bytes_per_turn = {mode: statistics.fmean(r["request_bytes_per_turn"] + r["answer_bytes_per_turn"]
                                             for r in rounds[mode]["service"]) for mode in MODES}
    Hv, K = args.heads[1], args.head_dim
    result = {
        "bench": "service_vs_echo",
        "commit": args.commit,
        "backend": args.backend,
        "device": torch.cuda.get_device_name() if args.backend == "kernels" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "flash_qla": flash_qla.__version__,
        "host_cpus": os.cpu_count(),
        "config": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                   for k, v in vars(args).items() if k not in ("out", "commit")},
        "readiness": readiness,
        "answers_vs_direct_calls": agreement,
        "state_bytes_per_sequence": Hv * K * K * 4,
        "bytes_per_turn": {**bytes_per_turn,
                           "stateless_minus_sessions": bytes_per_turn["stateless"] - bytes_per_turn["sessions"],
                           "two_states": 2 * Hv * K * K * 4},
        "modes": modes,
        "service_over_echo": {mode: modes[mode]["service_over_echo_tokens_per_s"] for mode in MODES},
    }
    if profiles:
        result["gil_profiles"] = profiles
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
