"""What the target daemon has served since it started: the aggregate its `stats` reply carries.

Monitoring (the HTTP front end's /metrics and live page) translates these figures and keeps
none of its own, so there is one bookkeeping: the daemon's, updated once per finished
request. Timings are taken here too, where the request is queued and its tokens leave: time
to first token counts from arrival (queue wait included), gaps between commits are the
inter-token latency a streaming client sees, and end to end runs from arrival to `done`.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from target_node.decoding.stats import Stats

if TYPE_CHECKING:
    from target_node.drafting.proposers import Proposer

# Upper bounds in seconds (Prometheus `le`); one more bucket holds everything above the last.
LATENCY_BOUNDS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_BOUNDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class LatencyHistogram:
    """Counts per bucket and their sum: what a Prometheus histogram is rebuilt from."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1  # a value equal to a bound is in it (le)
        self.sum += seconds

    def to_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum, "count": sum(self.counts)}


class RequestClock:
    """One request's timings as the daemon sees them, from its arrival to its `done`."""

    def __init__(self, received: float) -> None:
        self.received = received  # time.monotonic() when the request was queued
        self.first: float | None = None  # seconds from arrival to the first committed tokens
        self.gaps: list[float] = []  # seconds between consecutive commits
        self.last: float | None = None

    def commit(self) -> None:
        now = time.monotonic()
        if self.last is None:
            self.first = now - self.received
        else:
            self.gaps.append(now - self.last)
        self.last = now

    def elapsed(self) -> float:
        return time.monotonic() - self.received


class ServedMetrics:
    """Totals over every request the daemon finished, and refusals by error code."""

    def __init__(self) -> None:
        self.finished: Counter = Counter()  # finish_reason -> requests
        self.refused: Counter = Counter()  # error code -> requests
        self.total = Stats()
        self.ttft = LatencyHistogram(LATENCY_BOUNDS)
        self.inter_token = LatencyHistogram(LATENCY_BOUNDS)
        self.end_to_end = LatencyHistogram(REQUEST_BOUNDS)
        self.queue = LatencyHistogram(REQUEST_BOUNDS)  # arrival to admission into a slot

    def finish(
        self,
        finish_reason: str,
        stats: Stats | None = None,
        clock: RequestClock | None = None,
        refused: str | None = None,
    ) -> None:
        """A request decoded to its end and answered with `done` (a queued request cancelled before it
        ran has no stats), or with the error `refused` where its `done` could not be sent: its tokens
        were still decoded, so they count."""
        if refused is None:
            self.finished[finish_reason] += 1
        else:
            self.refused[refused] += 1
        if stats is not None:
            self.total.add(stats)
        if clock is not None:
            if clock.first is not None:
                self.ttft.observe(clock.first)
            for gap in clock.gaps:
                self.inter_token.observe(gap)
            self.end_to_end.observe(clock.elapsed())

    def admit(self, queued_s: float) -> None:
        """A request took a slot after waiting `queued_s` in the queue."""
        self.queue.observe(queued_s)

    def refuse(self, code: str) -> None:
        """A request answered with an error (busy, context_length, bad_field, internal)."""
        self.refused[code] += 1

    def to_dict(self) -> dict:
        total = self.total
        return {
            "requests": dict(self.finished),
            "refused": dict(self.refused),
            "prompt_tokens": total.prompt_tokens,
            "cached_prompt_tokens": total.cached_tokens,
            "generation_tokens": total.new_tokens,
            "steps": total.steps,
            "plain_steps": total.plain_steps,
            "proposed": total.proposed,
            "accepted": total.accepted,
            "tau": total.tau,
            "accepted_per_step": accepted_per_step(total.histogram),
            "accepted_at_position": accepted_at_position(total.histogram),
            "drafted_steps": dict(total.sources),
            "ttft_s": self.ttft.to_dict(),
            "inter_token_s": self.inter_token.to_dict(),
            "e2e_s": self.end_to_end.to_dict(),
            "queue_s": self.queue.to_dict(),
        }


# Positions reported one by one. Past the deepest block a drafter may have (128) only hints are
# accepted, as many as a client chooses: each depth a key of its own let 512 cheap requests make
# every `stats` cost 26 ms, and a label each for Prometheus (an audit). Deeper steps count here.
DEEPEST_REPORTED = 128


def _folded(histogram: Counter) -> Counter:
    """Steps by drafts accepted, DEEPEST_REPORTED or more counted at DEEPEST_REPORTED."""
    folded: Counter = Counter()
    for accepted, steps in histogram.items():
        folded[min(accepted, DEEPEST_REPORTED)] += steps
    return folded


def accepted_per_step(histogram: Counter) -> dict[str, int]:
    """Steps by drafts accepted; the last key counts the steps that accepted DEEPEST_REPORTED or more."""
    return {str(k): v for k, v in sorted(_folded(histogram).items())}


def accepted_at_position(histogram: Counter) -> dict[str, int]:
    """Draft position k (1-based) was accepted in every step that accepted at least k drafts."""
    per_step = _folded(histogram)
    deepest = max((k for k, n in per_step.items() if n), default=0)
    at, running = {}, 0
    for k in range(deepest, 0, -1):
        running += per_step.get(k, 0)
        at[k] = running
    return {str(k): at[k] for k in range(1, deepest + 1)}


DRAFTER_COUNTERS = ("timeouts", "errors", "proposals", "predrafts", "predraft_hits", "restores", "restore_misses")


def drafter_state(proposers: Sequence[Proposer]) -> dict:
    """Whether the drafter answers, and its counters, over every slot's proposer.

    Only a DFlash proposer has a backend; a remote one knows whether it is `attached` and
    counts timeouts and errors (each one a step that fell back), a local one is always there.
    Each slot has its own link: read from the first alone, the figures hid the other slots'
    timeouts and errors (an audit: 0 reported where 3 slots had 9). `reachable`: some slot is
    attached (an idle slot attaches again only when it next drafts), `slots_attached` how many.
    """
    backends = list({id(p.backend): p.backend for p in proposers if p.backend is not None}.values())
    if not backends:
        return {}
    attached = sum(bool(backend.attached) for backend in backends)
    state = {"reachable": attached > 0, "slots_attached": attached, "slots": len(backends)}
    for key in DRAFTER_COUNTERS:
        if any(key in backend.counters for backend in backends):
            state[key] = sum(backend.counters.get(key, 0) for backend in backends)
    return state
