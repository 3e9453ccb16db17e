"""Checks a running prefill service the way an edge box's orchestrator and a client would.

    python ci/container_smoke_client.py --url http://127.0.0.1:8000 [--expect-ready | --expect-reason no_gpu]

1. ``/health`` answers 200 within ``--wait-s`` (``--pid``: fail at once if that process dies).
2. ``/ready`` leaves ``starting``; with ``--expect-ready`` it must answer 200, with ``--expect-reason R`` 503 and
   reason R (for example the kernels backend started without a GPU), and nothing else is checked.
3. One JSON and one safetensors ``/v1/prefill`` (varlen, GVA heads, bf16, an initial state in the JSON one); each
   answer is compared with a direct ``flash_qla.chunk_gated_delta_rule(..., backend="reference")`` call made
   here, on the CPU, from the same inputs.
4. ``/metrics`` parses as Prometheus text and counts those two requests (status 200) and their tokens.

Prints one line per check and, last, one JSON line (``SUMMARY {...}``). Exit status 0 only if all passed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, Optional, Tuple

import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

import flash_qla


class CheckFailed(Exception):
    pass


def http(url: str, data: Optional[bytes] = None, content_type: Optional[str] = None,
         timeout: float = 60.0) -> Tuple[int, bytes]:
    headers = {"Content-Type": content_type} if content_type else {}
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def alive(pid: Optional[int]) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def wait_health(base: str, limit_s: float, pid: Optional[int]) -> float:
    t0 = time.monotonic()
    while True:
        try:
            status, body = http(base + "/health", timeout=2)
            if status == 200:
                return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if not alive(pid):
            raise CheckFailed(f"the server process {pid} exited before /health answered")
        if time.monotonic() - t0 > limit_s:
            raise CheckFailed(f"/health did not answer 200 within {limit_s} s")
        time.sleep(0.25)


def wait_ready(base: str, limit_s: float) -> Tuple[int, dict, float]:
    """/ready's first verdict other than 'starting': (status, body, seconds waited)."""
    t0 = time.monotonic()
    while True:
        status, body = http(base + "/ready", timeout=10)
        verdict = json.loads(body)
        if verdict.get("reason") != "starting":
            return status, verdict, time.monotonic() - t0
        if time.monotonic() - t0 > limit_s:
            raise CheckFailed(f"/ready still 'starting' after {limit_s} s: {verdict}")
        time.sleep(0.5)


def make_inputs(seed: int, lengths, hq: int, hv: int, k_dim: int, v_dim: int, with_h0: bool) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.nn.functional.normalize(torch.randn(t, hq, k_dim, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, hq, k_dim, generator=gen), dim=-1)
    tensors = {
        "q": q.to(torch.bfloat16), "k": k.to(torch.bfloat16),
        "v": torch.randn(t, hv, v_dim, generator=gen).to(torch.bfloat16),
        "g": torch.nn.functional.logsigmoid(torch.randn(t, hv, generator=gen) + 3.0),
        "beta": torch.rand(t, hv, generator=gen),
        "cu_seqlens": torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int64),
    }
    if with_h0:
        tensors["initial_state"] = 0.1 * torch.randn(len(lengths), hv, k_dim, v_dim, generator=gen)
    return tensors


