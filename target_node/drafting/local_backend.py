"""The drafter in the target's process: what `--proposer local` drafts with, over the same
DraftBackend interface as the draft daemon's client, so the proposer cannot tell them apart."""

from __future__ import annotations

import torch

from draft_node.kv_cache import DraftKVCache, DraftStep
from draft_node.model import DFlashDrafter
from draft_node.predraft import Predrafts, predraft
from target_node.drafting.draft_pass import DraftPass


class LocalDraftBackend:
    """The drafter in this process, with its context K/V ring. Backends that share a `DraftPass`
    (a target's slots) draft the steps they sent ahead together."""

    def __init__(self, drafter: DFlashDrafter, capacity: int = 4096, drafting_pass: DraftPass | None = None) -> None:
        self.info = drafter.describe(capacity)
        self.drafter = drafter
        self.cache = DraftKVCache(drafter, capacity)
        self.drafting_pass = drafting_pass or DraftPass(drafter)
        self.counters = {"proposals": 0, "draft_ms": 0.0, "predrafts": 0, "predraft_hits": 0}
        self.attached = True  # in this process: always there
        self.predrafts: Predrafts | None = None
        self.mask: torch.Tensor | None = None  # the mask row, from the noise blocks it drafts
        self.hit = False  # whether the last `draft` came from a pre-draft

    def begin_request(self) -> None:
        self.drafting_pass.forget(self)
        self.predrafts = None

    def keepalive(self) -> None:
        pass

    def close(self) -> None:
        pass

    def keep(self, name: str, rows: int) -> int:
        return 0  # in this process a prefix's context is recomputed from its features: no wire to spare

    def restore(self, name: str, rows: int) -> int:
        self.reset(0)
        return 0

    def reset(self, position: int) -> None:
        self.drafting_pass.forget(self)
        self.predrafts = None
        self.cache.reset(position)

    def predraft(self, position: int, heads: torch.Tensor, known: list[int]) -> None:
        """Draft the named outcomes now. In this process that is time the target waits for, not
        time it overlaps: what the draft daemon does, here so both paths are tested alike."""
        self.predrafts = None
        if position != self.cache.length or self.mask is None:
            return
        self.predrafts = predraft(self.cache, heads.to(self.drafter.device), known, self.mask)
        self.counters["predrafts"] += 1

    def send_draft(
        self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int, predraft: int = -1
    ) -> None:
        """Leave this step with the pass: `draft` with the same arguments takes its drafts (none
        where its pre-draft will answer)."""
        if self._predrafted(start, position, rows, predraft) is None:
            step = self._step(start, features, noise, position, rows)
            self.drafting_pass.send(self, (start, position, rows), step)

    def draft(
        self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int, predraft: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        drafted = self._predrafted(start, position, rows, predraft)
        self.predrafts, self.hit = None, drafted is not None
        if drafted is not None:  # the context takes the rows all the same
            self.drafting_pass.forget(self)
            self.cache.append(start, features.to(self.drafter.device))
            self.counters["proposals"] += 1
            self.counters["predraft_hits"] += 1
            return drafted
        taken = self.drafting_pass.take(self, (start, position, rows))
        if taken is None:  # nothing sent ahead for this step: a pass of its own
            self.send_draft(start, features, noise, position, rows)
            taken = self.drafting_pass.take(self, (start, position, rows))
        (hidden, gate), draft_ms = taken
        self.counters["proposals"] += 1
        self.counters["draft_ms"] += draft_ms
        return hidden, gate

    def _predrafted(
        self, start: int, position: int, rows: int, outcome: int
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return self.predrafts.take(outcome, start, position, rows) if self.predrafts is not None else None

    def _step(self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int) -> DraftStep:
        if position != start + features.shape[0]:
            end = start + features.shape[0]
            raise ValueError(f"feature rows [{start}, {end}) must end where the block starts, {position}")
        self.mask = noise[1:2].to(self.drafter.device)
        return DraftStep(self.cache, start, features, noise, rows)

    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drafter.codebooks()
