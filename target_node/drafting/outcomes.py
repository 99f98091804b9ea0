"""Which outcomes of a verify to pre-draft for: the target's guess before the verify runs.

A verify of draft tree T ends in one of many ways: the target accepts the path to some node n
(the root: nothing accepted), then its own token b, none of n's children. The drafter's
pre-draft needs both, so the target names the likeliest pairs by the drafter's own
probabilities: the path's, times b's at the depth after n. A chain is the tree with one child
per node. Outcomes deeper than `block_size - 3` are never named: their pre-draft would have no
slot left to draft after b.

Offline on the held-out prompts (`benchmarks.predraft_study`), this ranking finds a chain
step's outcome among 8 named on 34% of steps, against 33% for the one it replaced (P(j) from
the accepted lengths seen); a tree of 8 nodes' outcome on 14% only, since the tree already
verifies the drafter's likeliest alternatives. So the loop names outcomes for chains alone.
"""

from __future__ import annotations

import torch

from target_node.drafting.tree import DraftTree


def likeliest_outcomes(
    logits: torch.Tensor,
    tree: DraftTree,
    count: int,
    deepest: int,
    columns: torch.Tensor | None = None,
) -> list[tuple[int, int]]:
    """The `count` likeliest outcomes (node, b) of verifying `tree`, best first: the target accepts
    the path to `node` (0: the root, nothing accepted), then its own token b, which is none of
    node's children. Scored by the drafter's own log-probabilities from `logits` [slots, columns]
    (`columns`: each column's token id, ascending; None: column i is token i): the path's, plus
    b's at the next slot; nodes at most `deepest` deep. It runs on the target's critical path
    every drafting step: a drafter's own vocabulary keeps it to its columns."""
    depths = [0, *tree.depths]
    nodes = [n for n, d in enumerate(depths) if d <= deepest and d < logits.shape[0]]
    if count <= 0 or not nodes:
        return []
    logprobs = logits[: max(depths) + 1].float().log_softmax(-1)
    # Each node's path: its parent's, plus its own token's at its slot (-inf outside the columns,
    # and past the drafter's rows: a looked-up continuation grafted onto the drafted chain goes
    # deeper than the drafter drafted, and such nodes are never named anyway).
    # On the logits' device: made on the CPU beside a GPU target's logits, they failed every
    # pre-drafting step there (an audit).
    at = torch.tensor(tree.tokens, dtype=torch.long, device=logits.device)
    slots = torch.tensor(tree.depths, device=logits.device) - 1
    beyond = slots >= logprobs.shape[0]
    slots = slots.clamp_max(logprobs.shape[0] - 1)
    if columns is not None:
        found = torch.searchsorted(columns, at).clamp_max(columns.shape[0] - 1)
        mine = logprobs[slots, found].masked_fill(columns[found] != at, float("-inf"))
    else:
        mine = logprobs[slots, at]
    mine = mine.masked_fill(beyond, float("-inf"))
    path = [0.0]
    for parent, own in zip(tree.parents, mine.tolist(), strict=True):
        path.append(path[parent] + own)
    children: dict[int, set[int]] = {}
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        children.setdefault(parent, set()).add(token)
    k = min(count + max((len(c) for c in children.values()), default=0), logprobs.shape[-1])
    top = logprobs.topk(k, -1)
    ids, values = (top.indices if columns is None else columns[top.indices]).tolist(), top.values.tolist()
    scored = [
        (path[n] + value, n, token)
        for n in nodes
        for value, token in zip(values[depths[n]], ids[depths[n]], strict=True)
        if token not in children.get(n, ())
    ]
    scored.sort(key=lambda s: -s[0])  # stable on ties: the shallower node, then the likelier token
    return [(n, token) for score, n, token in scored[:count] if score > float("-inf")]
