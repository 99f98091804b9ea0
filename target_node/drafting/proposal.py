"""What a proposer hands the speculative loop: its guesses, and where it has one, their distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from target_node.drafting.selector import Lattice


@dataclass
class Proposal:
    tokens: list[int]
    # Draft logits [len(tokens), columns] where the proposer has a distribution (for trees, sampling
    # and pre-drafting); None means the proposal is one-hot.
    logits: torch.Tensor | None = None
    source: str = ""
    # A DFlash2 selector's lattice: sampled steps draw their drafts by walking it.
    walk: Lattice | None = None
    # The token id of each logits column, ascending; None: column i is token i. A drafter with a
    # vocabulary of its own gives only its columns: softmax, top-k and argmax over its 8K tokens
    # cost a tenth of the same over the target's 49K, where all the others are -inf.
    columns: torch.Tensor | None = None

    def full_logits(self, vocab_size: int) -> torch.Tensor | None:
        """The logits over the whole vocabulary [len(tokens), vocab_size] (-inf outside `columns`)."""
        if self.logits is None or self.columns is None:
            return self.logits
        full = self.logits.new_full((self.logits.shape[0], vocab_size), float("-inf"))
        full[:, self.columns] = self.logits
        return full


EMPTY = Proposal([])


@dataclass(frozen=True)
class Continuation:
    """What a lookup found (no model drafted it): tokens, and where the lookup can tell, each one's
    chance of being right where the ones before it were (None: the governor's record of the lookup
    stands in)."""

    tokens: list[int]
    chances: list[float] | None = None
    # Which of the lookup's kinds of guess this is (the context's: the length of the tail it matched):
    # the governor keeps each kind's record on its own.
    kind: str = ""
