"""The kernel path's switches, in one typed place.

Every field has a default that the planner's choice wins with; tests and the maintained benchmark scripts pin a field
to cover one variant or path (``with tuning.override(force_block_v=64): ...``). Plans are cached by call signature
(flash_qla/plans.py), so each change bumps ``settings.generation``, which is part of every plan's key.

Environment variables read once at import:
  FLASH_QLA_FUSED=0|1            pins use_fused (else the planner chooses per shape)
  FLASH_QLA_POISON_OUTPUTS=1     poison_outputs
  FLASH_QLA_PLAN_CACHE=N         plan_cache_size
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator, Optional


@dataclasses.dataclass
class Tuning:
    # The plain forward's path: None lets the planner choose (planner.plan_forward); True pins gdn_fwd_fused, False
    # leaves it out (gdn_prepare + gdn_fwd_chain, or intra-card CP).
    use_fused: Optional[bool] = None
    # A V block every chain kernel that builds it uses (tests cover each built variant); None: planned.
    force_block_v: Optional[int] = None
    # gdn_prepare's v-heads per CTA (a divisor of Hv / Hq, <= 4); None: planned.
    force_heads_per_cta: Optional[int] = None
    # Intra-card CP segment length in chunks; 0 never takes CP; None: planned (the forward: planner.plan_forward; the
    # backward's recompute: cp.plan_segment_chunks).
    force_segment_chunks: Optional[int] = None
    # The forward's intra-card CP flavour: True on gdn_fwd_fused (flash_qla/fused_cp.py), False on gdn_prepare +
    # gdn_fwd_chain; None: planned (a forced segment length takes the fused flavour where it is built).
    cp_fused: Optional[bool] = None
    # use_qk_l2norm_in_kernel: True normalises q / k by a gdn_l2norm pass ahead of the plain kernels, False in the
    # l2norm builds; None: planned (planner.PRENORM_US).
    prenorm: Optional[bool] = None
    # Fill every output and workspace with NaN (integer tables: their most negative value) before the launches,
    # so an element a kernel fails to write shows.
    poison_outputs: bool = False
    # The backward's recompute chain runs on a side stream beside the dh chain (the two share the SMs).
    save_chain_beside_dh: bool = True
    # gdn_bwd_chunk's CTA count cap (None: one per SM); small caps push several items through each CTA's loop.
    chunk_ctas_max: Optional[int] = None
    # gdn_fwd_fused's persistent grid cap (None: planner.FUSED_PERSISTENT_CTAS).
    fused_ctas_max: Optional[int] = None
    # Replay recorded plans (flash_qla/plans.py); False runs every call as written, through the Python launches
    # (tests that watch those launches).
    replay: bool = True
    # Plans kept (least recently used dropped first): a serving workload's distinct shapes must not grow memory.
    plan_cache_size: int = 256
    # A recording whose workspace (every temporary of the call laid end to end, none reused) exceeds this many bytes
    # is not replayed: such calls (long sequences with many heads: a 256k-token, 64-head backward asks 38 GiB) run for
    # tens of milliseconds, so one C crossing saves nothing that shows, while the caching allocator's reuse of freed
    # temporaries keeps them within memory. At 1 GiB the standard 32k-token backward rows ran as written, at twice
    # the host cost (H100 host_overhead.json).
    plan_workspace_max: int = 16 << 30
    generation: int = dataclasses.field(default=0, repr=False)

    def __setattr__(self, name: str, value) -> None:
        if name != "generation" and name not in {f.name for f in dataclasses.fields(self)}:
            raise AttributeError(f"flash_qla.tuning has no setting {name!r}")
        if name.endswith("_ctas_max") and value is not None and not (isinstance(value, int) and value > 0):
            raise ValueError(f"flash_qla.tuning.{name} must be a positive int or None, got {value!r}")
        object.__setattr__(self, name, value)
        if name != "generation":
            object.__setattr__(self, "generation", self.generation + 1)

    @classmethod
    def from_env(cls) -> "Tuning":
        env = os.environ
        return cls(use_fused={"0": False, "1": True}.get(env.get("FLASH_QLA_FUSED", "")),
                   poison_outputs=env.get("FLASH_QLA_POISON_OUTPUTS") == "1",
                   plan_cache_size=int(env.get("FLASH_QLA_PLAN_CACHE", "256")))


settings = Tuning.from_env()


@contextlib.contextmanager
def override(**changes) -> Iterator[Tuning]:
    """Set some fields for the duration of a ``with`` block, then restore them."""
    before = {name: getattr(settings, name) for name in changes}
    try:
        for name, value in changes.items():
            setattr(settings, name, value)
        yield settings
    finally:
        for name, value in before.items():
            setattr(settings, name, value)
