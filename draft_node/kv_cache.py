"""Per-stream draft state: a ring of context keys/values, one slot per committed position.

Context K/V depend only on a committed position's features and its position, so each is
computed once, when its feature row arrives, and kept until the ring wraps over it. A step
then costs the same at 128 or 4096 tokens of context. Noise-block K/V never enter the ring.
"""

from __future__ import annotations

import torch

from draft_node.model import DFlashDrafter


class OutOfOrderError(ValueError):
    """Feature rows that would leave a hole in the context."""


class DraftKVCache:
    def __init__(self, drafter: DFlashDrafter, capacity: int) -> None:
        cfg = drafter.config
        self.drafter = drafter
        self.capacity = capacity
        # [layer, kv_head, slot, head_dim]: per layer, one contiguous run attention can read
        # directly; block_size spare slots past the ring hold the block's own keys/values.
        shape = (len(drafter.layers), cfg.num_key_value_heads, capacity + cfg.block_size, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=drafter.dtype, device=drafter.device)
        self.values = torch.zeros_like(self.keys)
        # positions[slot] is the position a slot holds, -1 when empty or stale.
        self.positions = torch.full((capacity,), -1, dtype=torch.long, device=drafter.device)
        self.length = 0  # context covers positions [0, length)

    def reset(self, position: int) -> None:
        """Make the context end at `position`.

        Going back forgets what a new request (0) or a rolled-back target made stale. Going
        forward (a sender whose older rows are gone) forgets everything: the context then
        starts at `position`, and the next rows must start there.
        """
        if position < self.length:
            self.positions[self.positions >= position] = -1
        elif position > self.length:
            self.positions.fill_(-1)
        self.length = position

    @torch.inference_mode()
    def append(self, start: int, features: torch.Tensor) -> None:
        """Add feature rows for positions [start, start+rows). Rows we already hold are recomputed."""
        if start > self.length:
            raise OutOfOrderError(f"feature rows start at {start} but the context ends at {self.length}")
        self.reset(start)
        rows = features.shape[0]
        if rows == 0:
            return
        if rows > self.capacity:  # only the newest `capacity` rows can be kept
            start, features, rows = start + rows - self.capacity, features[-self.capacity :], self.capacity
        positions = torch.arange(start, start + rows, device=self.drafter.device)
        slots = positions % self.capacity
        for i, (k, v) in enumerate(self.drafter.context_kv(features.to(self.drafter.device), positions)):
            self.keys[i][:, slots] = k.transpose(0, 1)
            self.values[i][:, slots] = v.transpose(0, 1)
        self.positions[slots] = positions
        self.length = start + rows

    @torch.inference_mode()
    def draft_rows(self, noise: torch.Tensor, position: int, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hidden states of block slots 1..rows (slot 0, last_tok, is never a draft) and, for
        a DFlash2 drafter, their selector gate: what a proposal carries, wherever it is drafted."""
        hidden = self.draft(noise, position)[1 : 1 + rows]
        return hidden, self.drafter.gate(hidden) if self.drafter.config.dflash2 else None

    @torch.inference_mode()
    def draft(self, noise: torch.Tensor, position: int) -> torch.Tensor:
        """Block hidden states for a noise block whose slot 0 is the token at `position`."""
        if position != self.length:
            raise OutOfOrderError(f"noise block at position {position} but the context ends at {self.length}")
        # Slots at and past `live` hold nothing valid (before the ring wraps, slot == position),
        # so the block's keys/values go there, right after the context.
        live = min(self.length, self.capacity)
        kv = [(self.keys[i], self.values[i]) for i in range(len(self.drafter.layers))]
        return self.drafter.forward_block(noise.to(self.drafter.device), position, kv, self.positions[:live])
