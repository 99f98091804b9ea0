"""The speculative decoding loop: draft, verify in one forward pass, keep what the target stands by.

Every step runs `[last_tok, d1..dk]` through the target. Row i's argmax is the token the
target itself would emit after d_i, so the longest prefix of drafts matching those argmaxes,
plus the argmax after it (the bonus), is exactly what plain greedy decoding would emit.
Whatever the drafter says, the output is the target's own.

With a temperature, the same forward pass feeds speculative sampling instead (see sampling.py):
drafts are drawn from the drafter's q and accepted by the rejection rule, so the output is
distributed exactly as sampling from the target alone.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from target_node.governor import Governor
from target_node.proposers import EMPTY, Proposer
from target_node.sampling import Sampler, SamplingParams
from target_node.target import TargetModel
from target_node.text import TextStream

OnCommit = Callable[[list[int], str], None]


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # target forward passes after the prefill
    plain_steps: int = 0  # of which had nothing to verify
    proposed: int = 0
    accepted: int = 0
    histogram: Counter = field(default_factory=Counter)  # accepted drafts per step -> count
    ttft_s: float = 0.0
    decode_s: float = 0.0
    sources: Counter = field(default_factory=Counter)
    governor: dict = field(default_factory=dict)
    propose_s: float = 0.0  # drafting: features + noise out, draft, projection back
    verify_s: float = 0.0  # target forward over [last_tok, drafts] and the rollback

    @property
    def tau(self) -> float:
        """Mean tokens committed per target step (1.0 = no speculation gain)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first token comes from the prefill; decode speed counts the rest.
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "plain_steps": self.plain_steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "tau": round(self.tau, 4),
            "histogram": {str(k): v for k, v in sorted(self.histogram.items())},
            "ttft_s": round(self.ttft_s, 4),
            "decode_s": round(self.decode_s, 4),
            "decode_tok_s": round(self.decode_tok_s, 2),
            "sources": dict(self.sources),
            "governor": self.governor,
            "propose_ms_per_step": round(1000 * self.propose_s / self.steps, 3) if self.steps else 0.0,
            "verify_ms_per_step": round(1000 * self.verify_s / self.steps, 3) if self.steps else 0.0,
        }

    def line(self) -> str:
        return (
            f"{self.new_tokens} tokens | tau {self.tau:.2f} | accepted {self.accepted}/{self.proposed} "
            f"over {self.steps} steps | {self.decode_tok_s:.1f} tok/s | ttft {self.ttft_s * 1000:.0f} ms"
        )


@dataclass
class Result:
    tokens: list[int]
    text: str
    finish_reason: str  # "eos" | "length" | "stop" | "cancelled"
    stats: Stats


def accept_length(drafts: list[int], target_argmax: list[int]) -> int:
    """How many drafts agree with the target's own choices, counting from the first."""
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return n


def generate(
    target: TargetModel,
    prompt: list[int],
    proposer: Proposer,
    max_new_tokens: int,
    *,
    stop_strings: tuple[str, ...] = (),
    hint_tokens: list[int] | None = None,
    on_commit: OnCommit | None = None,
    cancel: threading.Event | None = None,
    stop_on_eos: bool = True,
    sampling: SamplingParams | None = None,
    adaptive: bool = True,
    governor: Governor | None = None,
) -> Result:
    """Decode up to max_new_tokens; `sampling` None or temperature 0 is exact greedy decoding.

    `adaptive` lets a Governor (the caller's, to carry what it learned across requests, or
    a fresh one) switch to plain steps while drafting does not pay for itself; not for
    seeded sampling, which must reproduce exactly.
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    stats = Stats(prompt_tokens=len(prompt))
    stream = TextStream(target.tokenizer, stop_strings)
    hints = list(hint_tokens or [])
    eos = target.eos_ids if stop_on_eos else frozenset()
    output: list[int] = []
    finish = "length"
    sampler = None if sampling is None or sampling.is_greedy else Sampler(sampling, target.device)
    # The governor decides from wall-clock timings; a seeded sampled run must replay the same
    # draws, so it drafts every step instead (greedy output never depends on the governor).
    seeded = sampler is not None and sampling.seed is not None
    governor = (governor or Governor()) if adaptive and not seeded else None

    def commit(new: list[int]) -> bool:
        """Emit tokens, cut at EOS, a stop string or the budget; True when generation is over."""
        nonlocal finish, hints
        new = new[: max_new_tokens - len(output)]
        done = len(output) + len(new) >= max_new_tokens
        for i, tok in enumerate(new):
            if tok in eos:
                new, done, finish = new[: i + 1], True, "eos"
                break
        keep = stream.stop_token_count(new)
        if keep is not None:
            new, done, finish = new[:keep], True, "stop"
        if hints and hints[len(output) : len(output) + len(new)] != new:
            hints = []  # the output left the hinted path: later hints no longer line up
        output.extend(new)
        text = stream.push(new, final=done)
        if on_commit is not None and (new or text):
            on_commit(new, text)
        return done

    start = time.perf_counter()
    target.reset()
    proposer.begin(target)
    hidden, features = target.forward(prompt)
    target.keep(0, len(prompt), features)
    done = commit([target.greedy(hidden[-1:])[0] if sampler is None else sampler.pick(target.logits(hidden[-1:])[0])])
    stats.ttft_s = time.perf_counter() - start
    while not done:
        if cancel is not None and cancel.is_set():
            finish = "cancelled"
            break
        tokens = prompt + output
        position = len(tokens) - 1  # where last_tok goes
        budget = max_new_tokens - len(output) - 1  # the bonus token always comes on top
        began = time.perf_counter()
        drafting = governor is None or governor.should_draft()
        limit = budget if governor is None else governor.draft_limit(budget)
        proposal = proposer.propose(target, tokens, limit) if drafting else EMPTY
        guesses, q = (proposal.tokens, None) if sampler is None else sampler.draft(proposal.tokens, proposal.logits)
        ahead = hints[len(output) : len(output) + budget]
        drafts = _apply_hints(guesses, ahead)
        proposed_at = time.perf_counter()
        hidden, features = target.forward([tokens[-1]] + drafts)
        if sampler is None:
            choices = target.greedy(hidden)
            accepted = accept_length(drafts, choices)
            after = choices[accepted]
        else:
            accepted, after = sampler.verify(target.logits(hidden), drafts, q, fixed=len(ahead))
        target.keep(position, accepted + 1, features)
        verified_at = time.perf_counter()
        stats.propose_s += proposed_at - began
        stats.verify_s += verified_at - proposed_at
        stats.steps += 1
        stats.plain_steps += not drafts
        stats.proposed += len(drafts)
        stats.accepted += accepted
        if drafts:
            stats.histogram[accepted] += 1
            stats.sources[proposal.source or "hint"] += 1
        if governor is not None:
            governor.record(bool(proposal.tokens), accepted + 1, verified_at - began)
        done = commit(drafts[:accepted] + [after])
    stats.governor = governor.to_dict() if governor is not None else {}
    stats.new_tokens = len(output)
    stats.decode_s = time.perf_counter() - start - stats.ttft_s
    if stream.stopped:
        finish = "stop"
    return Result(output, stream.text, finish, stats)


def _apply_hints(drafts: list[int], ahead: list[int]) -> list[int]:
    """Known upcoming tokens replace guesses at their positions; they are verified like any draft."""
    if not ahead:
        return drafts
    length = max(len(drafts), len(ahead))
    return [ahead[i] if i < len(ahead) else drafts[i] for i in range(length)]
