"""One tiny backward (one 64-token chunk + a 5-token one, one head) for compute-sanitizer racecheck reports
that can be read hazard by hazard."""
import torch

import flash_qla

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
