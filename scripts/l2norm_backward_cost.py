"""What use_qk_l2norm_in_kernel costs in the backward (GPU machine): JSON lines on stdout.

Per standard backward row (inputs as the bench draws them, but q / k scaled off unit norm), the median of
CUDA-event timings over repeated eager calls of flash_qla.backward.backward:
  plain_ms   without l2norm,
  fused_ms   with l2norm fused (gdn_prepare normalises, gdn_bwd_chunk's epilogue differentiates),
  torch_ms   the former path, rebuilt here: torch l2norm of q / k in fp32, the plain kernels on the normalised
             rows, autograd through the normalisation,
and the largest relative L2 difference between the fused and the torch path's dq / dk.
usage: python scripts/l2norm_backward_cost.py [ROW_SUBSTRING]
"""
import json
import sys

import torch

from flash_qla import backward, reference
from flash_qla.bench.inputs import draw_inputs
from flash_qla.bench.matrix import iter_rows, load_matrix
from flash_qla.validation import validate_inputs

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from backward_stages import median_ms  # noqa: E402


def torch_path(problem, x, q, k):
    """The backward before the fused l2norm: autograd through a torch normalisation around the plain kernels."""
    q_in, k_in = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    with torch.enable_grad():
        qn, kn = reference.l2norm(q_in.float()), reference.l2norm(k_in.float())
    grads = backward.backward(problem, qn.detach().to(q.dtype), kn.detach().to(k.dtype), x.v, x.g, x.beta, x.h0,
                              x.cu_seqlens, False, x.do, x.dht)
    return torch.autograd.grad((qn, kn), (q_in, k_in), grads[:2])


def main():
    want = sys.argv[1] if len(sys.argv) > 1 else ""
    for row in iter_rows(load_matrix(), ("bwd",), want):
        x = draw_inputs(row, "cuda")
        q, k = (x.q.float() * 3.0).to(x.q.dtype), (x.k.float() * 0.5).to(x.k.dtype)
        problem = validate_inputs(q, k, x.v, x.g, x.beta, None, x.h0, x.cu_seqlens)

        def run(l2norm, qq, kk):
            return backward.backward(problem, qq, kk, x.v, x.g, x.beta, x.h0, x.cu_seqlens, l2norm, x.do, x.dht)
        fused = run(True, q, k)
        old = torch_path(problem, x, q, k)
        diff = max(reference.relative_l2(fused[i], old[i]) for i in range(2))
        out = {"row": row.key, "plain_ms": median_ms(lambda: run(False, x.q, x.k)),
               "fused_ms": median_ms(lambda: run(True, q, k)),
               "torch_ms": median_ms(lambda: torch_path(problem, x, q, k)), "dq_dk_rel_l2_fused_vs_torch": diff}
        print(json.dumps({n: (round(v, 4) if isinstance(v, float) else v) for n, v in out.items()}), flush=True)


if __name__ == "__main__":
    main()
