"""What a request (or many) measured: tokens, steps, acceptance, time. One place computes tau and tok/s."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

from protocol.stats import RequestStats


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, taken from the prefix cache instead of prefilled
    new_tokens: int = 0
    decode_tokens: int = 0  # tokens after the first (which comes from the prefill)
    steps: int = 0  # target forward passes after the prefill
    plain_steps: int = 0  # of which had nothing to verify
    drafter_steps: int = 0  # of which asked the drafter, whatever it gave (a step that got nothing is also plain)
    proposed: int = 0
    accepted: int = 0
    histogram: Counter = field(default_factory=Counter)  # accepted drafts per step -> count
    ttft_s: float = 0.0
    decode_s: float = 0.0
    sources: Counter = field(default_factory=Counter)  # who drafted -> steps
    accepted_by_source: Counter = field(default_factory=Counter)  # who proposed the node -> drafts accepted
    accepted_on_steps: Counter = field(default_factory=Counter)  # who drafted the step -> drafts its steps accepted
    propose_s_by_source: Counter = field(default_factory=Counter)  # who drafted -> seconds drafting took
    propose_s: float = 0.0  # drafting: features + noise out, draft, projection back
    verify_s: float = 0.0  # target forward over [last_tok, drafts] and the rollback
    requests: int = 0
    governor: dict = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Mean tokens committed per target step (1.0 = no speculation gain)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def add(self, other: Stats) -> Stats:
        """Sum another request's figures into these (for totals over many requests)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, Counter):
                mine.update(theirs)
            elif isinstance(mine, (int, float)):
                setattr(self, f.name, mine + theirs)
        self.governor = other.governor or self.governor
        return self

    def report(self) -> RequestStats:
        """These figures as they travel (the `done` reply's stats)."""
        per_step = 1000 / self.steps if self.steps else 0.0
        return RequestStats(
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            new_tokens=self.new_tokens,
            steps=self.steps,
            plain_steps=self.plain_steps,
            drafter_steps=self.drafter_steps,
            proposed=self.proposed,
            accepted=self.accepted,
            acceptance_rate=self.accepted / self.proposed if self.proposed else 0.0,
            tau=round(self.tau, 4),
            histogram={str(k): v for k, v in sorted(self.histogram.items())},
            ttft_s=round(self.ttft_s, 4),
            decode_s=round(self.decode_s, 4),
            decode_tok_s=round(self.decode_tok_s, 2),
            sources=dict(self.sources),
            accepted_by_source=dict(self.accepted_by_source),
            governor=self.governor,
            propose_ms_per_step=round(self.propose_s * per_step, 3),
            verify_ms_per_step=round(self.verify_s * per_step, 3),
        )
