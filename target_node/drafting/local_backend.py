"""The drafter in the target's process: what `--proposer local` drafts with, over the same
DraftBackend interface as the draft daemon's client, so the proposer cannot tell them apart."""

from __future__ import annotations

import torch

from draft_node.kv_cache import DraftKVCache, DraftStep
from draft_node.model import DFlashDrafter
from target_node.drafting.draft_pass import DraftPass


class LocalDraftBackend:
    """The drafter in this process, with its context K/V ring. Backends that share a `DraftPass`
    (a target's slots) draft the steps they sent ahead together."""

    def __init__(self, drafter: DFlashDrafter, capacity: int = 4096, drafting_pass: DraftPass | None = None) -> None:
        self.info = drafter.describe(capacity)
        self.drafter = drafter
        self.cache = DraftKVCache(drafter, capacity)
        self.drafting_pass = drafting_pass or DraftPass(drafter)
        self.counters = {"proposals": 0, "draft_ms": 0.0}
        self.attached = True  # in this process: always there

    def begin_request(self) -> None:
        self.drafting_pass.forget(self)

    def keepalive(self) -> None:
        pass

    def keep(self, name: str, rows: int) -> int:
        return 0  # in this process a prefix's context is recomputed from its features: no wire to spare

    def restore(self, name: str, rows: int) -> int:
        self.reset(0)
        return 0

    def reset(self, position: int) -> None:
        self.drafting_pass.forget(self)
        self.cache.reset(position)

    def send_draft(self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int) -> None:
        """Leave this step with the pass: `draft` with the same arguments takes its drafts."""
        self.drafting_pass.send(self, (start, position, rows), self._step(start, features, noise, position, rows))

    def draft(
        self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        taken = self.drafting_pass.take(self, (start, position, rows))
        if taken is None:  # nothing sent ahead for this step: a pass of its own
            self.send_draft(start, features, noise, position, rows)
            taken = self.drafting_pass.take(self, (start, position, rows))
        (hidden, gate), draft_ms = taken
        self.counters["proposals"] += 1
        self.counters["draft_ms"] += draft_ms
        return hidden, gate

    def _step(self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int) -> DraftStep:
        if position != start + features.shape[0]:
            end = start + features.shape[0]
            raise ValueError(f"feature rows [{start}, {end}) must end where the block starts, {position}")
        return DraftStep(self.cache, start, features, noise, rows)

    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drafter.codebooks()
