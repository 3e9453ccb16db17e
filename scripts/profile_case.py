"""One forward call on a benchmark row's shape, for ncu / nsys on the GPU machine.

usage: python scripts/profile_case.py "TP1 4096x8"   (a row of kernel_experiment.ROWS)
FLASH_QLA_FORCE_BV=64 pins the chain kernels' V block; FLASH_QLA_FUSED=0 takes gdn_prepare + gdn_fwd_st;
FLASH_QLA_NO_CP=1 turns intra-card CP off (one chain per sequence and head, as the fused path runs).
"""
import os
import sys

import torch

import flash_qla
from flash_qla import cp, ops
from kernel_experiment import ROWS, inputs

if os.environ.get("FLASH_QLA_NO_CP"):
    cp.FORCE_SEGMENT_CHUNKS = 0
if os.environ.get("FLASH_QLA_FORCE_BV"):
    ops.FORCE_BLOCK_V = int(os.environ["FLASH_QLA_FORCE_BV"])
q, k, v, g, beta, cu, h0 = inputs(*ROWS[sys.argv[1] if len(sys.argv) > 1 else "TP1 4096x8"])
for _ in range(2):
    flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
torch.cuda.synchronize()
