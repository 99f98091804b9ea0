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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from target_node.decoding.governor import Governor
from target_node.decoding.output import OnCommit, Output
from target_node.decoding.prefill import prefill
from target_node.decoding.sampling import Sampler, SamplingParams
from target_node.decoding.stats import Stats
from target_node.decoding.tree import DraftTree
from target_node.drafting.proposers import EMPTY, Proposal, Proposer
from target_node.model.target import TargetModel


@dataclass
class Step:
    """What one target step committed, and what it cost."""

    committed: list[int]  # the accepted drafts, then the target's own next token
    drafts: int  # tokens verified after last_tok (the drafter's and hinted ones)
    drafted: bool  # whether the proposer offered anything
    source: str
    propose_s: float
    verify_s: float
    chain: bool = True  # one guess per position (else a tree)
    predicted: float | None = None  # accepted drafts the drafter's probabilities predicted

    @property
    def accepted(self) -> int:
        return len(self.committed) - 1


def accept_length(drafts: list[int], target_argmax: list[int]) -> int:
    """How many drafts agree with the target's own choices, counting from the first."""
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return n


def draft_tree(
    proposal: Proposal, limit: int, hints: list[int], tree_nodes: int, governor: Governor | None
) -> tuple[DraftTree, bool]:
    """The drafts to verify for a greedy step, and whether their probabilities are the drafter's.

    Hinted tokens (known continuations) stand in for guesses where given, as a chain. A
    proposal with a distribution per position becomes a tree of up to `tree_nodes` nodes
    (a chain when 0); the governor, if any, keeps the first nodes that pay.
    """
    if hints:
        guesses = proposal.tokens
        tokens = [hints[i] if i < len(hints) else guesses[i] for i in range(max(len(guesses), len(hints)))]
        return DraftTree.chain(tokens[:limit]), False
    if proposal.logits is not None and proposal.tokens:
        logprobs = torch.log_softmax(proposal.logits.float(), dim=-1)
        budget = tree_nodes or min(limit, logprobs.shape[0])
        tree = DraftTree.best_first(logprobs, budget, limit, branching=8 if tree_nodes else 1)
        probabilities = True
    else:
        tree, probabilities = DraftTree.chain(proposal.tokens[:limit]), False
    if governor is not None:
        tree = tree.prefix(governor.nodes(tree, probabilities))
    return tree, probabilities


def speculative_step(
    target: TargetModel,
    proposer: Proposer,
    tokens: list[int],
    limit: int,
    sampler: Sampler | None = None,
    hints: list[int] | None = None,
    tree_nodes: int = 0,
    governor: Governor | None = None,
) -> Step:
    """One step from committed `tokens` (the target holds all but the last, last_tok, in its cache).

    Drafts at most `limit` deep are verified: greedy steps as a tree of up to `tree_nodes`
    nodes when the proposer gives distributions and the target's cache can keep any rows
    (else a chain), sampled steps as a chain. The target's cache and the proposer's
    features end holding exactly the committed positions.
    """
    began = time.perf_counter()
    position = len(tokens) - 1  # where last_tok goes
    proposal = proposer.propose(tokens, limit) if limit > 0 else EMPTY
    hints = hints or []
    if sampler is None:
        trees = tree_nodes if target.policy.tree else 0
        tree, probabilities = draft_tree(proposal, limit, hints, trees, governor)
        predicted = tree.expected()[-1] if probabilities else None
    else:
        drafts, q = sampler.draft(proposal.tokens, proposal.logits)
        drafts = [hints[i] if i < len(hints) else drafts[i] for i in range(max(len(drafts), len(hints)))]
        tree, predicted = DraftTree.chain(drafts), None
        if governor is not None:
            tree = tree.prefix(governor.nodes(tree, False))
    proposed_at = time.perf_counter()
    hidden, features = target.forward([tokens[-1]] + tree.tokens, proposer.taps, tree.forward_parents)
    if sampler is None:
        # Greedy: the deepest path the target agrees with, then the target's own choice after it.
        choices = target.greedy(hidden)
        path = tree.accept(choices)
        bonus = choices[path[-1] if path else 0]
    else:
        # Sampled: the rejection rule on the chain, which keeps the target's distribution exactly.
        accepted, bonus = sampler.verify(target.logits(hidden), tree.tokens, q, fixed=len(hints))
        path = list(range(1, accepted + 1))
    rows = [0, *path]
    target.keep(position, rows)
    proposer.commit(position, None if features is None else features[rows])
    committed = [tree.tokens[node - 1] for node in path] + [bonus]
    return Step(
        committed,
        len(tree),
        bool(proposal.tokens),
        proposal.source or "hint",
        proposed_at - began,
        time.perf_counter() - proposed_at,
        tree.is_chain,
        predicted,
    )


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
    tree_nodes: int = 0,
    prefill_chunk: int = 0,
    on_prefill: Callable[[], None] | None = None,
) -> Result:
    """Decode up to max_new_tokens; `sampling` None or temperature 0 is exact greedy decoding.

    `adaptive` lets a Governor (the caller's, to carry what it learned across requests, or
    a fresh one) switch to plain steps while drafting does not pay for itself and choose how
    many drafts to verify; not for seeded sampling, which must reproduce exactly.
    `tree_nodes` > 0 verifies greedy drafts as a tree of up to that many nodes.
    `prefill_chunk` > 0 runs the prompt that many tokens at a time, calling `on_prefill`
    between chunks (a daemon serves its socket there).
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
    prefilled = prefill(target, prompt, proposer.taps, prefill_chunk, on_prefill, cancel)
    if prefilled is None:  # cancelled between prefill chunks
        return Result([], "", "cancelled", stats)
    last, features = prefilled
    proposer.commit(0, features)
    output.commit([target.greedy(last)[0] if sampler is None else sampler.pick(target.logits(last)[0])])
    stats.ttft_s = time.perf_counter() - start
    while not output.done:
        if cancel is not None and cancel.is_set():
            output.finish = "cancelled"
            break
        budget = output.budget - 1  # the target's own next token always comes on top
        hints = output.hinted(budget)
        # Known continuations cost no drafting: they are verified whatever the governor thinks of the drafter.
        limit = budget if governor is None or hints or governor.should_draft() else 0
        tokens = prompt + output.tokens
        step = speculative_step(target, proposer, tokens, limit, sampler, hints, tree_nodes, governor)
        _count(stats, step)
        if governor is not None:
            seconds = step.propose_s + step.verify_s
            governor.record(
                step.drafted,
                len(step.committed),
                seconds,
                width=step.drafts + 1,
                draft_s=step.propose_s,
                predicted=step.predicted,
                chain=step.chain,
            )
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
