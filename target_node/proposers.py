"""Who drafts: one small interface, so the speculative loop does not care.

A proposer sees the committed tokens (prompt + output; the last one is `last_tok`, not yet
run through the target) and returns up to `max_tokens` guesses for what follows. An empty
proposal makes the loop take a plain one-token step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from target_node.target import TargetModel


@dataclass
class Proposal:
    tokens: list[int]
    # Draft logits [len(tokens), vocab] where the proposer has a distribution (for sampling);
    # None means the proposal is one-hot.
    logits: torch.Tensor | None = None
    source: str = ""


EMPTY = Proposal([])


class Proposer(Protocol):
    name: str

    def begin(self, target: TargetModel) -> None:
        """A new request starts: forget per-request state."""

    def propose(self, target: TargetModel, tokens: list[int], max_tokens: int) -> Proposal: ...


class NoProposer:
    """Plain greedy decoding through the same loop: the reference the others must equal."""

    name = "none"

    def begin(self, target: TargetModel) -> None:
        pass

    def propose(self, target: TargetModel, tokens: list[int], max_tokens: int) -> Proposal:
        return EMPTY


class NGramProposer:
    """Prompt lookup: continue the most recent earlier occurrence of the last n tokens."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 8) -> None:
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft

    def begin(self, target: TargetModel) -> None:
        pass

    def propose(self, target: TargetModel, tokens: list[int], max_tokens: int) -> Proposal:
        limit = min(self.max_draft, max_tokens)
        if limit <= 0:
            return EMPTY
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            # Latest match first: recent text predicts the next tokens best.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + limit]
                    if follow:
                        return Proposal(follow, source=self.name)
        return EMPTY


class DraftBackend(Protocol):
    """A DFlash drafter, in process or across the wire."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    draft_vocab: list[int]  # token ids drafts come from; [] = all

    def begin_request(self) -> None:
        """A new request starts."""

    def reset(self, position: int) -> None:
        """Forget context at and after `position`; if it holds less, start the context there."""

    def draft(self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int) -> torch.Tensor:
        """Append feature rows from `start`, then return block hidden states for slots 1..rows."""


class DrafterUnavailable(RuntimeError):
    """The drafter did not answer in time; the loop carries on without it."""


class DFlashProposer:
    """Block drafts from a DFlash drafter: ship new feature rows and the noise block, project the reply."""

    name = "dflash"

    def __init__(self, backend: DraftBackend, fallback: Proposer | None = None) -> None:
        self.backend = backend
        self.fallback = fallback or NoProposer()
        self.synced: int | None = None  # positions [.., synced) are with the drafter; None: unknown

    def begin(self, target: TargetModel) -> None:
        target.set_taps(self.backend.target_layer_ids)
        target.check_token(self.backend.mask_token_id, "the drafter's mask_token_id")
        target.set_draft_vocab(self.backend.draft_vocab)
        self.fallback.begin(target)
        self.backend.begin_request()
        self.synced = None

    def propose(self, target: TargetModel, tokens: list[int], max_tokens: int) -> Proposal:
        rows = min(self.backend.block_size - 1, max_tokens)
        if rows <= 0:
            return EMPTY
        position = len(tokens) - 1
        ring = target.ring
        try:
            if self.synced is None or self.synced < ring.oldest:
                self.backend.reset(ring.oldest)
                self.synced = ring.oldest
            features = ring.read(self.synced, position)
            noise = target.embed([tokens[-1]] + [self.backend.mask_token_id] * (self.backend.block_size - 1))
            hidden = self.backend.draft(self.synced, features, noise, position, rows)
        except DrafterUnavailable:
            self.synced = None
            return self.fallback.propose(target, tokens, max_tokens)
        self.synced = position
        logits = target.project(hidden)
        return Proposal(logits.argmax(-1).tolist(), logits, self.name)


class LocalDraftBackend:
    """The drafter in this process, with its context K/V ring."""

    def __init__(self, drafter, capacity: int = 4096) -> None:  # noqa: ANN001 - a DFlashDrafter
        from draft_node.kv_cache import DraftKVCache

        cfg = drafter.config
        self.block_size, self.mask_token_id, self.target_layer_ids = (
            cfg.block_size,
            cfg.mask_token_id,
            cfg.target_layer_ids,
        )
        self.draft_vocab = drafter.draft_vocab
        self.cache = DraftKVCache(drafter, capacity)
        self.counters = {"proposals": 0, "draft_ms": 0.0}

    def begin_request(self) -> None:
        pass

    def reset(self, position: int) -> None:
        self.cache.reset(position)

    def draft(self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int) -> torch.Tensor:
        began = time.perf_counter()
        self.cache.append(start, features)
        hidden = self.cache.draft(noise, position)[1 : 1 + rows]
        self.counters["proposals"] += 1
        self.counters["draft_ms"] += (time.perf_counter() - began) * 1000
        return hidden
