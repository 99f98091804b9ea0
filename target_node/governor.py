"""Speculate only while it pays: compare measured throughput of draft+verify steps with plain steps.

A drafter that accepts little makes every step slower than a plain one (a wider verify, a
draft round trip, a projection). The governor keeps a rolling estimate of tokens per second
for both kinds of step; when speculation falls behind plain decoding
it switches to plain steps and re-probes the drafter now and then (one step a probe),
backing off while the probes keep failing. A daemon keeps one governor across requests,
so a new request starts from what the last ones learned.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Governor:
    window: int = 6  # speculative steps in the rolling estimate
    min_spec_steps: int = 3  # before judging speculation at all
    probe_every: int = 8  # plain steps before re-probing; doubles while probes fail
    max_probe_every: int = 128
    margin: float = 1.0  # speculate while spec_rate >= margin * plain_rate
    # Above this many tokens per step a verify step (at most ~3 plain steps' cost on CPU, far
    # less on GPU) always pays, so plain steps are not even measured.
    sure_tau: float = 3.0
    spec: deque = field(default_factory=deque)  # (tokens, seconds) of recent speculative steps
    plain: deque = field(default_factory=deque)  # seconds of recent plain steps
    drafting: bool = True
    plain_streak: int = 0
    backoff: int = 0
    accepted: deque = field(default_factory=lambda: deque(maxlen=32))  # drafts accepted per recent step
    probing: bool = False  # one speculative step decides whether a probe succeeded
    switches: int = 0
    probes: int = 0

    def should_draft(self) -> bool:
        if self.drafting:
            # Measure a couple of plain steps once, so there is something to compare against.
            if len(self.spec) >= self.min_spec_steps and len(self.plain) < 2 and self.spec_tau() < self.sure_tau:
                return False
            return True
        if self.plain_streak >= self.backoff:
            self.probes += 1
            self.drafting = self.probing = True
            self.spec.clear()  # judge the drafter afresh, on what it does now
        return self.drafting

    def record(self, drafted: bool, tokens: int, seconds: float) -> None:
        if drafted:
            self.accepted.append(tokens - 1)
            self.spec.append((tokens, seconds))
            while len(self.spec) > self.window:
                self.spec.popleft()
            self.plain_streak = 0
        else:
            self.plain.append(seconds)
            while len(self.plain) > self.window:
                self.plain.popleft()
            self.plain_streak += 1
        enough = 1 if self.probing else self.min_spec_steps
        if drafted and len(self.spec) >= enough and self.plain:
            self.probing = False
            if self.spec_rate() < self.margin * self.plain_rate():
                self.drafting = False
                self.switches += 1
                self.backoff = min(self.max_probe_every, self.backoff * 2 if self.backoff else self.probe_every)
            else:
                self.backoff = 0

    def draft_limit(self, cap: int) -> int:
        """How many drafts to verify: one more than the depth that is still reached often.

        Every extra draft widens the verify step; drafts past the usual acceptance depth are
        rarely accepted. If 10% of recent steps accepted all k drafts, k grows by one, so
        the limit follows the drafter up again when it does better.
        """
        if len(self.accepted) < 4:
            return cap
        k = min(1, cap)
        while k < cap and sum(a >= k for a in self.accepted) >= 0.1 * len(self.accepted):
            k += 1
        return k

    def spec_tau(self) -> float:
        return sum(t for t, _ in self.spec) / len(self.spec) if self.spec else 0.0

    def spec_rate(self) -> float:
        tokens = sum(t for t, _ in self.spec)
        seconds = sum(s for _, s in self.spec)
        return tokens / seconds if seconds > 0 else 0.0

    def plain_rate(self) -> float:
        seconds = sum(self.plain)
        return len(self.plain) / seconds if seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "drafting": self.drafting,
            "switches_to_plain": self.switches,
            "probes": self.probes,
            "draft_limit": self.draft_limit(1 << 30) if self.accepted else None,
            "spec_tok_s": round(self.spec_rate(), 2),
            "plain_tok_s": round(self.plain_rate(), 2),
        }
