"""Average two drafters' weights: keep what a fine-tune learned without what it forgot.

A drafter fine-tuned on new data gets better at that data and worse at some of what it knew
(here: answers about code and commands after a fine-tune on chat answers). Two drafters
from one line of training sit in one basin of the loss, so the straight line between their
weights stays good along its length ("model soups", Wortsman et al. 2022); a point in the
middle measured better on the held-out prompts than either end.
"""

from __future__ import annotations

from draft_node.config import CheckpointError
from draft_node.model import DFlashDrafter


def average_drafters(first: DFlashDrafter, second: DFlashDrafter, weight: float) -> DFlashDrafter:
    """(1 - weight) * first + weight * second in fp32, proposing from both vocabularies.

    The draft vocabulary is the union, `second`'s order first; a drafter with no vocabulary
    proposes from every token, and so does the average.
    """
    if first.config != second.config:  # one line naming what differs, not both whole configs in a traceback
        ours, theirs = vars(first.config), vars(second.config)
        differ = ", ".join(f"{k} {ours[k]} vs {theirs.get(k)}" for k in ours if ours[k] != theirs.get(k))
        raise CheckpointError(f"only drafters of one shape average; these differ in {differ}")
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight}")
    ours, theirs = first.state_dict(), second.state_dict()
    out = DFlashDrafter(first.config)
    out.load_state_dict({k: (1 - weight) * ours[k].float() + weight * theirs[k].float() for k in ours})
    a, b = list(first.draft_vocab or []), list(second.draft_vocab or [])
    seen = set(b)
    out.draft_vocab = b + [t for t in a if t not in seen] if a and b else []
    return out.eval()
