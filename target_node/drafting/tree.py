"""Draft trees: more than one guess per position, verified in one target forward.

A DFlash drafter's single block forward gives a distribution at every position; a weak
drafter's second or third choice is often right where its first is wrong. A tree spends
the verify width on the likeliest branches instead of one line: nodes are taken best
first by the probability of their whole path (the product of the draft probabilities
along it). A child's path is never likelier than its parent's, so the first n nodes taken
always form a tree, and under the drafter's own distribution they are the n nodes that
maximise the expected accepted length: the sum of their path probabilities.

Node 0 is `last_tok` (the root, already known); nodes 1.. are drafts in the order taken,
so every parent comes before its children. A chain is the tree with one child per node.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]  # of nodes 1..n
    parents: list[int]  # of nodes 1..n: the node index of each parent (0 = the root)
    depths: list[int]  # of nodes 1..n: 1 for children of the root
    path_probs: list[float]  # of nodes 1..n: the drafter's probability of the whole path; 1.0 where unknown
    # Nodes (1-based) only a looked-up continuation proposed (`graft`), and the lookup that did (its
    # name); their path_probs are estimates.
    looked_up: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        n = len(tokens)
        return cls(list(tokens), list(range(n)), list(range(1, n + 1)), [1.0] * n)

    @classmethod
    def best_first(
        cls,
        logprobs: torch.Tensor,
        budget: int,
        max_depth: int,
        branching: int = 8,
        columns: torch.Tensor | None = None,
    ) -> DraftTree:
        """The `budget` likeliest nodes, from per-depth draft log-probabilities [depths, columns]
        (`columns`: each column's token id, ascending; None: column i is token i)."""
        max_depth = min(max_depth, logprobs.shape[0])
        if budget <= 0 or max_depth <= 0:
            return cls([], [], [], [])
        k = min(branching, budget, logprobs.shape[1])
        # k = 1 (a chain): max, which reads the row once where topk(1) took 150 us a step.
        top = logprobs[:max_depth].float()
        top = top.max(-1, keepdim=True) if k == 1 else top.topk(k, dim=-1)
        top_lp, top_ids = top.values.tolist(), (top.indices if columns is None else columns[top.indices]).tolist()
        tree = cls([], [], [], [])
        # Candidates: (-path logprob, parent node, depth, rank among that depth's top-k).
        heap = [(-top_lp[0][0], 0, 1, 0)]
        path_lp = [0.0]  # by node index; the root's path is certain
        while heap and len(tree) < budget:
            neg, parent, depth, rank = heapq.heappop(heap)
            if top_lp[depth - 1][rank] == float("-inf"):
                break  # nothing likelier is left (e.g. outside the drafter's vocabulary)
            tree.tokens.append(top_ids[depth - 1][rank])
            tree.parents.append(parent)
            tree.depths.append(depth)
            path_lp.append(-neg)
            node = len(tree)
            tree.path_probs.append(math.exp(-neg))
            if rank + 1 < k:  # the parent's next child
                heapq.heappush(heap, (-(path_lp[parent] + top_lp[depth - 1][rank + 1]), parent, depth, rank + 1))
            if depth < max_depth:  # this node's first child
                heapq.heappush(heap, (-(path_lp[node] + top_lp[depth][0]), node, depth + 1, 0))
        return tree

    def prefix(self, n: int) -> DraftTree:
        """The first n nodes: itself a tree (parents come first)."""
        kept = {node: source for node, source in self.looked_up.items() if node <= n}
        return DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n], self.path_probs[:n], kept)

    def graft(self, tokens: list[int], reach: list[float], source: str = "lookup") -> DraftTree:
        """This tree with one more path from the root, `tokens` (a continuation `source` looked up),
        merged where the tree already holds its prefix. `reach[d - 1]` estimates how often
        such a path is accepted to depth d (non-increasing): a new node's path probability, and a
        shared node's where that is likelier. The nodes are then ordered by path probability, so
        that a prefix (what the governor verifies) keeps the likeliest wherever they came from; no
        child is likelier than its parent, so parents still come first."""
        tokens_, parents, depths, probs = [*self.tokens], [*self.parents], [*self.depths], [*self.path_probs]
        looked_up = dict(self.looked_up)
        pairs = zip(parents, tokens_, strict=True)
        child = {(parent, token): node for node, (parent, token) in enumerate(pairs, start=1)}
        node = 0
        for depth, (token, p) in enumerate(zip(tokens, reach, strict=False), start=1):
            found = child.get((node, token))
            if found is None:
                tokens_.append(token), parents.append(node), depths.append(depth), probs.append(p)
                found = child[(node, token)] = len(tokens_)
                looked_up[found] = source
            else:
                probs[found - 1] = max(probs[found - 1], p)
            node = found
        order = sorted(range(1, len(tokens_) + 1), key=lambda n: (-probs[n - 1], depths[n - 1], n))
        index = {old: new for new, old in enumerate(order, start=1)} | {0: 0}
        return DraftTree(
            [tokens_[n - 1] for n in order],
            [index[parents[n - 1]] for n in order],
            [depths[n - 1] for n in order],
            [probs[n - 1] for n in order],
            {index[n]: source for n, source in looked_up.items()},
        )

    def path(self, node: int) -> list[int]:
        """The tokens from the root's child down to `node` (none for the root, node 0)."""
        tokens = []
        while node:
            tokens.append(self.tokens[node - 1])
            node = self.parents[node - 1]
        return tokens[::-1]

    def expected(self) -> list[float]:
        """Expected accepted drafts when verifying the first n nodes, for n = 0..len: running sums
        of path probabilities (meaningful only where the probabilities are known)."""
        out = [0.0]
        for p in self.path_probs:
            out.append(out[-1] + p)
        return out

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(len(self)))

    @property
    def forward_parents(self) -> list[int] | None:
        """The tree as the target's forward takes it: each node's parent row (None for a chain)."""
        return None if self.is_chain else list(self.parents)

    def accept(self, choices: list[int]) -> list[int]:
        """The accepted path (node indices, root excluded): from the root, follow the child whose
        token is the target's own choice at its parent, as deep as such a child exists."""
        children: dict[int, dict[int, int]] = {}
        for node, (parent, token) in enumerate(zip(self.parents, self.tokens, strict=True), start=1):
            children.setdefault(parent, {}).setdefault(token, node)
        path, node = [], 0
        while (child := children.get(node, {}).get(choices[node])) is not None:
            path.append(child)
            node = child
        return path
