"""The figures the target daemon reports, as typed messages: one request's (`RequestStats`, in its
`done` reply) and everything served since start (`ServedStats`, the `stats` reply).

The daemon builds them, and every reader (the client, the HTTP front end's usage and metrics,
benchmarks) reads them through these classes, so a figure is named in one place. On the wire they
stay plain maps (msgpack, JSON for the live page); `from_dict` takes the keys it knows and leaves
defaults for the rest, so an older or newer daemon's reply still reads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T", bound="_Figures")


def _finite(value: Any) -> Any:
    """NaN and Inf as nil: the wire carries finite floats only (and JSON has no others), and a
    figure nobody could measure must not cost a request its reply."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


class _Figures:
    def to_dict(self) -> dict[str, Any]:
        return _finite(asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any] | None) -> T:
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        # nil: not measured (see _finite), so the default stands
        return cls(**{key: value for key, value in (data or {}).items() if key in known and value is not None})


@dataclass
class RequestStats(_Figures):
    """One request: its tokens, its steps and what they accepted, its time, who drafted."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, taken from the prefix cache instead of prefilled
    new_tokens: int = 0
    steps: int = 0  # target forward passes after the prefill
    plain_steps: int = 0  # of which had nothing to verify
    drafter_steps: int = 0  # of which asked the drafter, whatever it gave (a step that got nothing is also plain)
    proposed: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    tau: float = 0.0  # tokens committed per step
    histogram: dict[str, int] = field(default_factory=dict)  # accepted drafts per step -> steps
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_tok_s: float = 0.0
    sources: dict[str, int] = field(default_factory=dict)  # who drafted -> steps
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # who drafted -> drafts accepted
    governor: dict[str, Any] = field(default_factory=dict)
    propose_ms_per_step: float = 0.0
    verify_ms_per_step: float = 0.0
    proposer: str = ""  # the daemon's proposer kind
    queued_s: float = 0.0
    batch: int = 0  # requests running when it ended, itself included
    drafter: dict[str, float] = field(default_factory=dict)  # this request's own drafter counters

    def line(self) -> str:
        """One line a person reads. Its ttft counts from the request's arrival, as the person waited:
        from its admission it said 69 ms for a first token that came 9.45 s after the request (an audit)."""
        first = (self.queued_s + self.ttft_s) * 1000
        queued = f" (queued {self.queued_s * 1000:.0f} ms)" if self.queued_s >= 0.0005 else ""
        return (
            f"{self.new_tokens} tokens | tau {self.tau:.2f} | accepted {self.accepted}/{self.proposed} | "
            f"{self.decode_tok_s:.1f} tok/s | ttft {first:.0f} ms{queued} | proposer {self.proposer or '?'}"
            f"{self._idle_proposer()}"
        )

    def _idle_proposer(self) -> str:
        """What drafted instead, where the proposer itself drafted no step: a drafter away or refused
        was still reported as "proposer dflash", the steps' lookups hiding that it gave nothing (an audit)."""
        own = {self.proposer, "predraft"}
        if self.proposer in ("", "none") or self.steps == 0 or own & self.sources.keys():
            return ""
        others = ", ".join(f"{source} {steps}" for source, steps in sorted(self.sources.items()))
        return f" (it drafted no step{'; steps drafted by ' + others if others else ''})"


@dataclass
class ServedStats(_Figures):
    """Everything the daemon served since it started, its queue now, and its drafter's state."""

    model: str = ""  # the folder the target was loaded from
    served: int = 0
    queued: int = 0
    running: int = 0
    max_batch: int = 0
    proposer: str = ""
    drafter: dict[str, Any] = field(default_factory=dict)  # reachable, timeouts, errors, ...
    prefill: dict[str, Any] = field(default_factory=dict)
    prefix_cache: dict[str, Any] | None = None  # None where the daemon keeps none
    cancelled: int = 0
    abandoned: int = 0  # requests whose client went away or fell silent
    requests: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    refused: dict[str, int] = field(default_factory=dict)  # error code -> requests
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    plain_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    tau: float = 0.0
    accepted_per_step: dict[str, int] = field(default_factory=dict)
    accepted_at_position: dict[str, int] = field(default_factory=dict)
    drafted_steps: dict[str, int] = field(default_factory=dict)  # who drafted -> steps
    # Latency histograms: {"bounds", "counts", "sum", "count"}.
    ttft_s: dict[str, Any] = field(default_factory=dict)
    inter_token_s: dict[str, Any] = field(default_factory=dict)
    e2e_s: dict[str, Any] = field(default_factory=dict)
    queue_s: dict[str, Any] = field(default_factory=dict)
