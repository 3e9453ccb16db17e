"""One forward + backward call (autograd) on a backward row's shape, for ncu / nsys on the GPU machine.

usage: python scripts/profile_bwd_case.py [HQ HV LENGTH [SEQS]]   (default: hk16_hv32 8k_1seq; SEQS sequences of
LENGTH / SEQS tokens; PROFILE_NO_CARVEOUT=1: every kernel with the driver's shared-memory carveout;
PROFILE_EXTRA_SMEM=N: the chain kernels (gdn_fwd, gdn_bwd_dh) launched with N more bytes of dynamic shared memory;
PROFILE_CUBIN=KEY=PATH: variant KEY loads the cubin at PATH instead (an instrumented build of the same source))
"""
import os
import sys

import torch

import flash_qla
import flash_qla.loader as loader
from kernel_experiment import inputs

if os.environ.get("PROFILE_NO_CARVEOUT") == "1":
    from driver_carveout import use_driver_carveout
    use_driver_carveout()
if os.environ.get("PROFILE_EXTRA_SMEM"):
    extra, init = int(os.environ["PROFILE_EXTRA_SMEM"]), loader.Kernel.__init__

    def padded_init(self, library, entry):
        init(self, library, entry)
        if self.name in ("gdn_fwd", "gdn_bwd_dh"):
            self.smem += extra
    loader.Kernel.__init__ = padded_init
if os.environ.get("PROFILE_CUBIN"):
    key, path = os.environ["PROFILE_CUBIN"].split("=", 1)
    image, read = open(path, "rb").read(), loader.Kernel.cubin
    loader.Kernel.cubin = lambda self: image if self.key == key else read(self)
hq, hv, length = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (16, 32, 8192)
seqs = int(sys.argv[4]) if len(sys.argv) > 4 else 1
q, k, v, g, beta, cu, h0 = inputs(hq, hv, [length // seqs] * seqs)
for t in (q, k, v, g, beta, h0):
    t.requires_grad_(True)
for _ in range(2):
    o, ht = flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    (o.float().square().sum() + ht.square().sum()).backward()
torch.cuda.synchronize()
