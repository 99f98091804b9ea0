"""A position-indexed ring of tapped-layer features for committed positions.

The drafter reads each committed position's features once, when it first drafts after it;
a drafter that lost its state (a restarted daemon) may ask again for anything still in the
ring. So the ring only needs to hold as much context as the drafter can use.
"""

from __future__ import annotations

import torch


class FeatureRing:
    def __init__(self, capacity: int, width: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.capacity = capacity
        self.rows = torch.zeros(capacity, width, dtype=dtype, device=device)
        self.length = 0  # rows cover positions [oldest, length)
        self.first = 0  # no position before it is held (a prefix cache hit may start past 0; wrapping moves it)

    @property
    def oldest(self) -> int:
        return max(self.first, self.length - self.capacity)

    def reset(self) -> None:
        self.length = self.first = 0

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Store rows for positions [start, start+len); anything at or after `start` is replaced.
        An empty ring may begin anywhere: a prefix cache hit past its capacity brings only the
        rows a prefill of the prefix would have left in it."""
        if start > self.length and self.length == 0:
            self.first = self.length = start
        if start > self.length:
            raise ValueError(f"feature rows at {start} would leave a gap after position {self.length}")
        if start < self.oldest:
            raise ValueError(f"feature rows at {start}: the ring holds positions from {self.oldest} on")
        # What is gone stays gone: a rewrite below the end must not bring back positions whose
        # slots later ones took (a review).
        self.first = self.oldest
        count = rows.shape[0]
        if count > self.capacity:
            start, rows, count = start + count - self.capacity, rows[-self.capacity :], self.capacity
        slots = torch.arange(start, start + count, device=self.rows.device) % self.capacity
        self.rows[slots] = rows.to(self.rows.device, self.rows.dtype)  # a prefix cache's rows come from the host
        self.length = start + count

    def read(self, start: int, end: int) -> torch.Tensor:
        if start < self.oldest or end > self.length or start > end:
            raise IndexError(f"positions [{start}, {end}) not held; the ring holds [{self.oldest}, {self.length})")
        slots = torch.arange(start, end, device=self.rows.device) % self.capacity
        return self.rows[slots]
