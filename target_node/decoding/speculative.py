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
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from target_node.decoding.governor import Governor
from target_node.decoding.sampling import Sampler
from target_node.drafting.proposal import EMPTY, Continuation, Proposal
from target_node.drafting.proposers import Lookup, Proposer
from target_node.drafting.tree import DraftTree
from target_node.model.target import TargetModel

MAX_LOOKUP = 8  # the deepest looked-up continuation verified (as NGramProposer's drafts)
PRIOR = Governor()  # what a step without a governor assumes of looked-up continuations (never taught)


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
    # Per accepted draft, the lookup that alone proposed it (None: the drafter or a hint did).
    lookup_sources: tuple[str | None, ...] = ()

    @property
    def accepted(self) -> int:
        return len(self.committed) - 1

    @property
    def looked_up(self) -> Counter:
        """Accepted drafts only a lookup proposed, by lookup."""
        return Counter(source for source in self.lookup_sources if source is not None)

    def kept(self, count: int) -> Step:
        """This step as the answer kept it: its first `count` committed tokens (fewer than it
        committed where EOS, a stop string or the budget ended the answer inside it). Its stats
        count these alone, or a stop met in a long verified hint reported tau 63 for 24 tokens (an
        audit); the last kept token stands for the bonus, so tau stays tokens per step."""
        if count >= len(self.committed):
            return self
        count = max(count, 1)
        return replace(self, committed=self.committed[:count], lookup_sources=self.lookup_sources[: count - 1])


def draft_tree(
    proposal: Proposal,
    limit: int,
    hints: list[int],
    tree_nodes: int,
    governor: Governor | None,
    lookups: dict[str, Continuation] | None = None,
) -> tuple[DraftTree, bool]:
    """The drafts to verify for a greedy step, and whether their path probabilities are known
    (the drafter's, and estimates for looked-up nodes).

    Hinted tokens (known continuations) stand in for guesses where given, as a chain. A
    proposal with a distribution per position becomes a tree of up to `tree_nodes` nodes
    (a chain when 0); each of `lookups`' continuations (by lookup, where trees are verified) joins
    it as one more branch, or they are the tree where nothing was drafted; the governor, if any,
    keeps the first nodes that pay.
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
    if lookups and (probabilities or not len(tree)):
        for source, found in lookups.items():
            tree = tree.graft(found.tokens, reach(found, source, governor or PRIOR), source)
        probabilities = True
    if governor is not None:
        tree = tree.prefix(governor.nodes(tree, probabilities, drafted=bool(proposal.tokens)))
    return tree, probabilities


def reach(found: Continuation, source: str, governor: Governor) -> list[float]:
    """How likely each looked-up token's path is right: from the lookup's own chances where it gives
    them, as often as such chances came out right lately, else from how deep its continuations were
    right lately (the governor's record)."""
    if found.chances is None:
        return governor.lookup_reach(len(found.tokens), source, found.kind)
    return governor.chance_reach(found.chances, source, found.kind)


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
    lookups: dict[str, Continuation] = field(default_factory=dict)  # the continuations looked up, by lookup


@dataclass(frozen=True)
class Room:
    """What a step may verify, decided before it drafts (Sequence.prepare): drafts up to `limit`
    deep (0: the drafter sits this step out), a known continuation `hints`, trees of up to
    `tree_nodes` nodes, and the continuations `lookups` find, up to `lookup_depth` deep (0: none)."""

    limit: int = 0
    hints: tuple[int, ...] = ()
    tree_nodes: int = 0
    lookup_depth: int = 0
    lookups: tuple[Lookup, ...] = ()


def plan_step(
    target: TargetModel,
    proposer: Proposer,
    tokens: list[int],
    room: Room,
    sampler: Sampler | None = None,
    governor: Governor | None = None,
) -> Plan:
    """Draft from committed `tokens` (the target holds all but the last, last_tok, in its cache).

    Drafts at most `room.limit` deep are verified: greedy steps as a tree of up to `room.tree_nodes`
    nodes when the proposer gives distributions and the target's cache can keep any rows
    (else a chain), sampled steps as a chain. Where greedy steps verify trees, the continuations
    of the context's tail that `room.lookups` find (in the context, in the target's earlier answers;
    up to `room.lookup_depth` deep, whether or not the drafter drafts this step) are more branches.
    """
    limit, hints = room.limit, list(room.hints)
    began = time.perf_counter()
    proposal = proposer.propose(tokens, limit) if limit > 0 else EMPTY
    q, lookups = None, {}
    if sampler is None:
        trees = room.tree_nodes if target.policy.tree else 0
        if trees and not hints:
            found = {lookup.name: lookup(tokens, min(room.lookup_depth, MAX_LOOKUP)) for lookup in room.lookups}
            lookups = {name: continuation for name, continuation in found.items() if continuation.tokens}
        tree, probabilities = draft_tree(proposal, limit, hints, trees, governor, lookups)
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
        lookups,
    )


@dataclass
class ForwardOut:
    """What one forward computed for one sequence's rows: their tapped features, and for the rows
    that needed the head the target's greedy `choices` or (sampled) their `logits`."""

    features: torch.Tensor | None
    choices: list[int]
    logits: torch.Tensor | None
    forward_s: float
    timed: bool = True  # forward_s is this step's cost (no other request's prompt or hint chunk ran in it)


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
        plan.proposal.source or ("lookup" if plan.lookups else "hint"),
        plan.propose_s,
        out.forward_s + time.perf_counter() - began,
        tree.is_chain,
        plan.predicted,
        tuple(tree.looked_up.get(node) for node in path),
    )
