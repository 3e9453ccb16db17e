"""Host-side cost of one forward call (GPU idle, no sync inside the loop), split by stage, in microseconds."""
import json
import sys

import torch

import flash_qla
from flash_qla import ops
from flash_qla.bench.timing import host_us_per_call
from flash_qla.validation import validate_inputs

T, hq, hv = 2048, 2, 8
q = torch.nn.functional.normalize(torch.randn(1, T, hq, 128, device="cuda"), dim=-1).bfloat16()
k = torch.nn.functional.normalize(torch.randn(1, T, hq, 128, device="cuda"), dim=-1).bfloat16()
v = torch.randn(1, T, hv, 128, device="cuda").bfloat16()
g = torch.nn.functional.logsigmoid(torch.randn(1, T, hv, device="cuda")) / 16
beta = torch.rand(1, T, hv, device="cuda")
cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
h0 = torch.randn(1, hv, 128, 128, device="cuda")
p = validate_inputs(q, k, v, g, beta, None, h0, cu)


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    return round(host_us_per_call(fn, torch.device("cuda"), n), 1)


out = {
    "api_call_us": per_call_us(lambda: flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                                       output_final_state=True, cu_seqlens=cu)),
    "validate_inputs_us": per_call_us(lambda: validate_inputs(q, k, v, g, beta, None, h0, cu)),
    "ops_forward_us": per_call_us(lambda: ops.forward(p, q, k, v, g, beta, h0, True, cu, False)),
    "offsets_us": per_call_us(lambda: ops._offsets(p, cu, q.device)),
    "supported_head_dims_us": per_call_us(ops.supported_head_dims),
    "empty_alloc_us": per_call_us(lambda: torch.empty(T, hv, 64, device="cuda", dtype=torch.bfloat16)),
}
print(json.dumps(out))
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
