"""Diagnostics for the forward kernels on the GPU machine: per-stage errors against the fp64 reference."""
import itertools
import sys

import torch

from flash_qla import ops, reference
from flash_qla.validation import validate_inputs


def case(lengths, hq, hv, K=128, V=128, h0=True, seed=0, strong=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lengths)
    q = torch.nn.functional.normalize(torch.randn(1, T, hq, K, device="cuda", generator=gen), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, hq, K, device="cuda", generator=gen), dim=-1).bfloat16()
    v = torch.randn(1, T, hv, V, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(1, T, hv, device="cuda", generator=gen) * (4.0 if strong else 0.05)
    beta = torch.rand(1, T, hv, device="cuda", generator=gen)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    s0 = torch.randn(len(lengths), hv, K, V, device="cuda", generator=gen) if h0 else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, cu_seqlens=cu)


def run(name, x):
    p = validate_inputs(**x)
    o, ht, A, (cu_dev, _) = ops.forward(p, x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], True,
                                        x["cu_seqlens"], False, want_gate_free_inverse=True)
    gc = ops.chunk_local_cumsum(x["g"][0], cu_dev, (1, x["q"].shape[1]))
    torch.cuda.synchronize()
    cu = x["cu_seqlens"].cpu()
    d = {n: (t.double() if t is not None else None) for n, t in x.items() if n != "cu_seqlens"}
    gc_ref = reference.chunk_local_cumsum(d["g"], cu)
    A_ref = reference.gate_free_inverse(d["k"], d["beta"], cu, num_v_heads=x["v"].shape[2])
    o_ref, ht_ref = reference.chunked_gated_delta_rule(**d, output_final_state=True, cu_seqlens=cu)
    nan = lambda t: int(torch.isnan(t).sum())
    print(f"{name:42s} gcum {reference.relative_l2(gc, gc_ref):.1e} A {reference.relative_l2(A, A_ref):.1e} "
          f"o {reference.relative_l2(o, o_ref):.1e} ht {reference.relative_l2(ht, ht_ref):.1e} "
          f"nan(o,ht,A)=({nan(o)},{nan(ht)},{nan(A)})", flush=True)
    return o, ht


ops.POISON_OUTPUTS = True
for fam in sys.argv[1:] or ["gdn_fwd"]:
    ops.FWD_KERNEL = fam
    print("==", fam)
    run("1x64 hq1 hv1 no-h0 weak", case([64], 1, 1, h0=False, strong=False))
    run("1x64 hq1 hv1 h0", case([64], 1, 1))
    run("1x128 hq1 hv1 h0", case([128], 1, 1))
    run("1x1000 hq2 hv4 h0", case([1000], 2, 4))
    run("varlen 1,63,64,65,130 hq2 hv6", case([1, 63, 64, 65, 130], 2, 6))
    x = case([1000, 333], 2, 8, seed=3)
    o1, h1 = run("repeat A", x)
    o2, h2 = run("repeat B", x)
    print("  bit-identical:", torch.equal(o1, o2) and torch.equal(h1, h2))
