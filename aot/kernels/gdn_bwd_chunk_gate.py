"""gdn_bwd_chunk with FLA's gate / beta activations compiled in (build(gate=1); gate_mode picks them at run time):
the backward of a call with use_gate_in_kernel / use_beta_sigmoid_in_kernel. A kernel of its own rather than an axis
of gdn_bwd_chunk, so the plain builds keep their names; aot/kernels/gdn_bwd_chunk.py says why they leave the code out.
"""
from .gdn_bwd_chunk import build as build_chunk

VARIANTS = {"dtype": ["bf16", "fp16"], "K": [64, 128], "V": [64, 128, 256]}
# gdn_bwd_chunk's (every CTA barrier written out there)
PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}


def build(dtype: str, K: int, V: int):
    return build_chunk(dtype, K, V, gate=1)
