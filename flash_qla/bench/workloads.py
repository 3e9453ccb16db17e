"""The timed calls: what one forward or one backward row runs.

The API is reached through the ``flash_qla`` module attributes at call time, so whichever backend the
package provides (the reference today, the sm_90a kernels later) is what gets timed, with no change here.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence, Tuple

import torch

import flash_qla

from .inputs import BenchInputs, draw_inputs
from .matrix import BenchRow, iter_rows, load_matrix


def forward_call(x: BenchInputs, backend: str, l2norm: bool = False) -> Callable[[], object]:
    """The user-facing forward, as an inference caller runs it (no autograd bookkeeping), with the host copy of the
    offsets (FLA's cu_seqlens_cpu keyword, which the caller that built the batch has): the forward is then planned from
    the longest sequence instead of equal lengths (planner.plan_forward). l2norm: use_qk_l2norm_in_kernel (as
    transformers' Qwen3-Next layers call it)."""
    cu_cpu = x.cu_seqlens.cpu()

    def run():
        with torch.no_grad():
            return flash_qla.chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0,
                                                    output_final_state=True, cu_seqlens=x.cu_seqlens,
                                                    cu_seqlens_cpu=cu_cpu, backend=backend,
                                                    use_qk_l2norm_in_kernel=l2norm)
    return run


def forward_for_backward(x: BenchInputs, backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(g_cumsum, A) from the low-level forward: what the backward consumes, made outside its timing."""
    g_cumsum, A, _o, _h, _final = flash_qla.chunk_gated_delta_rule_fwd(
        x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0, output_final_state=True,
        cu_seqlens=x.cu_seqlens, backend=backend)
    return g_cumsum, A


def backward_call(x: BenchInputs, g_cumsum: torch.Tensor, A: torch.Tensor, backend: str,
                  cu_seqlens_cpu: Optional[torch.Tensor] = None) -> Callable[[], object]:
    """The low-level backward as the peers' benchmark times FlashQLA's: dq, dk, dv, dbeta, dg, dh0 from
    the saved forward tensors, the output gradient do and the final-state gradient dht (cu_seqlens_cpu: the lengths
    on the host too, which plan the chains)."""
    def run():
        return flash_qla.chunk_gated_delta_rule_bwd(x.q, x.k, x.v, g_cumsum, x.beta, A, x.do, dht=x.dht,
                                                    scale=x.scale, initial_state=x.h0, cu_seqlens=x.cu_seqlens,
                                                    backend=backend, cu_seqlens_cpu=cu_seqlens_cpu)
    return run


def forward_rows(wants: Sequence[str], backend: str = "kernels",
                 l2norm: bool = False) -> Iterator[Tuple[BenchRow, BenchInputs, Callable]]:
    """(row, inputs, the timed forward call) for each forward row of the standard matrix whose key contains one of
    wants (the experiment scripts' row selection)."""
    for row in iter_rows(load_matrix(), ("fwd",), ""):
        if any(w in row.key for w in wants):
            x = draw_inputs(row, "cuda")
            yield row, x, forward_call(x, backend, l2norm)


def backward_rows(wants: Sequence[str], backend: str = "kernels") -> Iterator[Tuple[BenchRow, BenchInputs, Callable]]:
    """(row, inputs, the timed backward call) for each backward row of the standard matrix whose key contains one
    of wants (the experiment scripts' row selection), with the forward it consumes already run."""
    for row in iter_rows(load_matrix(), ("bwd",), ""):
        if any(w in row.key for w in wants):
            x = draw_inputs(row, "cuda")
            g_cumsum, A = forward_for_backward(x, backend)
            yield row, x, backward_call(x, g_cumsum, A, backend)
