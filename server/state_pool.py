"""The state pool: resident session states of one shape in one tensor on the backend's device.

A pool is ``tensor [capacity, Hv, K, V]``; a session that is resident owns one row (its *slot*). A launch reads
its sessions' rows with :meth:`StatePool.gather` and writes the final states back with :meth:`StatePool.scatter`
(the layout the kernels' pool-indexed interface, ``initial_state=pool, initial_state_indices=slots``, reads and
updates in place). Rows grow by doubling up to a row limit the session store derives from ``--max-state-mb``.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch


class StateShape(NamedTuple):
    """What a session's state looks like: the key of its pool."""
    num_v_heads: int
    head_dim_k: int
    head_dim_v: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.num_v_heads * self.head_dim_k * self.head_dim_v * torch.empty((), dtype=self.dtype).element_size()


class StatePool:
    INITIAL_ROWS = 8

    def __init__(self, shape: StateShape, device: torch.device, max_rows: int):
        if max_rows < 1:
            raise ValueError(f"a state pool needs room for at least one row, got max_rows={max_rows}")
        self.shape = shape
        self.device = device
        self.max_rows = max_rows
        self.tensor = torch.zeros(0, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v, dtype=shape.dtype,
                                  device=device)
        self._free: List[int] = []

    @property
    def capacity(self) -> int:
        return self.tensor.shape[0]

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.shape.nbytes

    def can_grow_to(self, rows: int) -> int:
        """The capacity the next growth would give (doubling, capped at max_rows)."""
        return min(self.max_rows, max(self.INITIAL_ROWS, 2 * self.capacity, rows))

    def grow(self, rows: int) -> None:
        """Make the capacity ``rows`` (> capacity, <= max_rows); existing rows keep their slots."""
        if not self.capacity < rows <= self.max_rows:
            raise ValueError(f"cannot grow a pool of {self.capacity} rows to {rows} (max {self.max_rows})")
        grown = torch.zeros(rows, *self.tensor.shape[1:], dtype=self.tensor.dtype, device=self.device)
        grown[:self.capacity] = self.tensor
        self._free.extend(range(rows - 1, self.capacity - 1, -1))  # lowest slot handed out first
        self.tensor = grown

    def allocate(self) -> Optional[int]:
        """A free slot, or None when the pool is full (the caller evicts or grows)."""
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def write(self, slot: int, state: Optional[torch.Tensor]) -> None:
        """Fill a row: ``state`` (from disk or a client), or zeros for a new session."""
        if state is None:
            self.tensor[slot].zero_()
        else:
            self.tensor[slot].copy_(state)

    def read(self, slot: int) -> torch.Tensor:
        """A host copy of one row."""
        return self.tensor[slot].to("cpu", copy=True)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows ``slots`` (int64 on the pool's device) as a new tensor [len(slots), Hv, K, V]."""
        return self.tensor.index_select(0, slots)

    def scatter(self, slots: torch.Tensor, states: torch.Tensor) -> None:
        """Write ``states`` [len(slots), Hv, K, V] into rows ``slots`` (distinct)."""
        self.tensor.index_copy_(0, slots, states.to(self.tensor.dtype))
