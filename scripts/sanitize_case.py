"""Small cases for compute-sanitizer (memcheck / racecheck / synccheck) on the GPU machine.

usage: python scripts/sanitize_case.py          a varlen forward + backward over every kernel family: split and
                                                fused forward, CP both ways, l2norm (in the kernels and by the
                                                gdn_l2norm pass), the persistent chunk kernel,
                                                FLA's fused gate / beta activations (gdn_gate_bwd)
       python scripts/sanitize_case.py tiny     one head, one 64-token chunk + a 5-token one: a racecheck report
                                                that can be read hazard by hazard
       python scripts/sanitize_case.py plan     the intra-card CP forward and backward with more (segment, v-head)
                                                pairs than one gdn_cp_plan CTA walks (several of its CTAs)
       python scripts/sanitize_case.py window   multi-GPU CP's head window build (gdn_fwd_chain "window"): heads
                                                that stop early, heads that run it all
       python scripts/sanitize_case.py linked   multi-GPU CP's linked forward on one GPU: gdn_cp_plan's trailing
                                                segment, B's combine from the identity (zero_z) beside A's, the
                                                output chain after h_in += B h_e
"""
import sys

import torch

import flash_qla
from flash_qla import tuning


def tiny() -> None:
    torch.manual_seed(0)
    T, K, V = 69, 128, 128
    cu = torch.tensor([0, 64, 69], dtype=torch.int32, device="cuda")
    q = torch.nn.functional.normalize(torch.randn(1, T, 1, K, device="cuda"), dim=-1).bfloat16().requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(1, T, 1, K, device="cuda"), dim=-1).bfloat16().requires_grad_()
    v = torch.randn(1, T, 1, V, device="cuda").bfloat16().requires_grad_()
    g = (-torch.rand(1, T, 1, device="cuda")).requires_grad_()
    beta = torch.rand(1, T, 1, device="cuda").requires_grad_()
    o, _ = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    grads = torch.autograd.grad(o, [q, k, v, g, beta], torch.randn_like(o))
    torch.cuda.synchronize()
    print("tiny backward ok", [float(d.float().abs().sum()) for d in grads])
    sys.exit(0)


def plan() -> None:
    torch.manual_seed(0)
    T, hq, hv, K, V = 64 * 70 + 5, 1, 4, 128, 128          # 71 one-chunk segments x 4 v-heads = 284 pairs
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    q = torch.nn.functional.normalize(torch.randn(1, T, hq, K, device="cuda"), dim=-1).bfloat16().requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(1, T, hq, K, device="cuda"), dim=-1).bfloat16().requires_grad_()
    v = torch.randn(1, T, hv, V, device="cuda").bfloat16().requires_grad_()
    g = (-torch.rand(1, T, hv, device="cuda") / 8).requires_grad_()
    beta = torch.rand(1, T, hv, device="cuda").requires_grad_()
    tuning.settings.force_segment_chunks = 1
    o, ht = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    grads = torch.autograd.grad([o, ht], [q, k, v, g, beta], [torch.randn_like(o), torch.randn_like(ht)])
    torch.cuda.synchronize()
    print("plan case ok", float(o.detach().float().abs().sum()), [float(d.float().abs().sum()) for d in grads])
    sys.exit(0)


