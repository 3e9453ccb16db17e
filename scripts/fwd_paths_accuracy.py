"""Relative L2 error of the plain forward's two paths (gdn_fwd_fused at V blocks 64 and 128, gdn_prepare +
gdn_fwd_st) against the fp64 reference on the GPU tests' hard inputs (strong decay, g = 0 heads, beta near 0 / 1,
1-token and partial chunks, GVA, initial state):
python scripts/fwd_paths_accuracy.py > bench/results/fwd_paths_accuracy_h200.txt"""
import sys

import torch

sys.path.insert(0, "tests")
import flash_qla  # noqa: E402
from flash_qla import cp, ops, reference  # noqa: E402
from test_gpu_forward import LENGTHS, draw, fp64_reference  # noqa: E402

cp.FORCE_SEGMENT_CHUNKS = 0
print("dtype K V case hq hv path  o_rel_l2  ht_rel_l2")
for dtype in (torch.bfloat16, torch.float16):
    for K, V in ((128, 128), (64, 256)):
        for case in sorted(LENGTHS):
            for hq, hv in ((2, 6), (3, 3)):
                x = draw(LENGTHS[case], hq, hv, K, V, dtype, seed=K + V + hv + len(case))
                o_ref, ht_ref = fp64_reference(x)
                for path, fused, block_v in (("fused64", True, 64), ("fused128", True, 128), ("split", False, None)):
                    ops.USE_FUSED, ops.FORCE_BLOCK_V = fused, block_v
                    o, ht = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True)
                    print(f"{str(dtype)[6:]} {K} {V} {case} {hq} {hv} {path} {reference.relative_l2(o, o_ref):.2e} "
                          f"{reference.relative_l2(ht, ht_ref):.2e}")
