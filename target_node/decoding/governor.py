"""Speculate only while it pays, and verify as many drafts as pay, by measured cost.

Two decisions, both from what this machine measures:

- **Whether to draft.** A drafter that accepts little makes every step slower than a plain
  one (a wider verify, a draft round trip, a projection). The governor keeps the last 24
  drafting steps and the plain steps' rate; when drafting is slower than plain decoding beyond
  what the steps' scatter explains (by a standard error), it switches to plain steps and
  re-probes the drafter now and then (three steps a probe), backing off while the probes keep
  failing. Acceptance scatters widely from step to step (no draft accepted, then three), and
  in runs (prose, then code), so the rule before (the mean rate of the last 6 steps, a probe
  judged on one) switched off drafters that pay on average. On 40 held-out prompts (bf16, one
  core, in turns) the shipped drafter ran at 1.02x plain under that rule and 1.09x under this
  one; a random drafter at 0.97x and 0.98x (docs/benchmarks.md).
- **How many drafts to verify.** A verify step's cost is a measured table by width (on CPU
  it is not even monotonic: 5 rows can be cheaper than 3), and the drafts' worth is the
  expected number accepted: from the drafter's own probabilities (scaled by how well they
  have predicted acceptance so far) when it has them, else from how often each depth was
  accepted lately. The governor verifies the n that maximises expected tokens per second,
  (1 + accepted(n)) / (draft cost + verify cost(n + 1)), and n may be 0.

A daemon keeps one governor across requests, and each request decides with its own copy of it
(`fork`), given back when it ends (`absorb`): a new request starts from what the last ones learned
(rates, acceptance, whether drafting was on) but judges drafting on its own steps, within a short
backoff, and a request whose drafts always fail (a hostile prompt, another tenant's) no longer sets
the drafting and the verify depth of the requests beside it (an audit: 2-5x slower for them). The
verify costs, measured by the width of a batch's forward, stay one table for all.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from target_node.drafting.tree import DraftTree


@dataclass
class VerifyCosts:
    """Seconds a target step costs by width (tokens run at once), measured on this machine."""

    seconds: dict[int, float] = field(default_factory=dict)
    weight: float = 0.1  # of a new measurement in the running estimate

    def update(self, width: int, seconds: float) -> None:
        old = self.seconds.get(width)
        self.seconds[width] = seconds if old is None else (1 - self.weight) * old + self.weight * seconds

    def __call__(self, width: int) -> float:
        """The measured cost, or one interpolated between the nearest measured widths.

        Past the widest measured, it is optimistic (nearly flat, as on a GPU): a width that
        looks affordable gets tried, and then measured. A pessimistic guess would never be.
        """
        if width in self.seconds:
            return self.seconds[width]
        if not self.seconds:
            return 1.0 + 0.05 * (width - 1)
        below = [w for w in self.seconds if w < width]
        above = [w for w in self.seconds if w > width]
        if below and above:
            lo, hi = max(below), min(above)
            t = (width - lo) / (hi - lo)
            return (1 - t) * self.seconds[lo] + t * self.seconds[hi]
        if below:
            nearest = max(below)
            return self.seconds[nearest] * (1 + 0.05 * (width - nearest))
        return self.seconds[min(above)]

    def measure(self, target, widths: Sequence[int], context: int = 128, repeats: int = 3) -> None:  # a TargetModel
        """Time target steps of each width after a `context`-token prefix (median of `repeats`).
        One step of the widest warms up first: a warm-up at every width made a third of a daemon's
        start (the rows it lays out serve the narrower steps too, and the serving steps correct
        what a start measures: `update`)."""
        target.reset()
        target.forward([3 + i % 97 for i in range(context)])
        widths = list(widths)

        def step(width: int) -> float:
            began = time.perf_counter()
            hidden, _ = target.forward([5] * width)
            target.greedy(hidden)
            target.rollback(context)
            return time.perf_counter() - began

        step(max(widths, default=1))
        for width in widths:
            self.seconds[width] = statistics.median(step(width) for _ in range(repeats))
        target.reset()


@dataclass
class BatchProbes:
    """What a daemon's requests share about drafting in a batch: the one estimate of what a draft
    costs a step (`draft_s`: the drafter's, whoever asked), and when a batch where drafting does
    not pay (`Governor.pays_at`) drafts a step anyway to measure it anew: after `every` batch steps
    blocked, doubling while it keeps not paying, up to `most`; back to `least` once it pays. Kept
    per request, one probe refreshed one request's estimate and its paying reset the count, so the
    others stayed plain with theirs (a review)."""

    least: int = 8
    most: int = 256
    every: int = 8
    blocked: float = 0.0  # batch steps blocked since the last probe (each of B sequences counts 1/B)
    draft_s: float = 0.0

    def due(self, batch: int) -> bool:
        self.blocked += 1 / batch
        if self.blocked < self.every:
            return False
        self.blocked, self.every = 0.0, min(self.most, 2 * self.every)
        return True

    def paid(self) -> None:
        self.every, self.blocked = self.least, 0.0


CHANCE_PRIOR = 2.0  # tokens' worth of evidence a lookup's own chance counts for (Governor.chance_reach)


def _tenth(chance: float) -> int:
    return min(9, max(0, int(chance * 10)))


def _record(source: str, kind: str) -> str:
    """The key a lookup's record (of one kind of its guesses) is kept under."""
    return f"{source}:{kind}" if kind else source


@dataclass
class Governor:
    window: int = 24  # speculative steps in the rolling estimate
    min_spec_steps: int = 3  # before judging speculation at all, and a probe's length
    confidence: float = 1.0  # standard errors by which drafting must lose before it is switched off
    probe_every: int = 8  # plain steps before re-probing; doubles while probes fail
    max_probe_every: int = 256
    margin: float = 1.0  # drafting is measured against margin x the plain steps' rate (`loses`)
    # Above this many tokens per step a verify step (at most ~3 plain steps' cost on CPU, far
    # less on GPU) always pays, so plain steps are not even measured.
    sure_tau: float = 3.0
    max_nodes: int = 16  # the widest tree it considers verifying (verify width - 1)
    costs: VerifyCosts = field(default_factory=VerifyCosts)
    spec: deque = field(default_factory=deque)  # (tokens, seconds) of recent speculative steps
    # (tokens, seconds) of recent steps the drafter sat out: one token each, or more where a
    # looked-up continuation was verified (what drafting must beat is then plain steps with lookup)
    plain: deque = field(default_factory=deque)
    drafting: bool = True
    plain_streak: int = 0
    backoff: int = 0
    probing: bool = False  # the drafting steps since a probe began decide whether it succeeded
    switches: int = 0
    probes: int = 0
    batch_probes: BatchProbes = field(default_factory=lambda: BatchProbes())  # shared by a daemon's forks
    refresh: bool = False  # the next drafting step's cost replaces the running estimate (a batch probe)
    width: float = 1.0  # running estimate of the rows a drafting step verifies (1 + drafts)
    # Decayed sums: accepted drafts against what the drafter's probabilities predicted.
    predicted: float = 0.0
    actual: float = 0.0
    # Decayed counts per depth k (1-based; index 0 unused): steps that verified depth k with
    # depth k-1 accepted, and of those, how many accepted depth k. Starts at an even 1 in 2.
    depth_tries: list[float] = field(default_factory=lambda: [2.0] * 32)
    depth_hits: list[float] = field(default_factory=lambda: [1.0] * 32)
    # The same for looked-up continuations, per lookup (prompt lookup, the datastore): how deep
    # they were right lately.
    lookup_tries: dict[str, list[float]] = field(default_factory=dict)
    lookup_hits: dict[str, list[float]] = field(default_factory=dict)
    # A lookup's own chances (the datastore's vote shares) against how often they came out right, per
    # tenth of a chance: decayed tokens given a chance there (its depth reached), and of them how many
    # the target chose. The shares run high (0.54 on average where 38% were right, docs/trees.md).
    chance_tries: dict[str, list[float]] = field(default_factory=dict)
    chance_hits: dict[str, list[float]] = field(default_factory=dict)
    decay: float = 0.97

    # --- whether to draft ---------------------------------------------------

    def should_draft(self, batch: int = 1) -> bool:
        """Whether this step drafts, for one of `batch` sequences stepping together."""
        if self.drafting:
            # Measure a couple of plain steps once, so there is something to compare against.
            if len(self.spec) >= self.min_spec_steps and len(self.plain) < 2 and self.spec_tau() < self.sure_tau:
                return False
            if not self.probing and batch > 1:
                if self.pays_at(batch):
                    self.batch_probes.paid()
                elif self.batch_probes.due(batch):
                    # What drafting costs is measured only on drafting steps: one slow draft (a timeout,
                    # a restarting daemon) kept a batch plain for good (an audit: 108 tok/s down to 26).
                    # Now and then, backing off while it does not pay, one step drafts to measure it anew.
                    self.refresh = True
                else:
                    return False
            return True
        if self.plain_streak >= self.backoff:
            self.probes += 1
            self.drafting = self.probing = True
            self.spec.clear()  # judge the drafter afresh, on what it does now
        return self.drafting

    def record(
        self,
        drafted: bool,
        tokens: int,
        seconds: float,
        *,
        width: int = 1,
        draft_s: float = 0.0,
        predicted: float | None = None,
        chain: bool = True,
        timed: bool = True,
    ) -> None:
        """One step: whether it drafted (asked the drafter, whatever came back), tokens committed,
        its seconds (draft_s of them drafting), the width verified, and the accepted drafts the
        drafter's probabilities predicted (if any). `timed` False: its seconds are not its own
        (the forward also ran another request's prompt or hints), so they are not compared. What the
        forward cost by its width is `measured` apart: in a batch, one forward is every
        sequence's, and its width is theirs together."""
        if drafted:
            anew, self.refresh = not self.spec or self.refresh, False
            # Timed or not: the draft's wait comes before the forward, whatever else ran in it.
            self.draft_s = draft_s if anew else 0.8 * self.draft_s + 0.2 * draft_s
            self.width = width if anew else 0.8 * self.width + 0.2 * width
            self._learn_acceptance(tokens - 1, width - 1, predicted, chain)
            if timed:
                self.spec.append((tokens, seconds))
            while len(self.spec) > self.window:
                self.spec.popleft()
            self.plain_streak = 0
        else:
            if timed:
                self.plain.append((tokens, seconds))
            while len(self.plain) > self.window:
                self.plain.popleft()
            self.plain_streak += 1
        # Judged once drafting is on: in a batch every sequence records the one losing step, and
        # each judgement switched off again, doubling the backoff (8 sequences: to its cap at once).
        if drafted and self.drafting and len(self.spec) >= self.min_spec_steps and self.plain:
            self.probing = False
            if self.loses():
                self._switch_off()
            else:
                self.backoff = 0

    def _switch_off(self) -> None:
        self.drafting = self.probing = False
        self.switches += 1
        self.backoff = min(self.max_probe_every, self.backoff * 2 if self.backoff else self.probe_every)

    def loses(self) -> bool:
        """Whether the recent drafting steps were slower than plain steps, with confidence: each
        step's tokens minus what plain steps make in its time (at `margin` x their rate) has a
        mean below zero even `confidence` standard errors up."""
        plain = self.margin * self.plain_rate()
        excess = [tokens - seconds * plain for tokens, seconds in self.spec]
        mean = statistics.fmean(excess)
        error = statistics.stdev(excess) / len(excess) ** 0.5 if len(excess) > 1 else 0.0
        return mean + self.confidence * error < 0

    def pays_at(self, batch: int) -> bool:
        """Whether drafting for each of `batch` sequences stepping together beats plain steps for
        them all, by what was measured: every drafting sequence pays what it waited for its draft
        (a batch's remote drafts overlap on the wire, so that is their share of one another's)
        and adds its usual verify width to the one forward, against one row each. Alone (batch 1)
        the step-by-step judgement of `should_draft` decides."""
        if batch <= 1 or not self.spec:
            return True
        drafting = batch * self.spec_tau() / (batch * self.draft_s + self.costs(round(batch * self.width)))
        plain = batch / self.costs(batch)
        return drafting >= self.margin * plain

    # A request's own: where it is in its backoff, its counts for its stats. (The drafting steps
    # it inherits are judged with its own until a probe clears them: at most 2 x probe_every
    # steps, where the whole state given back let one request whose drafts all failed leave the
    # next, anyone's, plain for up to 256: a review.)
    OWN = ("probing", "plain_streak", "refresh", "switches", "probes")
    SHARED = ("costs", "batch_probes")  # one for all of a daemon's requests

    def fork(self) -> Governor:
        """A request's own governor: what the last requests learned (rates, acceptance, recent
        drafting steps, whether drafting was on), the one table of verify costs, and a backoff of
        at most 2 x probe_every before it probes on its own steps. `absorb` takes it back."""
        mine = copy.copy(self)
        for name, value in vars(self).items():
            if name not in self.SHARED:
                setattr(mine, name, copy.deepcopy(value))
        fresh = Governor()
        for name in self.OWN:
            setattr(mine, name, getattr(fresh, name))
        mine.backoff = min(self.backoff, 2 * self.probe_every)
        return mine

    def absorb(self, fork: Governor) -> None:
        """What a request's governor learned becomes what the next request starts from."""
        for name, value in vars(fork).items():
            if name not in self.SHARED and name not in self.OWN:
                setattr(self, name, copy.deepcopy(value))
        self.switches += fork.switches
        self.probes += fork.probes

    def measured(self, width: int, seconds: float) -> None:
        """A target forward of `width` rows (a batch's together) took `seconds`."""
        self.costs.update(width, seconds)

    @property
    def draft_s(self) -> float:
        """The running estimate of what drafting costs a step: one for all of a daemon's requests."""
        return self.batch_probes.draft_s

    @draft_s.setter
    def draft_s(self, seconds: float) -> None:
        self.batch_probes.draft_s = seconds

    # --- how many drafts to verify ---------------------------------------------

    def _learn_acceptance(self, accepted: int, verified: int, predicted: float | None, chain: bool) -> None:
        if predicted is not None:
            self.predicted = self.decay * self.predicted + predicted
            self.actual = self.decay * self.actual + accepted
        if chain:
            for k in range(1, min(verified, accepted + 1, len(self.depth_tries) - 1) + 1):
                self.depth_tries[k] = self.decay * self.depth_tries[k] + 1
                self.depth_hits[k] = self.decay * self.depth_hits[k] + (accepted >= k)

    @property
    def calibration(self) -> float:
        """How many drafts were accepted per one the drafter's probabilities predicted."""
        return min(2.0, max(0.05, (self.actual + 1) / (self.predicted + 1)))

    def expected_accepted(self, tree: DraftTree, probabilities: bool) -> list[float]:
        """Expected accepted drafts when verifying the first n nodes, n = 0..len(tree)."""
        if probabilities:
            return [self.calibration * e for e in tree.expected()]
        out, reach = [0.0], 1.0
        for k in tree.depths:  # a chain without probabilities: how deep recent steps got
            k = min(k, len(self.depth_tries) - 1)
            reach *= self.depth_hits[k] / self.depth_tries[k]
            out.append(out[-1] + reach)
        return out

    def nodes(self, tree: DraftTree, probabilities: bool, drafted: bool = True) -> int:
        """How many of the tree's first nodes to verify: the most expected tokens per second
        (`drafted`: the step paid for a draft; a looked-up continuation alone costs none)."""
        gains = self.expected_accepted(tree, probabilities)[: self.max_nodes + 1]
        draft_s = self.draft_s if drafted else 0.0
        rates = [(1 + g) / (draft_s + self.costs(n + 1)) for n, g in enumerate(gains)]
        return max(range(len(rates)), key=rates.__getitem__)

    def _lookup_counts(self, source: str, kind: str = "") -> tuple[list[float], list[float]]:
        """A lookup's (a kind of its guesses') decayed tries and hits per depth; it starts at an even 1 in 2."""
        key = _record(source, kind)
        if key not in self.lookup_tries:
            self.lookup_tries[key], self.lookup_hits[key] = [2.0] * 32, [1.0] * 32
        return self.lookup_tries[key], self.lookup_hits[key]

    def lookup_reach(self, depth: int, source: str = "lookup", kind: str = "") -> list[float]:
        """How often `source`'s looked-up continuations (of this `kind`) were right to depths
        1..`depth`, lately: the path probabilities its nodes enter a tree with (DraftTree.graft)."""
        tries, hits = self._lookup_counts(source, kind)
        out, reach = [], 1.0
        for k in range(1, depth + 1):
            k = min(k, len(tries) - 1)
            reach *= hits[k] / tries[k]
            out.append(reach)
        return out

    def learn_lookup(
        self,
        lookup: list[int],
        committed: list[int],
        source: str = "lookup",
        chances: list[float] | None = None,
        kind: str = "",
    ) -> None:
        """A step's continuation looked up by `source` against what the target committed after
        last_tok: depth k counts where depth k - 1 was right and the target's token there is known,
        whether or not the step verified the continuation's node; so does each token's own chance,
        where the lookup gave them; each `kind` of the lookup's guesses on its own."""
        tries, hits = self._lookup_counts(source, kind)
        by_chance = self._chance_counts(source, kind) if chances is not None else None
        for k in range(1, min(len(lookup), len(committed)) + 1):
            d = min(k, len(tries) - 1)
            right = lookup[k - 1] == committed[k - 1]
            tries[d] = self.decay * tries[d] + 1
            hits[d] = self.decay * hits[d] + right
            if by_chance is not None and k <= len(chances):
                b = _tenth(chances[k - 1])
                by_chance[0][b] = self.decay * by_chance[0][b] + 1
                by_chance[1][b] = self.decay * by_chance[1][b] + right
            if not right:
                break

    def _chance_counts(self, source: str, kind: str = "") -> tuple[list[float], list[float]]:
        key = _record(source, kind)
        if key not in self.chance_tries:
            self.chance_tries[key], self.chance_hits[key] = [0.0] * 10, [0.0] * 10
        return self.chance_tries[key], self.chance_hits[key]

    def chance_reach(self, chances: list[float], source: str, kind: str = "") -> list[float]:
        """The path probabilities of a continuation whose lookup gave each token a chance: each chance
        as often as tokens given one like it were right lately, the chance itself weighing as
        CHANCE_PRIOR such tokens (so before any step, and for a governor never taught, the chances as
        given). Each `kind` of a lookup's guesses keeps its own record."""
        tries, hits = self._chance_counts(source, kind)
        out, path = [], 1.0
        for chance in chances:
            b = _tenth(chance)
            path *= (hits[b] + CHANCE_PRIOR * chance) / (tries[b] + CHANCE_PRIOR)
            out.append(path)
        return out

    # --- reporting -----------------------------------------------------------

    def spec_tau(self) -> float:
        return sum(t for t, _ in self.spec) / len(self.spec) if self.spec else 0.0

    def spec_rate(self) -> float:
        tokens = sum(t for t, _ in self.spec)
        seconds = sum(s for _, s in self.spec)
        return tokens / seconds if seconds > 0 else 0.0

    def plain_rate(self) -> float:
        seconds = sum(s for _, s in self.plain)
        return sum(t for t, _ in self.plain) / seconds if seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "drafting": self.drafting,
            "switches_to_plain": self.switches,
            "probes": self.probes,
            "calibration": round(self.calibration, 3),
            "verify_ms_by_width": {str(w): round(s * 1000, 2) for w, s in sorted(self.costs.seconds.items())},
            "draft_ms": round(self.draft_s * 1000, 2),
            "spec_tok_s": round(self.spec_rate(), 2),
            "plain_tok_s": round(self.plain_rate(), 2),
        }
