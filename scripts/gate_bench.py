"""FLA's fused gate / beta activations against a plain call (GPU machine): CUDA-graph medians per standard row.

usage: python scripts/gate_bench.py [ROW ...] [--turns N] [--commit LABEL] [--out FILE.json]
ROW: a substring of a forward row key of the standard matrix (default: a representative set, small and batched).

Arms, each timed forward (no autograd) and forward + backward (autograd: every input's gradient, A_log's and
dt_bias's with the gate):
  plain   g (log-decay) and beta already activated: the call without the keywords;
  fused   raw g (float32), beta logits, use_gate_in_kernel (A_log, dt_bias) and use_beta_sigmoid_in_kernel: the
          kernels apply the activations (flash_qla/gates.py);
  fused_bf16g  the same with g and the logits in bf16 (one conversion pass of g before the call);
  torch   the raw inputs through gates.py's torch pass, then the plain call (the activations unfused).
The arms alternate within each turn (same card, clocks and inputs); the result is each arm's median over turns and
the ratio to plain.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

DEFAULT_ROWS = ("TP8|1x2048", "TP8|1024x8", "TP2|4096x8", "TP2|1x32768", "TP1-397B|8192x4", "2B-TP1|28672+4096")
ARMS = ("plain", "fused", "fused_bf16g", "torch")


def raw_gates(x, seed: int = 1):
    """Raw gate, A_log, dt_bias and beta logits of the row's shape (Qwen3.5-like magnitudes) and their activations."""
    from flash_qla import gates
    gen = torch.Generator(device=x.g.device).manual_seed(seed)
    hv = x.g.shape[-1]
    g_raw = torch.randn(x.g.shape, generator=gen, device=x.g.device)
    b_raw = torch.randn(x.beta.shape, generator=gen, device=x.g.device)
    A_log = torch.log(torch.empty(hv, device=x.g.device).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(hv, generator=gen, device=x.g.device) * 0.5 - 2
    return dict(g_raw=g_raw, b_raw=b_raw, A_log=A_log, dt_bias=dt_bias,
                g=gates.gdn_gate(g_raw, A_log, dt_bias), beta=gates.beta_from_logits(b_raw))


def calls(x, r, arm: str, backward: bool):
    """The timed call of one arm: forward only, or forward + backward through autograd."""
    import flash_qla
    from flash_qla import gates
    cu_cpu = x.cu_seqlens.cpu()
    half = arm == "fused_bf16g"
    g_in = r["g"] if arm == "plain" else (r["g_raw"].bfloat16() if half else r["g_raw"])
    b_in = r["beta"] if arm == "plain" else (r["b_raw"].bfloat16() if half else r["b_raw"])
    leaves = dict(q=x.q, k=x.k, v=x.v, g=g_in, beta=b_in, h0=x.h0)
    if arm != "plain":
        leaves.update(A_log=r["A_log"], dt_bias=r["dt_bias"])
    leaves = {n: t.detach().clone().requires_grad_(backward) for n, t in leaves.items()}

    def fwd():
        L = leaves
        kw = dict(scale=x.scale, initial_state=L["h0"], output_final_state=True, cu_seqlens=x.cu_seqlens,
                  cu_seqlens_cpu=cu_cpu)
        if arm in ("fused", "fused_bf16g"):
            return flash_qla.chunk_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], use_gate_in_kernel=True,
                                                    A_log=L["A_log"], dt_bias=L["dt_bias"],
                                                    use_beta_sigmoid_in_kernel=True, **kw)
        g, beta = L["g"], L["beta"]
        if arm == "torch":
            g, beta = gates.gdn_gate(g, L["A_log"], L["dt_bias"]), gates.beta_from_logits(beta)
        return flash_qla.chunk_gated_delta_rule(L["q"], L["k"], L["v"], g, beta, **kw)

    if not backward:
        def run():
            with torch.no_grad():
                return fwd()
        return run

    def run_bwd():
        o, s = fwd()
        return torch.autograd.grad([o, s], list(leaves.values()), [x.do, x.dht])
    return run_bwd


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", nargs="*", default=list(DEFAULT_ROWS))
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--commit", default=None, help="the code's commit, recorded in the JSON")
    p.add_argument("--out", default=None)
    p.add_argument("--budget-s", type=float, default=None, help="stop starting new rows after this many seconds")
    p.add_argument("--split", action="store_true", help="also each kernel's profiler time per call (plain / fused)")
    args = p.parse_args()
    from flash_qla.bench.inputs import draw_inputs
    from flash_qla.bench.matrix import iter_rows, load_matrix
    from flash_qla.bench.timing import graph_median_ms

    dev = torch.device("cuda", torch.cuda.current_device())
    t_start = time.time()
    results = []
    every = list(iter_rows(load_matrix(), ("fwd",), ""))
    chosen = list(dict.fromkeys(r for w in args.rows for r in every if w in r.key))  # in the order asked
    for row in chosen:
        if args.budget_s is not None and time.time() - t_start > args.budget_s:
            print(f"budget: {row.key} not run", file=sys.stderr)
            continue
        x = draw_inputs(row, "cuda")
        r = raw_gates(x)
        entry = {"row": row.key.split("|", 1)[1], "tokens": int(x.q.shape[1]), "hv": int(x.v.shape[2])}
        for pass_, backward in (("fwd", False), ("fwd_bwd", True)):
            runs = {a: calls(x, r, a, backward) for a in ARMS}
            times = {a: [] for a in ARMS}
            errors = {}
            for _ in range(args.turns):
                for a in ARMS:
                    ms, why = graph_median_ms(runs[a], dev)
                    if ms is None:
                        errors[a] = why
                    else:
                        times[a].append(ms)
            med = {a: statistics.median(t) for a, t in times.items() if t}
            entry[pass_] = {a: round(m, 5) for a, m in med.items()}
            if "plain" in med:
                entry[pass_ + "_ratio"] = {a: round(m / med["plain"], 4) for a, m in med.items() if a != "plain"}
            if errors:
                entry[pass_ + "_errors"] = errors
            if args.split:
                sys.path.insert(0, str(Path(__file__).resolve().parent))
                from kernel_split import split
                entry[pass_ + "_kernels"] = {a: split(runs[a]) for a in ("plain", "fused")}
        print(json.dumps(entry), flush=True)
        results.append(entry)
    out = {"what": "graph medians (ms) of the fused gate / beta activations against a plain call, and the ratios",
           "device": torch.cuda.get_device_name(dev), "commit": args.commit, "turns": args.turns, "rows": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
