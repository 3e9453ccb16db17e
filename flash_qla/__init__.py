"""flash_qla: Gated DeltaNet chunked prefill for Hopper (sm_90a), precompiled, no JIT at run time."""
from .api import BACKENDS, chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd

__version__ = "0.1.0"

__all__ = ["BACKENDS", "chunk_gated_delta_rule", "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd",
           "__version__"]
