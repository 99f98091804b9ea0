"""Which outcomes of a verify to pre-draft for: the target's guess before the verify runs.

A chain verify of drafts d_1..d_k ends in one of k + 1 ways: j drafts accepted, then the
target's own token b (b != d_{j+1} where j < k). The drafter's pre-draft needs both, so the
target names the likeliest pairs: P(j) from the accepted lengths it has seen (smoothed), and
P(b | j) from the draft's own distribution at slot j + 1 without the draft it rejected.
The last outcome (all k accepted) has a bonus no distribution predicts, and is never named.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def likeliest_outcomes(
    logits: torch.Tensor,
    drafts: list[int],
    lengths: Mapping[int, int],
    count: int,
    deepest: int | None = None,
    columns: torch.Tensor | None = None,
) -> list[tuple[int, int]]:
    """The `count` likeliest (j, b), best first, for j at most `deepest` (default: any), from draft
    `logits` [drafts, columns] (`columns`: each column's token id, ascending, holding every draft;
    None: column i is token i). It runs on the target's critical path every drafting step: a
    drafter's own vocabulary keeps it to its columns and each row's top tokens."""
    depth = len(drafts) if deepest is None else min(len(drafts), deepest + 1)
    if count <= 0 or depth <= 0:
        return []
    rows = logits[:depth].float()
    total = sum(lengths.values()) + len(drafts) + 1
    p_j = torch.tensor([(lengths.get(j, 0) + 1) / total for j in range(depth)])
    normal = rows.logsumexp(-1, keepdim=True)
    top = rows.topk(min(count + 1, rows.shape[-1]), -1)  # one more: the rejected draft may be among them
    ids = top.indices if columns is None else columns[top.indices]
    chosen = torch.tensor(drafts[:depth])[:, None]
    p = (top.values - normal).exp().masked_fill(ids == chosen, 0.0)  # never the rejected draft
    if columns is None:
        p_draft = (rows.gather(-1, chosen) - normal).exp()
    else:  # a draft outside the columns (none should be) had no probability
        at = torch.searchsorted(columns, chosen).clamp_max(columns.shape[0] - 1)
        p_draft = (rows.gather(-1, at) - normal).exp() * (columns[at] == chosen)
    score = p_j[:, None] * p / (1 - p_draft).clamp_min(1e-30)
    flat, ids = score.flatten().tolist(), ids.flatten().tolist()
    # Stable on ties: the shallower outcome, then the likelier token, first.
    order = sorted(range(len(flat)), key=lambda i: -flat[i])[:count]
    width = top.indices.shape[-1]
    return [(i // width, ids[i]) for i in order if flat[i] > 0]
