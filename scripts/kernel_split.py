"""Per-kernel GPU time of one forward (and backward) call, for ours or a peer (GPU machine): JSON lines.

Uses torch.profiler over repeated calls and reports each kernel's mean time per call, so the split of a
row's time between kernels is visible (which kernel to work on, and against which peer kernel).
usage: python scripts/kernel_split.py {ours|qla|fla} PEERS_DIR ROW [ROW ...]   (ROW like "TP1-397B:4096x8";
PEERS_DIR "-" times ours on kernel_experiment's inputs without a staged peers directory;
"TP8:1x8192@8" forces our intra-card CP with 8-chunk segments, which eager calls otherwise never plan)
"""
import json
import math
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

MODELS = {"TP8": (2, 8), "TP2": (8, 32), "TP1-397B": (16, 64), "2B-TP1": (16, 16), "hk16_hv32": (16, 32),
          "hk4_hv8": (4, 8)}
SEQS = {"1x32768": [32768], "1x8192": [8192], "1x2048": [2048], "28672+4096": [28672, 4096],
        "16384+16384": [16384, 16384], "8192x4": [8192] * 4, "4096x8": [4096] * 8, "1024x8": [1024] * 8,
        "8k_1seq": [8192], "32k_1seq": [32768], "8k_8seq": [161, 1928, 3157, 563, 1244, 229, 177, 733],
        "32k_8seq": [3274, 1029, 2909, 5061, 2011, 3793, 9932, 4759]}  # the matrix's backward rows


def split(fn, iters=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    launches = 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:60]] += ev.device_time / 1000.0 / iters
            launches += 1
    out = {k: round(v, 4) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
    out["launches_per_call"] = launches / iters
    return out


def _own_inputs(lengths, hq, hv, dim):
    """The standard matrix's inputs (scripts/kernel_experiment.py), in the peers' dict form, with the bench's
    gates (flash_qla.bench.inputs): a quarter of the v-heads never decay, which decides CP's fallback work."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from kernel_experiment import inputs
    q, k, v, g, beta, cu, h0 = inputs(hq, hv, lengths)
    g[:, :, torch.randperm(hv, device=g.device)[: hv - math.ceil(0.75 * hv)]] = 0.0
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu=cu, h0=h0, scale=dim ** -0.5, do=torch.randn_like(v),
                dht=torch.randn_like(h0) / 8)


def main():
    lib, peers_dir, rows = sys.argv[1], sys.argv[2], sys.argv[3:]
    if peers_dir == "-":  # ours alone, without a staged peers directory: kernel_experiment's inputs
        make = _own_inputs
    else:
        sys.path.insert(0, peers_dir)
        import peer_bench  # the peers' input maker and call wrappers (same inputs as the standard matrix)
        make = peer_bench.make
    if lib == "ours":
        import flash_qla
        from flash_qla import chunk_gated_delta_rule as ours

        def fwd(d):
            o, st = ours(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=d["scale"], initial_state=d["h0"],
                         output_final_state=True, cu_seqlens=d["cu"])
            return o, st

        def bwd(d):
            leaves = [d[n].detach().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "h0")]
            o, st = ours(*leaves[:5], scale=d["scale"], initial_state=leaves[5], output_final_state=True,
                         cu_seqlens=d["cu"])
            return lambda: torch.autograd.grad((o, st), leaves, (d["do"], d["dht"]), retain_graph=True)
    else:
        _, f, b = peer_bench.peer(lib)
        fwd = f

        def bwd(d):
            gc, A = f(d)
            return b(d, gc, A)
    for row in rows:
        row, _, segment = row.partition("@")
        if lib == "ours":
            from flash_qla import cp
            cp.FORCE_SEGMENT_CHUNKS = int(segment) if segment else None
        model, seqs = row.split(":")
        hq, hv = MODELS[model]
        d = make(SEQS[seqs], hq, hv, 128)
        rec = {"lib": lib, "row": row + (f"@{segment}" if segment else ""), "fwd": split(lambda: fwd(d))}
        rec["fwd_total_ms"] = round(sum(v for n, v in rec["fwd"].items() if n != "launches_per_call"), 4)
        if model.startswith("hk"):
            call = bwd(d)
            rec["bwd"] = split(call)
            rec["bwd_total_ms"] = round(sum(v for n, v in rec["bwd"].items() if n != "launches_per_call"), 4)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