def direct_call(x: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    o, final_state = flash_qla.chunk_gated_delta_rule(
        x["q"][None], x["k"][None], x["v"][None], x["g"][None], x["beta"][None],
        initial_state=x.get("initial_state"), output_final_state=True,
        cu_seqlens=x["cu_seqlens"].to(torch.int32), backend="reference")
    return o[0], final_state


def compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> dict:
    if got.shape != want.shape:
        raise CheckFailed(f"{name}: shape {tuple(got.shape)}, direct call {tuple(want.shape)}")
    if not torch.isfinite(got.float()).all():
        raise CheckFailed(f"{name}: non-finite values in the answer")
    diff = got.double() - want.double()
    rel = (diff.norm() / want.double().norm().clamp_min(1e-30)).item()
    max_abs = diff.abs().max().item()
    if not rel <= tol:
        raise CheckFailed(f"{name}: relative L2 error {rel:.3e} > {tol:.1e} (max abs {max_abs:.3e})")
    return {"rel_l2": rel, "max_abs": max_abs, "shape": list(got.shape)}


def check_json(base: str, tol: float) -> Tuple[dict, int]:
    x = make_inputs(1, [37, 91], hq=2, hv=4, k_dim=64, v_dim=64, with_h0=True)
    body = {"dtype": "bfloat16", "cu_seqlens": x["cu_seqlens"].tolist(), "output_final_state": True}
    body.update({n: x[n].float().tolist() for n in ("q", "k", "v", "g", "beta", "initial_state")})
    status, raw = http(base + "/v1/prefill", json.dumps(body).encode(), "application/json")
    if status != 200:
        raise CheckFailed(f"JSON /v1/prefill answered {status}: {raw[:300]!r}")
    answer = json.loads(raw)
    if answer.get("dtype") != "bfloat16":
        raise CheckFailed(f"JSON /v1/prefill answered dtype {answer.get('dtype')!r}, sent bfloat16")
    o_want, s_want = direct_call(x)
    result = {"o": compare("JSON o", torch.tensor(answer["o"], dtype=torch.float32), o_want.float(), tol),
              "final_state": compare("JSON final_state", torch.tensor(answer["final_state"]), s_want, tol)}
    return result, x["q"].shape[0]


def check_safetensors(base: str, tol: float) -> Tuple[dict, int]:
    x = make_inputs(2, [1, 64, 200], hq=2, hv=8, k_dim=128, v_dim=128, with_h0=False)
    payload = save_safetensors(x, metadata={"output_final_state": "true"})
    status, raw = http(base + "/v1/prefill", payload, "application/octet-stream")
    if status != 200:
        raise CheckFailed(f"safetensors /v1/prefill answered {status}: {raw[:300]!r}")
    answer = load_safetensors(raw)
    if answer["o"].dtype != torch.bfloat16:
        raise CheckFailed(f"safetensors /v1/prefill answered o in {answer['o'].dtype}, sent bfloat16")
    o_want, s_want = direct_call(x)
    result = {"o": compare("safetensors o", answer["o"], o_want, tol),
              "final_state": compare("safetensors final_state", answer["final_state"], s_want, tol)}
    return result, x["q"].shape[0]


def check_metrics(base: str, requests: int, tokens: int) -> dict:
    status, raw = http(base + "/metrics")
    if status != 200:
        raise CheckFailed(f"/metrics answered {status}")
    samples = {}
    for family in text_string_to_metric_families(raw.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    answered = samples.get(("flash_qla_requests_total", (("status", "200"),)))
    counted = samples.get(("flash_qla_tokens_total", ()))
    if answered != requests:
        raise CheckFailed(f"/metrics flash_qla_requests_total{{status=\"200\"}} = {answered}, sent {requests}")
    if counted is None or counted < tokens:
        raise CheckFailed(f"/metrics flash_qla_tokens_total = {counted}, sent {tokens} tokens")
    return {"requests_200": answered, "tokens_total": counted, "series": len(samples)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="the service's base URL, e.g. http://127.0.0.1:8000")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--expect-ready", action="store_true", help="/ready must answer 200, then prefill")
    group.add_argument("--expect-reason", help="/ready must answer 503 with this reason (e.g. no_gpu)")
    p.add_argument("--expect-backend", help="/ready's backend field must equal this")
    p.add_argument("--tol", type=float, default=1e-2,
                   help="relative L2 bound against the direct reference call (bf16 outputs)")
    p.add_argument("--wait-s", type=float, default=180.0, help="bound on /health and on /ready's start")
    p.add_argument("--pid", type=int, help="the server's pid: stop waiting if it exits")
    args = p.parse_args()
    base = args.url.rstrip("/")
    summary: dict = {"url": base}
    try:
        summary["health_s"] = round(wait_health(base, args.wait_s, args.pid), 2)
        print(f"/health -> 200 after {summary['health_s']} s")
        status, verdict, waited = wait_ready(base, args.wait_s)
        summary["ready"] = {"status": status, **verdict, "after_s": round(waited, 2)}
        print(f"/ready -> {status} {json.dumps(verdict)} (after {waited:.1f} s more)")
        if args.expect_backend and verdict.get("backend") != args.expect_backend:
            raise CheckFailed(f"/ready backend {verdict.get('backend')!r}, expected {args.expect_backend!r}")
        if args.expect_reason is not None:
            if status != 503 or verdict.get("reason") != args.expect_reason:
                raise CheckFailed(f"/ready expected 503 {args.expect_reason!r}, got {status} {verdict}")
        else:
            if status != 200:
                raise CheckFailed(f"/ready answered {status}: {verdict}")
            summary["json"], t1 = check_json(base, args.tol)
            print(f"JSON prefill (2 seqs, 128 tokens, Hq 2 / Hv 4, K=V=64, h0) vs direct call: "
                  f"o rel L2 {summary['json']['o']['rel_l2']:.2e}, "
                  f"final_state rel L2 {summary['json']['final_state']['rel_l2']:.2e}")
            summary["safetensors"], t2 = check_safetensors(base, args.tol)
            print(f"safetensors prefill (3 seqs, 265 tokens, Hq 2 / Hv 8, K=V=128) vs direct call: "
                  f"o rel L2 {summary['safetensors']['o']['rel_l2']:.2e}, "
                  f"final_state rel L2 {summary['safetensors']['final_state']['rel_l2']:.2e}")
            summary["metrics"] = check_metrics(base, 2, t1 + t2)
            print(f"/metrics: requests_total{{status=200}} = {summary['metrics']['requests_200']:g}, "
                  f"tokens_total = {summary['metrics']['tokens_total']:g}")
    except (CheckFailed, urllib.error.URLError, OSError, ValueError, KeyError) as error:
        summary["error"] = f"{type(error).__name__}: {error}"
        print(f"FAIL: {summary['error']}", file=sys.stderr)
        print("SUMMARY " + json.dumps(summary))
        return 1
    summary["ok"] = True
    print("SUMMARY " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
