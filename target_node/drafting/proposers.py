"""Who drafts: one small interface, so the speculative loop does not care.

A proposer sees the committed tokens (prompt + output; the last one is `last_tok`, not yet
run through the target) and returns up to `max_tokens` guesses for what follows. An empty
proposal makes the loop take a plain one-token step. A proposer that reads target features
names the layers in `taps`; the loop hands it the committed positions' features through
`commit`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from target_node.drafting.bridge import DrafterBridge
from target_node.drafting.selector import Lattice
from target_node.model.target import TargetModel


@dataclass
class Proposal:
    tokens: list[int]
    # Draft logits [len(tokens), vocab] where the proposer has a distribution (for sampling);
    # None means the proposal is one-hot.
    logits: torch.Tensor | None = None
    source: str = ""
    # A DFlash2 selector's lattice: sampled steps draw their drafts by walking it.
    walk: Lattice | None = None


EMPTY = Proposal([])


class Proposer(Protocol):
    name: str
    taps: tuple[int, ...]  # target layers whose outputs it reads; () for none
    backend: DraftBackend | None  # the DFlash drafter it drafts with (its state and counters); None for none

    def begin(self, target: TargetModel) -> None:
        """A new request starts: forget per-request state."""

    def propose(self, tokens: list[int], max_tokens: int) -> Proposal: ...

    def prefetch(self, tokens: list[int], max_tokens: int) -> None:
        """Start the `propose` that follows with the same arguments (a remote drafter sends its
        request now, so the drafts of a batch's requests overlap); others do nothing here."""

    def commit(self, start: int, features: torch.Tensor | None) -> None:
        """The target committed positions [start, start + rows); `features` are their taps."""

    def held_features(self, end: int) -> torch.Tensor | None:
        """The committed features of positions [0, end) it still holds (fewer where it holds fewer
        from 0), for a later request with the same prefix; None where it holds none from 0."""

    def keep(self, name: str, rows: int) -> None:
        """Its drafter keeps its context of positions [0, rows) under `name`, where it can."""

    def restore(self, name: str, rows: int) -> None:
        """Its drafter starts this request's context from what was kept under `name` (after the
        prefix's features were committed): only the rows after it then travel."""


class NoProposer:
    """Plain greedy decoding through the same loop: the reference the others must equal."""

    name = "none"
    taps: tuple[int, ...] = ()
    backend: DraftBackend | None = None

    def begin(self, target: TargetModel) -> None:
        pass

    def propose(self, tokens: list[int], max_tokens: int) -> Proposal:
        return EMPTY

    def prefetch(self, tokens: list[int], max_tokens: int) -> None:
        pass

    def commit(self, start: int, features: torch.Tensor | None) -> None:
        pass

    def held_features(self, end: int) -> torch.Tensor | None:
        return None

    def keep(self, name: str, rows: int) -> None:
        pass

    def restore(self, name: str, rows: int) -> None:
        pass


class NGramProposer(NoProposer):
    """Prompt lookup: continue the most recent earlier occurrence of the last n tokens."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 8) -> None:
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft

    def propose(self, tokens: list[int], max_tokens: int) -> Proposal:
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

    info: dict | None  # the drafter's description (DRAFTER_INFO); None while there is none to use
    attached: bool  # it can draft now (a remote one: its session is open on a daemon that answers)
    counters: dict  # what it did since it was made: proposals, draft_ms, and a remote one's failures

    def send_draft(self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int) -> None:
        """Start the `draft` that follows with the same arguments (a batch's requests each send
        theirs first, so their drafts overlap); a backend may also do nothing here."""

    def begin_request(self) -> None:
        """A new request starts."""

    def reset(self, position: int) -> None:
        """Forget context at and after `position`; if it holds less, start the context there."""

    def draft(
        self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append feature rows from `start`, then return block hidden states for slots 1..rows and,
        from a DFlash2 drafter, their selector gate."""

    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A DFlash2 drafter's selector codebooks (predecessor, successor) [vocab, rank]."""

    def keepalive(self) -> None:
        """Show the drafter this target is alive (remote: a ping now and then; local: nothing)."""

    def keep(self, name: str, rows: int) -> int:
        """Have the drafter keep its context of positions [0, rows) under `name` (the prefix cache's
        entry); returns the positions kept (0: none, e.g. an in-process drafter, which recomputes)."""

    def restore(self, name: str, rows: int) -> int:
        """Start the context from what `keep` kept under `name`, at most `rows` positions; returns
        how many it starts with (0: none held, the context is empty)."""


class DrafterUnavailable(RuntimeError):
    """The drafter did not answer in time; the loop carries on without it."""


class DFlashProposer:
    """Block drafts from a DFlash drafter: ship new feature rows and the noise block, project the reply."""

    name = "dflash"

    def __init__(self, backend: DraftBackend, fallback: NoProposer | None = None) -> None:
        self.backend = backend
        self.fallback = fallback or NoProposer()
        self.drafting: DrafterBridge | None = None
        self.synced: int | None = None  # positions [.., synced) are with the drafter; None: unknown
        self.base: int | None = None  # ... from this one on (0: the whole context from the start)

    @property
    def taps(self) -> tuple[int, ...]:
        return self.drafting.taps if self.drafting is not None else ()

    def begin(self, target: TargetModel) -> None:
        self.backend.begin_request()
        info = self.backend.info
        if info is None:  # no drafter yet (or none that fits): the fallback drafts this request
            self.drafting = None
        elif self.drafting is None or self.drafting.target is not target or self.drafting.info != info:
            try:
                self.drafting = DrafterBridge(target, info, self.backend.codebooks)
            except DrafterUnavailable:  # its codebooks did not come: the fallback drafts this request
                self.drafting = None
        if self.drafting is not None:
            self.drafting.ring.reset()
        self.fallback.begin(target)
        self.synced = self.base = None

    def commit(self, start: int, features: torch.Tensor | None) -> None:
        if features is not None and self.drafting is not None:
            self.drafting.ring.write(start, features)

    def keep(self, name: str, rows: int) -> None:
        if self.drafting is None or self.base != 0 or not self.synced:
            return
        try:
            self.backend.keep(name, min(rows, self.synced))
        except DrafterUnavailable:
            self.synced = None

    def restore(self, name: str, rows: int) -> None:
        if self.drafting is None:
            return
        try:
            restored = self.backend.restore(name, rows)
        except DrafterUnavailable:
            restored = 0
        self.synced, self.base = (restored, 0) if restored else (None, None)

    def held_features(self, end: int) -> torch.Tensor | None:
        ring = self.drafting.ring if self.drafting is not None else None
        if ring is None or ring.oldest > 0 or ring.length == 0:
            return None
        return ring.read(0, min(end, ring.length))

    def prefetch(self, tokens: list[int], max_tokens: int) -> None:
        if self.drafting is None:
            return
        try:
            request = self._request(tokens, max_tokens)
            if request is not None:
                self.backend.send_draft(*request)
        except DrafterUnavailable:
            self.synced = None  # `propose` falls back

    def propose(self, tokens: list[int], max_tokens: int) -> Proposal:
        drafting = self.drafting
        if drafting is None:
            return self.fallback.propose(tokens, max_tokens)
        try:
            request = self._request(tokens, max_tokens)
            if request is None:
                return EMPTY
            hidden, gate = self.backend.draft(*request)
        except DrafterUnavailable:
            self.synced = None
            return self.fallback.propose(tokens, max_tokens)
        self.synced = len(tokens) - 1
        guesses, logits, walk = drafting.guesses(hidden, gate, tokens[-1])
        return Proposal(guesses, logits, self.name, walk)

    def _request(self, tokens: list[int], max_tokens: int) -> tuple | None:
        """The backend's draft arguments for this step (the drafter's context brought in sync first)."""
        drafting = self.drafting
        rows = min(drafting.block_size - 1, max_tokens)
        if rows <= 0:
            return None
        position = len(tokens) - 1
        ring = drafting.ring
        if self.synced is None or self.synced < ring.oldest:
            self.backend.reset(ring.oldest)
            self.synced = self.base = ring.oldest
        features = ring.read(self.synced, position)
        return self.synced, features, drafting.noise(tokens[-1]), position, rows
