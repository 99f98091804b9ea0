"""The engine's KV cache: preallocated slots, position = index, rollback = a length.

Each slot holds one sequence's keys and values for every layer, in one tensor [layers, 2 (keys,
values), slots, kv_heads, capacity, head_dim], written in place by the forward (no concatenation). A slot's length says
which entries count: rolling back is setting it, and what lies beyond is overwritten by the
next forward. A tree step's accepted rows are gathered into place (`keep`). The capacity grows
by doubling when a sequence needs more, the only time entries are copied; a new sequence reserves
its whole prompt at once (`reserve`), so a long prompt prefilled in chunks grows it once, not at
every doubling it crosses (each growth copies every slot: 2.5 s at 9 slots x 4,096 fp32 positions).
New room is left uninitialised: every key a row reads was written first (rows.py), and not
touching it is what makes growing cheap (zero-filling made it 4x slower).

Sliding-window layers keep every position too: their window is a bound on the key list the
attention reads, so a rejected block never needs the past a window would have dropped, and
trees verify on them as on full attention.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        slots: int = 1,
        capacity: int = 256,
        max_capacity: int | None = None,
    ) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.slots = slots
        self.max_capacity = max_capacity
        self.capacity = 0
        self.kv = torch.zeros(0, device=self.device)
        self.lengths = [0] * slots
        self._allocate(min(capacity, max_capacity) if max_capacity else capacity)

    def _allocate(self, capacity: int) -> None:
        shape = (self.layers, 2, self.slots, self.kv_heads, capacity, self.head_dim)
        kv = torch.empty(shape, dtype=self.dtype, device=self.device)
        if self.capacity:
            kv[..., : self.capacity, :] = self.kv
        self.kv, self.capacity = kv, capacity
        # Per layer, keys and values [slots, kv_heads, capacity, head_dim]: contiguous views, made once.
        self.keys = [kv[i, 0] for i in range(self.layers)]
        self.values = [kv[i, 1] for i in range(self.layers)]

    def reserve(self, positions: int) -> None:
        """Make room for `positions` entries per slot (doubling, so growth is rare)."""
        if positions <= self.capacity:
            return
        if self.max_capacity is not None and positions > self.max_capacity:
            raise ValueError(f"the KV cache holds at most {self.max_capacity} positions, not {positions}")
        capacity = max(positions, 2 * self.capacity)
        self._allocate(min(capacity, self.max_capacity) if self.max_capacity else capacity)

    def read(self, slot: int, positions: int) -> torch.Tensor:
        """A copy of the slot's first `positions` entries [layers, 2, kv_heads, positions, head_dim]."""
        if positions > self.lengths[slot]:
            raise ValueError(f"slot {slot} holds {self.lengths[slot]} positions, not {positions}")
        return self.kv[:, :, slot, :, :positions].clone()

    def load(self, slot: int, entries: torch.Tensor) -> None:
        """The slot holds `entries` (as `read` gives them) as its first positions, and nothing after."""
        positions = entries.shape[3]
        self.reserve(positions)
        self.kv[:, :, slot, :, :positions] = entries
        self.lengths[slot] = positions

    def bytes_per_position(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    def keep(self, slot: int, start: int, rows: list[int]) -> None:
        """After a forward from `start`: its rows `rows` (ascending offsets) move to start, start + 1, ..."""
        if rows != list(range(len(rows))):
            src = torch.tensor(rows, device=self.device) + start
            self.kv[:, :, slot, :, start : start + len(rows)] = self.kv[:, :, slot, :, src]
        self.lengths[slot] = start + len(rows)