def window() -> None:
    from flash_qla import distributed as cpd
    torch.manual_seed(0)
    w, hq, hv, K = 1024, 1, 4, 128
    q = torch.nn.functional.normalize(torch.randn(1, w, hq, K, device="cuda"), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, w, hq, K, device="cuda"), dim=-1).bfloat16()
    g = -torch.tensor([0.0, 0.01, 0.3, 4.0], device="cuda") * torch.rand(1, w, hv, device="cuda")
    beta = torch.rand(1, w, hv, device="cuda")
    zeros = torch.zeros(1, w, hv, K, device="cuda", dtype=torch.bfloat16)
    call = cpd._Call(K ** -0.5, False, "auto", torch.float32, hv // hq)
    (o, final), whole = cpd._stopped_window(call, q, k, zeros, g, beta, w)
    torch.cuda.synchronize()
    print("window case ok", float(o.float().abs().sum()), float(final.abs().sum()), whole.tolist())
    sys.exit(0)


def linked() -> None:
    from flash_qla import forward, kernel_api, validation
    torch.manual_seed(0)
    T, hq, hv, K, L = 64 * 12, 1, 4, 128, 2
    tuning.settings.force_segment_chunks = L
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    q = torch.nn.functional.normalize(torch.randn(1, T, hq, K, device="cuda"), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, hq, K, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(1, T, hv, K, device="cuda").bfloat16()
    g = -torch.tensor([0.0, 0.01, 0.3, 4.0], device="cuda") * torch.rand(1, T, hv, device="cuda")
    beta = torch.rand(1, T, hv, device="cuda")
    problem = validation.validate_inputs(q, k, v, g, beta, None, None, cu.cpu())
    plan = forward.forward_plan(problem, "bf16", q.device, False, False)
    eye = torch.eye(K, device="cuda").expand(1, hv, K, K).contiguous()
    o, entry = kernel_api.run_linked_entry(problem, q, k, v, g, beta, None, cu, False, plan, forward.Link(True, eye),
                                           True)
    entry.h_in[:T // 64 // L] += torch.matmul(entry.b[:T // 64 // L], torch.randn(hv, K, K, device="cuda"))
    ht = kernel_api.per_sequence(problem, forward.linked_output(entry, q.device), q.device, "ht")
    torch.cuda.synchronize()
    print("linked case ok", float(o.float().abs().sum()), float(ht.abs().sum()))
    sys.exit(0)


if sys.argv[1:] == ["tiny"]:
    tiny()
elif sys.argv[1:] == ["plan"]:
    plan()
elif sys.argv[1:] == ["window"]:
    window()
elif sys.argv[1:] == ["linked"]:
    linked()
elif sys.argv[1:]:
    sys.exit(__doc__)

# gdn_bwd_chunk on 3 CTAs: each walks several (chunk slot, q/k head) items (its persistent loop's prefetches)
tuning.settings.chunk_ctas_max = 3

torch.manual_seed(0)
lengths = [1, 63, 64, 65, 130]
T, hq, hv, K, V = sum(lengths), 2, 4, 128, 128
cu = torch.tensor([0, 1, 64, 128, 193, 323], dtype=torch.int32, device="cuda")
q = torch.nn.functional.normalize(torch.randn(1, T, hq, K, device="cuda"), dim=-1).bfloat16()
k = torch.nn.functional.normalize(torch.randn(1, T, hq, K, device="cuda"), dim=-1).bfloat16()
v = torch.randn(1, T, hv, V, device="cuda").bfloat16()
g = -torch.rand(1, T, hv, device="cuda")
beta = torch.rand(1, T, hv, device="cuda")
h0 = torch.randn(len(lengths), hv, K, V, device="cuda")
for x in (q, k, v, g, beta, h0):
    x.requires_grad_(True)
o, ht = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
grads = torch.autograd.grad([o, ht], [q, k, v, g, beta, h0], [torch.randn_like(o), torch.randn_like(ht)])
# the intra-card CP forward and backward too (pre-pass builds, gdn_cp_combine both ways): segments of one chunk,
# g = 0 on one head (exact fallback)
tuning.settings.force_segment_chunks = 1
with torch.no_grad():
    g0 = g.detach().clone()
    g0[..., 1] = 0.0
    o_cp, ht_cp = flash_qla.chunk_gated_delta_rule(q.detach(), k.detach(), v.detach(), g0, beta.detach(),
                                                   initial_state=h0.detach(), output_final_state=True, cu_seqlens=cu)
    # the forward's CP on the split kernels too (the call above runs it on the fused kernel: gdn_cp_scan, the fused
    # state / trans builds, the fused output pass over the segments), and the fused flavour with l2norm
    with tuning.override(cp_fused=False):
        o_cps, _ = flash_qla.chunk_gated_delta_rule(q.detach(), k.detach(), v.detach(), g0, beta.detach(),
                                                    initial_state=h0.detach(), output_final_state=True,
                                                    cu_seqlens=cu)
    with tuning.override(prenorm=False):
        o_cpn, _ = flash_qla.chunk_gated_delta_rule(q.detach() * 3, k.detach() * 0.5, v.detach(), g0, beta.detach(),
                                                    cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
# and the CP backward (recompute with CP, then the dh chain's reverse warm-ups, transitions and combine)
g0 = g0.requires_grad_(True)
o_cp2, ht_cp2 = flash_qla.chunk_gated_delta_rule(q, k, v, g0, beta, initial_state=h0, output_final_state=True,
                                                 cu_seqlens=cu)
grads_cp = torch.autograd.grad([o_cp2, ht_cp2], [q, k, v, g0, beta, h0],
                               [torch.randn_like(o_cp2), torch.randn_like(ht_cp2)])
tuning.settings.force_segment_chunks = None
# use_qk_l2norm_in_kernel forward and backward (gdn_prepare's normalisation, gdn_bwd_chunk's l2norm epilogue)
o_n, ht_n = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                             cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
grads_n = torch.autograd.grad([o_n, ht_n], [q, k], [torch.randn_like(o_n), torch.randn_like(ht_n)])
# the fused forward pinned (gdn_fwd_fused: producer / aux / consumer warpgroups on mbarrier stages), plain and l2norm
# at BV = 64, plain at BV = 128 (two consumer warpgroups, the bf16 state in shared memory, the order build)
with torch.no_grad(), tuning.override(use_fused=True):
    tuning.settings.force_block_v = 64
    o_f, ht_f = flash_qla.chunk_gated_delta_rule(q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(),
                                                 initial_state=h0.detach(), output_final_state=True, cu_seqlens=cu)
    with tuning.override(prenorm=False):
        o_fn, _ = flash_qla.chunk_gated_delta_rule(q.detach() * 3, k.detach() * 0.5, v.detach(), g.detach(),
                                                   beta.detach(), cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    # with the lengths on the host (out of order: the longest is last here) the order build ranks them and 5 CTAs
    # walk the sequences longest first
    tuning.settings.force_block_v = 128
    tuning.settings.fused_ctas_max = 5
    o_f2, ht_f2 = flash_qla.chunk_gated_delta_rule(q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(),
                                                   initial_state=h0.detach(), output_final_state=True, cu_seqlens=cu,
                                                   cu_seqlens_cpu=cu.cpu())
    # l2norm by the gdn_l2norm pass (323 rows: a partial last block) ahead of the plain BV = 128 build, and in the
    # BV = 128 l2norm build (q's norms by row sums on the aux warpgroup), its order build too
    with tuning.override(prenorm=True):
        o_fp, _ = flash_qla.chunk_gated_delta_rule(q.detach() * 3, k.detach() * 0.5, v.detach(), g.detach(),
                                                   beta.detach(), cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    with tuning.override(prenorm=False):
        o_fn2, _ = flash_qla.chunk_gated_delta_rule(q.detach() * 3, k.detach() * 0.5, v.detach(), g.detach(),
                                                    beta.detach(), cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(),
                                                    use_qk_l2norm_in_kernel=True)
    tuning.settings.force_block_v = None
    tuning.settings.fused_ctas_max = None
# FLA's activations in the kernels: raw gate with A_log / dt_bias and beta logits (gdn_prepare stores the activated
# beta, gdn_gate_bwd writes the raw inputs' gradients and per-head sums); 40 v-heads: a partial second block of heads
hg = 40
g_raw = torch.randn(1, T, hg, device="cuda", requires_grad=True)
b_raw = torch.randn(1, T, hg, device="cuda", requires_grad=True)
A_log = torch.randn(hg, device="cuda", requires_grad=True)
dt_bias = torch.randn(hg, device="cuda", requires_grad=True)
vg = torch.randn(1, T, hg, V, device="cuda").bfloat16().requires_grad_()
o_g, _ = flash_qla.chunk_gated_delta_rule(q, k, vg, g_raw, b_raw, cu_seqlens=cu, use_gate_in_kernel=True, A_log=A_log,
                                          dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
grads_g = torch.autograd.grad(o_g, [g_raw, b_raw, A_log, dt_bias], torch.randn_like(o_g))
torch.cuda.synchronize()
print("fused case", float(o_f.float().abs().sum()), float(ht_f.abs().sum()), float(o_fn.float().abs().sum()),
      float(o_fp.float().abs().sum()), float(o_fn2.float().abs().sum()),
      float((o_f2.float() - o_f.float()).abs().max()), float((ht_f2 - ht_f).abs().max()))
print("gate case", [float(d.float().abs().sum()) for d in grads_g])
print("l2norm case", [float(d.float().abs().sum()) for d in grads_n])
print("cp case", float(o_cp.float().abs().sum()), float(ht_cp.abs().sum()), float(o_cps.float().abs().sum()),
      float(o_cpn.float().abs().sum()),
      [float(d.float().abs().sum()) for d in grads_cp])
print("sanitize case ok", float(o.detach().float().abs().sum()), float(ht.detach().abs().sum()),
      [float(d.float().abs().sum()) for d in grads])
