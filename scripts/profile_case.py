"""One forward call on a benchmark row's shape, for ncu / nsys on the GPU machine."""
import sys

import torch

import flash_qla

hq, hv, lengths = {"tp1_4096x8": (16, 64, [4096] * 8), "tp8_1x8192": (2, 8, [8192]),
                   "tp2_1x32768": (8, 32, [32768])}[sys.argv[1] if len(sys.argv) > 1 else "tp1_4096x8"]
T = sum(lengths)
torch.manual_seed(0)
q = torch.nn.functional.normalize(torch.randn(1, T, hq, 128, device="cuda"), dim=-1).bfloat16()
k = torch.nn.functional.normalize(torch.randn(1, T, hq, 128, device="cuda"), dim=-1).bfloat16()
v = torch.randn(1, T, hv, 128, device="cuda").bfloat16()
g = torch.nn.functional.logsigmoid(torch.randn(1, T, hv, device="cuda")) / 16
beta = torch.rand(1, T, hv, device="cuda")
cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32, device="cuda")
h0 = torch.randn(len(lengths), hv, 128, 128, device="cuda")
for _ in range(2):
    flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
torch.cuda.synchronize()
