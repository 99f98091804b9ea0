"""One speculative step: draft, verify in one forward pass, keep what the target stands by.

Every step runs `[last_tok, d1..dk]` through the target. Row i's argmax is the token the
target itself would emit after d_i, so the longest prefix of drafts matching those argmaxes,
plus the argmax after it (the bonus), is exactly what plain greedy decoding would emit.
Whatever the drafter says, the output is the target's own.

With a temperature, the same forward pass feeds speculative sampling instead (see sampling.py):
drafts are drawn from the drafter's q and accepted by the rejection rule, so the output is
distributed exactly as sampling from the target alone.

A step is two halves around the forward: `plan_step` (draft, and the rows to verify) and
`finish_step` (accept, roll back, hand the drafter its features), so that one forward can run
many sequences' rows at once (sequence.py drives both, for one request or a batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from target_node.decoding.governor import Governor
from target_node.decoding.sampling import Sampler
from target_node.decoding.tree import DraftTree
from target_node.drafting.proposal import EMPTY, Proposal
from target_node.drafting.proposers import Proposer
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
        tree = DraftTree.best_first(logprobs, budget, limit, 8 if tree_nodes else 1, proposal.columns)
        probabilities = True
    else:
        tree, probabilities = DraftTree.chain(proposal.tokens[:limit]), False
    if governor is not None:
        tree = tree.prefix(governor.nodes(tree, probabilities))
    return tree, probabilities


@dataclass
class Plan:
    """A step's first half: what the forward runs for this sequence, and what accepting it needs."""

    tokens: list[int]  # [last_tok, *tree.tokens]
    parents: list[int] | None  # the tree as the forward takes it (None: a chain)
    tree: DraftTree
    position: int  # where last_tok goes
    proposal: Proposal
    q: torch.Tensor | None  # sampled: the distributions the drafts were drawn from
    hinted: int  # drafts forced by hints (sampled: their q is one-hot)
    predicted: float | None  # accepted drafts the drafter's probabilities predict
    propose_s: float


def plan_step(
    target: TargetModel,
    proposer: Proposer,
    tokens: list[int],
    limit: int,
    sampler: Sampler | None = None,
    hints: list[int] | None = None,
    tree_nodes: int = 0,
    governor: Governor | None = None,
) -> Plan:
    """Draft from committed `tokens` (the target holds all but the last, last_tok, in its cache).

    Drafts at most `limit` deep are verified: greedy steps as a tree of up to `tree_nodes`
    nodes when the proposer gives distributions and the target's cache can keep any rows
    (else a chain), sampled steps as a chain.
    """
    began = time.perf_counter()
    proposal = proposer.propose(tokens, limit) if limit > 0 else EMPTY
    hints = hints or []
    q = None
    if sampler is None:
        trees = tree_nodes if target.policy.tree else 0
        tree, probabilities = draft_tree(proposal, limit, hints, trees, governor)
        predicted = tree.expected()[-1] if probabilities else None
    else:
        drafts, q = sampler.draft(proposal.tokens, proposal.full_logits(target.vocab_size), proposal.walk)
        drafts = [hints[i] if i < len(hints) else drafts[i] for i in range(max(len(drafts), len(hints)))]
        tree, predicted = DraftTree.chain(drafts), None
        if governor is not None:
            tree = tree.prefix(governor.nodes(tree, False))
    if tree.is_chain and len(tree) and not hints:
        # While the forward verifies this chain, a drafter elsewhere may draft the next block.
        proposer.predraft(tokens, tree, proposal)
    position = len(tokens) - 1
    return Plan(
        [tokens[-1], *tree.tokens],
        tree.forward_parents,
        tree,
        position,
        proposal,
        q,
        len(hints),
        predicted,
        time.perf_counter() - began,
    )


@dataclass
class ForwardOut:
    """What one forward computed for one sequence's rows: their tapped features, and for the rows
    that needed the head the target's greedy `choices` or (sampled) their `logits`."""

    features: torch.Tensor | None
    choices: list[int]
    logits: torch.Tensor | None
    forward_s: float


def finish_step(
    target: TargetModel, proposer: Proposer, plan: Plan, out: ForwardOut, sampler: Sampler | None, slot: int = 0
) -> Step:
    """Accept from the forward's results for the plan's rows (`out.choices`: the target's greedy
    token after each; `out.logits`, for sampling), and leave the target's cache and the proposer's
    features holding exactly the committed positions."""
    began = time.perf_counter()
    features, choices, logits = out.features, out.choices, out.logits
    tree = plan.tree
    if sampler is None:
        # Greedy: the deepest path the target agrees with, then the target's own choice after it.
        path = tree.accept(choices)
        bonus = choices[path[-1] if path else 0]
    else:
        # Sampled: the rejection rule on the chain, which keeps the target's distribution exactly.
        accepted, bonus = sampler.verify(logits, tree.tokens, plan.q, fixed=plan.hinted)
        path = list(range(1, accepted + 1))
    rows = [0, *path]
    target.keep(plan.position, rows, slot)
    proposer.commit(plan.position, None if features is None else features[rows])
    committed = [tree.tokens[node - 1] for node in path] + [bonus]
    return Step(
        committed,
        len(tree),
        bool(plan.proposal.tokens),
        plan.proposal.source or "hint",
        plan.propose_s,
        out.forward_s + time.perf_counter() - began,
        tree.is_chain,
        plan.predicted,
    )
