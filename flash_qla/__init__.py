"""flash_qla: Gated DeltaNet chunked prefill for Hopper (sm_90a), precompiled, no JIT at run time."""
from .api import BACKENDS, chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd

__version__ = "0.1.0"

__all__ = ["BACKENDS", "chunk_gated_delta_rule", "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd",
           "build_cp_context", "__version__"]

_DISTRIBUTED_NAMES = ("build_cp_context", "CPContext", "chunk_gated_delta_rule_cp")


def __getattr__(name):
    """The multi-GPU names come from flash_qla.distributed, imported on first use (torch.distributed stays
    unimported for single-GPU users)."""
    if name in _DISTRIBUTED_NAMES:
        try:
            from . import distributed
        except ImportError as e:
            raise AttributeError(f"flash_qla.{name} needs flash_qla.distributed, which is not available here "
                                 f"({type(e).__name__}: {e})") from e
        return getattr(distributed, name)
    raise AttributeError(f"module 'flash_qla' has no attribute {name!r}")
