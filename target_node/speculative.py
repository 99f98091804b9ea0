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
from dataclasses import dataclass

from target_node.governor import Governor
from target_node.output import OnCommit, Output
from target_node.proposers import EMPTY, Proposer
from target_node.sampling import Sampler, SamplingParams
from target_node.stats import Stats
from target_node.target import TargetModel


@dataclass
class Step:
    """What one target step committed, and what it cost."""

    committed: list[int]  # the accepted drafts, then the target's own next token
    drafts: int  # tokens verified after last_tok (the drafter's and hinted ones)
    drafted: bool  # whether the proposer offered anything
    source: str
    propose_s: float
    verify_s: float

    @property
    def accepted(self) -> int:
        return len(self.committed) - 1


def accept_length(drafts: list[int], target_argmax: list[int]) -> int:
    """How many drafts agree with the target's own choices, counting from the first."""
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return n


def speculative_step(
    target: TargetModel,
    proposer: Proposer,
    tokens: list[int],
    limit: int,
    sampler: Sampler | None = None,
    hints: list[int] | None = None,
) -> Step:
    """One step from committed `tokens` (the target holds all but the last, last_tok, in its cache).

    Up to `limit` drafts are verified, hinted tokens (known continuations) standing in for
    the proposer's guesses where given; the target's cache and the proposer's features end
    holding exactly the committed positions.
    """
    began = time.perf_counter()
    position = len(tokens) - 1  # where last_tok goes
    proposal = proposer.propose(tokens, limit) if limit > 0 else EMPTY
    guesses, q = (proposal.tokens, None) if sampler is None else sampler.draft(proposal.tokens, proposal.logits)
    hints = hints or []
    drafts = [hints[i] if i < len(hints) else guesses[i] for i in range(max(len(guesses), len(hints)))]
    proposed_at = time.perf_counter()
    hidden, features = target.forward([tokens[-1]] + drafts, proposer.taps)
    if sampler is None:
        # Greedy: the longest prefix the target agrees with, then the target's own choice.
        choices = target.greedy(hidden)
        accepted = accept_length(drafts, choices)
        bonus = choices[accepted]
    else:
        # Sampled: the rejection rule, which keeps the target's distribution exactly.
        accepted, bonus = sampler.verify(target.logits(hidden), drafts, q, fixed=len(hints))
    target.rollback(position + accepted + 1)
    proposer.commit(position, None if features is None else features[: accepted + 1])
    source = proposal.source or "hint"
    return Step(drafts[:accepted] + [bonus], len(drafts), bool(proposal.tokens), source, proposed_at - began,
                time.perf_counter() - proposed_at)


@dataclass
class Result:
    tokens: list[int]
    text: str
    finish_reason: str  # "eos" | "length" | "stop" | "cancelled"
    stats: Stats


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
    target.check_length(len(prompt), max_new_tokens)
    eos = target.eos_ids if stop_on_eos else frozenset()
    output = Output(target.tokenizer, max_new_tokens, eos, stop_strings, hint_tokens, on_commit)
    sampler = None if sampling is None or sampling.is_greedy else Sampler(sampling, target.device)
    # The governor decides from wall-clock timings; a seeded sampled run must replay the same
    # draws, so it drafts every step instead (greedy output never depends on the governor).
    seeded = sampler is not None and sampling.seed is not None
    governor = (governor or Governor()) if adaptive and not seeded else None
    stats = Stats(prompt_tokens=len(prompt), requests=1)

    start = time.perf_counter()
    target.reset()
    proposer.begin(target)
    hidden, features = target.forward(prompt, proposer.taps)
    proposer.commit(0, features)
    last = hidden[-1:]
    output.commit([target.greedy(last)[0] if sampler is None else sampler.pick(target.logits(last)[0])])
    stats.ttft_s = time.perf_counter() - start
    while not output.done:
        if cancel is not None and cancel.is_set():
            output.finish = "cancelled"
            break
        budget = output.budget - 1  # the target's own next token always comes on top
        drafting = governor is None or governor.should_draft()
        limit = 0 if not drafting else budget if governor is None else governor.draft_limit(budget)
        step = speculative_step(target, proposer, prompt + output.tokens, limit, sampler, output.hinted(budget))
        _count(stats, step)
        if governor is not None:
            governor.record(step.drafted, len(step.committed), step.propose_s + step.verify_s)
        output.commit(step.committed)
    stats.governor = governor.to_dict() if governor is not None else {}
    stats.new_tokens, stats.decode_tokens = len(output.tokens), max(len(output.tokens) - 1, 0)
    stats.decode_s = time.perf_counter() - start - stats.ttft_s
    return Result(output.tokens, output.text, output.finish, stats)


def _count(stats: Stats, step: Step) -> None:
    stats.steps += 1
    stats.plain_steps += not step.drafts
    stats.proposed += step.drafts
    stats.accepted += step.accepted
    stats.propose_s += step.propose_s
    stats.verify_s += step.verify_s
    if step.drafts:
        stats.histogram[step.accepted] += 1
        stats.sources[step.source] += 1
