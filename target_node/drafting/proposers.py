"""Who drafts: one small interface, so the speculative loop does not care.

A proposer sees the committed tokens (prompt + output; the last one is `last_tok`, not yet
run through the target) and returns up to `max_tokens` guesses for what follows. An empty
proposal makes the loop take a plain one-token step. A proposer that reads target features
names the layers in `taps`; the loop hands it the committed positions' features through
`commit`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from target_node.drafting.bridge import DrafterBridge
from target_node.drafting.outcomes import likeliest_outcomes
from target_node.drafting.proposal import EMPTY, Continuation, Proposal
from target_node.drafting.settings import NO_PROPOSER
from target_node.drafting.tree import DraftTree
from target_node.model.target import TargetModel


class Proposer(Protocol):
    name: str
    taps: tuple[int, ...]  # target layers whose outputs it reads; () for none
    backend: DraftBackend | None  # the DFlash drafter it drafts with (its state and counters); None for none
    drafts: bool  # whether a propose now asks anything that may draft (a drafter, n-grams): a step's cost to judge

    def begin(self, target: TargetModel) -> None:
        """A new request starts: forget per-request state."""

    def propose(self, tokens: list[int], max_tokens: int) -> Proposal: ...

    def prefetch(self, tokens: list[int], max_tokens: int) -> None:
        """Start the `propose` that follows with the same arguments (a remote drafter sends its
        request now, so the drafts of a batch's requests overlap); others do nothing here."""

    def predraft(self, tokens: list[int], tree: DraftTree, proposal: Proposal) -> None:
        """The target is about to verify `tree` after `tokens`: a drafter elsewhere may draft the
        next block for its likeliest outcomes meanwhile; others do nothing here."""

    def commit(self, start: int, features: torch.Tensor | None) -> None:
        """The target committed positions [start, start + rows); `features` are their taps."""

    def held_features(self, end: int) -> tuple[int, torch.Tensor] | None:
        """The committed features it still holds of positions [0, end), for a later request with
        the same prefix: (the first position held, its rows on); None where it holds none."""

    @property
    def reach(self) -> int:
        """How far back its drafter reads features (its ring's capacity); 0: no limit, or none read."""

    def keep(self, name: str, rows: int) -> None:
        """Its drafter keeps its context of positions [0, rows) under `name`, where it can."""

    def restore(self, name: str, rows: int) -> None:
        """Its drafter starts this request's context from what was kept under `name` (after the
        prefix's features were committed): only the rows after it then travel."""


class NoProposer:
    """Plain greedy decoding through the same loop: the reference the others must equal."""

    name = NO_PROPOSER
    taps: tuple[int, ...] = ()
    backend: DraftBackend | None = None
    drafts = False

    def begin(self, target: TargetModel) -> None:
        pass

    def propose(self, tokens: list[int], max_tokens: int) -> Proposal:
        return EMPTY

    def prefetch(self, tokens: list[int], max_tokens: int) -> None:
        pass

    def predraft(self, tokens: list[int], tree: DraftTree, proposal: Proposal) -> None:
        pass

    def commit(self, start: int, features: torch.Tensor | None) -> None:
        pass

    def held_features(self, end: int) -> tuple[int, torch.Tensor] | None:
        return None

    @property
    def reach(self) -> int:
        return 0

    def keep(self, name: str, rows: int) -> None:
        pass

    def restore(self, name: str, rows: int) -> None:
        pass


def prompt_lookup(tokens: list[int], limit: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `limit` tokens that followed the latest earlier occurrence of the longest tail of
    `tokens` (max_ngram tokens down to min_ngram) that occurred before; [] where none did."""
    return matched_lookup(tokens, limit, max_ngram, min_ngram)[0]


def matched_lookup(tokens: list[int], limit: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[list[int], int]:
    """`prompt_lookup`'s continuation, and the length of the tail it matched (0: none).

    One backward pass: each earlier position holding the last token is the end of a match as long
    as the tokens before it agree with the tail's; the latest match of the longest length wins
    (recent text predicts the next tokens best)."""
    end = len(tokens) - 1
    if limit <= 0 or end < 1:
        return [], 0
    last, longest = tokens[-1], min(max_ngram, end)
    found = dict.fromkeys(range(min_ngram, longest + 1), -1)  # match length -> its latest end
    for i in range(end - 1, -1, -1):
        if tokens[i] != last:
            continue
        n = 1
        while n < longest and i - n >= 0 and tokens[i - n] == tokens[end - n]:
            n += 1
        if n >= min_ngram and found[n] < 0:
            found[n] = i
            if n == longest:
                break
    for n in range(longest, min_ngram - 1, -1):
        if found[n] >= 0:
            return tokens[found[n] + 1 : found[n] + 1 + limit], n
    return [], 0


class Lookup(Protocol):
    """A source of continuations found, not drafted (no model runs): each greedy tree verifies
    what it finds as one more branch."""

    name: str

    def __call__(self, tokens: list[int], limit: int) -> Continuation:
        """Up to `limit` tokens it expects after `tokens` (none: nothing found)."""


class PromptLookup:
    """The context's own earlier continuation of its tail (`prompt_lookup`), named by the length of
    the tail it matched: the governor learns how deep each length's continuations are right (a
    3-token match is a better guess than a 1-token one)."""

    name = "lookup"
    by_length = True  # else every continuation is one kind of guess (the benchmarks' A/B)

    def __call__(self, tokens: list[int], limit: int) -> Continuation:
        found, matched = matched_lookup(tokens, limit)
        return Continuation(found, kind=f"{matched}-gram" if self.by_length and found else "")


PROMPT_LOOKUP = PromptLookup()


class NGramProposer(NoProposer):
    """Prompt lookup: continue the most recent earlier occurrence of the last n tokens."""

    name = "ngram"
    drafts = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 8) -> None:
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft

    def propose(self, tokens: list[int], max_tokens: int) -> Proposal:
        follow = prompt_lookup(tokens, min(self.max_draft, max_tokens), self.max_ngram, self.min_ngram)
        return Proposal(follow, source=self.name) if follow else EMPTY


class DraftBackend(Protocol):
    """A DFlash drafter, in process or across the wire."""

    info: dict | None  # the drafter's description (DRAFTER_INFO); None while there is none to use
    attached: bool  # it can draft now (a remote one: its session is open on a daemon that answers)
    counters: dict  # what it did since it was made: proposals, draft_ms, and a remote one's failures
    hit: bool  # whether the last `draft` came from a pre-draft

    def send_draft(
        self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int, predraft: int = -1
    ) -> None:
        """Start the `draft` that follows with the same arguments (a batch's requests each send
        theirs first, so their drafts overlap); a backend may also do nothing here."""

    def predraft(self, position: int, heads: torch.Tensor, known: list[int]) -> None:
        """Draft, over the context as it ends at `position`, the next block of each named outcome:
        `heads` holds their known tokens [last_tok, accepted drafts, bonus] embedded, `known[i]`
        rows each (draft_node/predraft.py). The next `draft` names the one that happened."""

    def begin_request(self) -> None:
        """A new request starts."""

    def reset(self, position: int) -> None:
        """Forget context at and after `position`; if it holds less, start the context there."""

    def draft(
        self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int, predraft: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append feature rows from `start`, then return block hidden states for slots 1..rows and,
        from a DFlash2 drafter, their selector gate. With `predraft` >= 0 (the outcome of the last
        `predraft` that happened), the pre-draft's rows where it holds them (fewer: `hit`)."""

    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A DFlash2 drafter's selector codebooks (predecessor, successor) [vocab, rank]."""

    def keepalive(self) -> None:
        """Show the drafter this target is alive (remote: a ping now and then; local: nothing)."""

    def close(self) -> None:
        """Let the drafter go (remote: close the session, so a target restarted soon after finds
        the daemon's room free; local: nothing)."""

    def keep(self, name: str, rows: int) -> int:
        """Have the drafter keep its context of positions [0, rows) under `name` (the prefix cache's
        entry); returns the positions kept (0: none, e.g. an in-process drafter, which recomputes)."""

    def restore(self, name: str, rows: int) -> int:
        """Start the context from what `keep` kept under `name`, at most `rows` positions; returns
        how many it starts with (0: none held, the context is empty)."""


class DrafterUnavailable(RuntimeError):
    """The drafter did not answer in time; the loop carries on without it."""


class DFlashProposer:
    """Block drafts from a DFlash drafter: ship new feature rows and the noise block, project the reply.

    With `predraft` > 0, each chain verify also names that many likeliest outcomes for the
    drafter to pre-draft while the target verifies (draft_node/predraft.py); a step whose
    outcome was named takes its drafts from the pre-draft (source "predraft")."""

    name = "dflash"

    def __init__(self, backend: DraftBackend, fallback: NoProposer | None = None, predraft: int = 0) -> None:
        self.backend = backend
        self.fallback = fallback or NoProposer()
        self.drafting: DrafterBridge | None = None
        self.synced: int | None = None  # positions [.., synced) are with the drafter; None: unknown
        self.base: int | None = None  # ... from this one on (0: the whole context from the start)
        self.outcomes = predraft  # outcomes named per verify (0: no pre-drafting)
        # The last named outcomes: their verify's position and each one's tokens from there.
        self.named: tuple[int, list[tuple[int, ...]]] | None = None
        # The request `prefetch` sent ahead, keyed by its step: `propose` takes it instead of
        # reading the ring and building the noise a second time.
        self.sent: tuple[tuple[int, int, int], tuple] | None = None

    @property
    def taps(self) -> tuple[int, ...]:
        return self.drafting.taps if self.drafting is not None else ()

    @property
    def drafts(self) -> bool:
        return self.drafting is not None or self.fallback.drafts

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
        self.named = self.sent = None

    def commit(self, start: int, features: torch.Tensor | None) -> None:
        if features is not None and self.drafting is not None:
            self.drafting.ring.write(start, features)

    def predraft(self, tokens: list[int], tree: DraftTree, proposal: Proposal) -> None:
        self.named = None
        drafting, position, logits = self.drafting, len(tokens) - 1, proposal.logits
        if not self.outcomes or drafting is None or logits is None or not len(tree) or self.synced != position:
            return  # (the drafter's context must end where this block starts: it drafted it)
        deepest = drafting.block_size - 3  # a pre-draft keeps at least one slot to draft after b
        named = likeliest_outcomes(logits, tree, self.outcomes, deepest, proposal.columns)
        if not named:
            return
        heads = [(tokens[-1], *tree.path(node), b) for node, b in named]
        try:
            self.backend.predraft(
                position, drafting.target.embed([t for h in heads for t in h]), [len(h) for h in heads]
            )
        except DrafterUnavailable:
            self.synced = None  # the next propose falls back, or resends
            return
        self.named = (position, heads)

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

    def held_features(self, end: int) -> tuple[int, torch.Tensor] | None:
        ring = self.drafting.ring if self.drafting is not None else None
        if ring is None or ring.length == 0 or ring.oldest >= min(end, ring.length):
            return None
        return ring.oldest, ring.read(ring.oldest, min(end, ring.length))

    @property
    def reach(self) -> int:
        return self.drafting.ring.capacity if self.drafting is not None else 0

    def prefetch(self, tokens: list[int], max_tokens: int) -> None:
        if self.drafting is None:
            return
        try:
            request = self._request(tokens, max_tokens)
            if request is not None:
                self.backend.send_draft(*request)
                self.sent = ((len(tokens), tokens[-1], max_tokens), request)
        except DrafterUnavailable:
            self.synced = None  # `propose` falls back

    def propose(self, tokens: list[int], max_tokens: int) -> Proposal:
        drafting = self.drafting
        if drafting is None:
            return self.fallback.propose(tokens, max_tokens)
        sent, self.sent = self.sent, None
        try:
            if sent is not None and sent[0] == (len(tokens), tokens[-1], max_tokens) and self.synced == sent[1][0]:
                request = sent[1]
            else:
                request = self._request(tokens, max_tokens)
            if request is None:
                return EMPTY
            hidden, gate = self.backend.draft(*request)
        except DrafterUnavailable:
            self.synced = None
            return self.fallback.propose(tokens, max_tokens)
        self.synced = len(tokens) - 1
        proposal = drafting.guesses(hidden, gate, tokens[-1])
        proposal.source = "predraft" if self.backend.hit else self.name
        return proposal

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
        return self.synced, features, drafting.noise(tokens[-1]), position, rows, self._outcome(tokens)

    def _outcome(self, tokens: list[int]) -> int:
        """Which of the named outcomes happened: its index, or -1."""
        if self.named is None:
            return -1
        position, heads = self.named
        happened = tuple(tokens[position:])
        return heads.index(happened) if happened in heads else -1
