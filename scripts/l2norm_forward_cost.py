"""Forward with use_qk_l2norm_in_kernel on unnormalised q / k: CUDA-graph medians of both plain-forward paths
(gdn_fwd_fused, gdn_prepare + gdn_fwd_st), each also without l2norm, on representative rows, as JSON lines."""
import json
import sys

import torch

from flash_qla import cp, ops
from flash_qla.validation import validate_inputs
from kernel_experiment import ROWS, graph_ms, inputs

cp.FORCE_SEGMENT_CHUNKS = 0
for name in sys.argv[1:] or ["2B 4096x8", "TP1 4096x8", "TP8 4096x8"]:
    q, k, v, g, beta, cu, h0 = inputs(*ROWS[name])
    q, k = q * 3, k * 0.5  # unnormalised rows
    p = validate_inputs(q, k, v, g, beta, None, h0, cu)
    row = {"row": name}
    for path, fused in (("fused", True), ("split", False)):
        ops.USE_FUSED = fused
        row[f"{path}_l2norm_ms"] = round(graph_ms(lambda: ops.forward(p, q, k, v, g, beta, h0, True, cu, True)), 4)
        row[f"{path}_plain_ms"] = round(graph_ms(lambda: ops.forward(p, q, k, v, g, beta, h0, True, cu, False)), 4)
    print(json.dumps(row), flush=True)
