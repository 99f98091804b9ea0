"""The engine's KV cache: preallocated slots, position = index, rollback = a length.

Each slot holds one sequence's keys and values for every layer, in one tensor [layers, 2 (keys,
values), slots, kv_heads, capacity, head_dim], written in place by the forward (no concatenation). A slot's length says
which entries count: rolling back is setting it, and what lies beyond is overwritten by the
next forward. A tree step's accepted rows are gathered into place (`keep`). The capacity grows
by doubling when a sequence needs more (up to the model's positions), the only time entries are
copied (every slot's live ones: 2.5 s at 9 slots x 4,096 fp32 positions); a new sequence reserves
its whole request at once (`reserve`: prompt and answer budget), so a long prompt prefilled in
chunks, and the answer after it, grow it once, not at every doubling they cross.
New room is left uninitialised: every key a row reads was written first (rows.py), and not
touching it is what makes growing cheap (zero-filling made it 4x slower).

Sliding-window layers keep every position too: their window is a bound on the key list the
attention reads, so a rejected block never needs the past a window would have dropped, and
trees verify on them as on full attention.
"""

from __future__ import annotations

import torch

OVERHANG = 64  # room past the model's positions at first: a verify of up to 63 tree rows


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
        doubling_limit: int | None = None,
    ) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.slots = slots
        self.doubling_limit = doubling_limit
        self.capacity = 0
        self.kv = torch.zeros(0, device=self.device)
        self.lengths = [0] * slots
        self._allocate(min(capacity, doubling_limit) if doubling_limit else capacity)

    def _allocate(self, capacity: int) -> None:
        shape = (self.layers, 2, self.slots, self.kv_heads, capacity, self.head_dim)
        kv = torch.empty(shape, dtype=self.dtype, device=self.device)
        live = max(self.lengths)  # past every slot's length lies nothing a row will read
        if live:
            kv[..., :live, :] = self.kv[..., :live, :]
        self.kv, self.capacity = kv, capacity
        # Per layer, keys and values [slots, kv_heads, capacity, head_dim]: contiguous views, made once.
        self.keys = [kv[i, 0] for i in range(self.layers)]
        self.values = [kv[i, 1] for i in range(self.layers)]

    def reserve(self, positions: int) -> None:
        """Make room for `positions` entries per slot: by doubling, so growth is rare, but never
        doubling past `doubling_limit` (the model's positions). Past it lie only a verify's rows
        near the end of the context, further by a few at each step: room made only as far as asked
        copied every slot's whole cache at each step there (an audit: four times 1.4 GB in four
        steps); it gets an OVERHANG that doubles, so it grows a few times at most."""
        if positions <= self.capacity:
            return
        limit = self.doubling_limit
        if limit is None or positions <= limit:
            capacity = 2 * self.capacity if limit is None else min(2 * self.capacity, limit)
            self._allocate(max(capacity, positions))
        else:
            self._allocate(limit + max(OVERHANG, 2 * (self.capacity - limit), positions - limit))

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
