"""One forward + backward call (autograd) on a backward row's shape, for ncu / nsys on the GPU machine.

usage: python scripts/profile_bwd_case.py [HQ HV LENGTH]   (default: hk16_hv32 8k_1seq)
"""
import sys

import torch

import flash_qla
from kernel_experiment import inputs

hq, hv, length = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (16, 32, 8192)
q, k, v, g, beta, cu, h0 = inputs(hq, hv, [length])
for t in (q, k, v, g, beta, h0):
    t.requires_grad_(True)
for _ in range(2):
    o, ht = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    (o.float().square().sum() + ht.square().sum()).backward()
torch.cuda.synchronize()
