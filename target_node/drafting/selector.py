"""DFlash2's candidate selector, run where the target's logits are.

A block drafter guesses each position on its own, so its first choices often do not chain
(the second token fits a first token it did not pick). DFlash2 scores each of the top-k
candidates at a position by its logit plus a low-rank pair term with the token chosen before
it, and walks the block from the verified anchor: one coherent chain, no wider a verify.

The pair term is <predecessor[prev] * gate[s], successor[candidate]>, with `gate` the drafter's
projection of its row (sent with the hidden states) and the two codebooks [vocab, rank] the
drafter's, fetched once per drafter. Only the top-k values are scaled (the target's head
multiplier, then a tanh cap): the candidates are the raw logits' top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SelectorSpec:
    """What DRAFTER_INFO.selector says of a drafter's selector."""

    rank: int
    top_k: int
    vocab_size: int
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0

    @classmethod
    def from_info(cls, info: dict) -> SelectorSpec | None:
        selector = dict(info.get("selector") or {})
        selector.pop("checksum", None)
        return cls(**selector) if selector.get("rank") else None


class Selector:
    def __init__(self, spec: SelectorSpec, predecessor: torch.Tensor, successor: torch.Tensor) -> None:
        """The codebooks [vocab, rank] are kept in fp32: a bf16 pair term flips close argmaxes."""
        expected = (spec.vocab_size, spec.rank)
        for name, book in (("predecessor", predecessor), ("successor", successor)):
            if tuple(book.shape) != expected:
                raise ValueError(f"{name} codebook is {list(book.shape)}, the drafter said {list(expected)}")
        self.spec = spec
        self.predecessor, self.successor = predecessor.float(), successor.float()

    def candidates(self, logits: torch.Tensor, among: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary scores [rows, k] fp32, candidate ids [rows, k]): the raw logits' top-k, best first,
        equal logits in id order, with only the kept values scaled and capped. (A tie across the
        k-th place is topk's to break: a full stable sort of the vocabulary costs 17 ms a step.)
        `among`: the only ids whose logits are finite (a draft vocabulary), searched alone: a
        sixth of SmolLM2's vocabulary takes a sixth of the time."""
        spec = self.spec
        pool = logits if among is None else logits.index_select(-1, among)
        k = min(spec.top_k, pool.shape[-1])
        values, ids = pool.float().topk(k, dim=-1)
        if among is not None:
            ids = among[ids]
        ids, by_id = ids.sort(-1)
        order = torch.sort(values.gather(-1, by_id), dim=-1, descending=True, stable=True).indices
        values, ids = values.gather(-1, by_id).gather(-1, order), ids.gather(-1, order)
        unary = values * spec.output_multiplier
        if spec.final_logit_softcapping > 0:
            unary = torch.tanh(unary / spec.final_logit_softcapping) * spec.final_logit_softcapping
        return unary, ids

    def lattice(
        self, logits: torch.Tensor, gate: torch.Tensor, anchor: int, among: torch.Tensor | None = None
    ) -> Lattice:
        """The walk's lattice from draft logits [rows, vocab] (the target's head over the drafter's
        rows 1..; finite only `among` these ids, if given) and the gate [rows, rank], starting after
        the verified `anchor` token."""
        unary, ids = self.candidates(logits, among)
        return self.lattice_of_candidates(unary, ids, gate, anchor, logits.shape[-1])

    def lattice_of_candidates(
        self, unary: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor, anchor: int, vocab: int
    ) -> Lattice:
        """Every (predecessor candidate, candidate) score of candidates already chosen (unary
        scores and token ids [rows, k]) at once: what a walk, greedy or drawn, then reads."""
        device = self.successor.device
        unary, ids = unary.to(device), ids.to(device)
        return Lattice(ids, self.block_scores(unary, ids, gate, torch.tensor(anchor, device=device)), vocab)

    def block_scores(
        self, unary: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor, anchor: torch.Tensor
    ) -> torch.Tensor:
        """Scores [..., rows, k, k] of blocks' candidates (unary, ids [..., rows, k]; gate [..., rows,
        rank]) after their anchors [...]: `scores[..., row, i, j]` is candidate j's after the previous
        row's candidate i (row 0 follows the anchor, the same for every i). Any number of blocks at once."""
        k = ids.shape[-1]
        first = anchor.to(ids)[..., None, None].expand(*ids.shape[:-2], 1, k)
        before = torch.cat([first, ids[..., :-1, :]], -2)
        # [..., row, predecessor's index, candidate]: each candidate's code gathered once, not once per predecessor.
        return pair_scores(
            unary[..., None, :], ids[..., None, :], before, gate.float().to(ids.device)[..., None, :],
            self.predecessor, self.successor,
        )  # fmt: skip


@dataclass
class Lattice:
    """A block's candidates and the scores a walk can meet: `scores[row][i][j]` is candidate j's
    at `row` after the previous row's candidate i (row 0 follows the anchor, the same for every i)."""

    ids: torch.Tensor  # [rows, k] token ids
    scores: torch.Tensor  # [rows, k, k] fp32
    vocab: int

    def greedy(self) -> list[int]:
        """The temperature-0 walk: each row's best candidate after the one chosen before it."""
        return greedy_walk(self.scores, self.ids).tolist()

    def sample(self, draw: Callable[[torch.Tensor], tuple[torch.Tensor, int]]) -> tuple[list[int], torch.Tensor]:
        """A walk by drawing: `draw(scores [k])` turns a row's scores after the candidate drawn before
        it into a distribution over the k candidates (the request's temperature, top-k and top-p)
        and draws one. Returns the drafts and q [rows, vocab], the distribution each came from:
        drawn drafts verified against it by the rejection rule keep the target's law exactly."""
        rows = self.ids.shape[0]
        q = torch.zeros(rows, self.vocab, device=self.scores.device)
        chain, prev = [], 0
        for row in range(rows):
            probs, prev = draw(self.scores[row, prev])
            q[row, self.ids[row]] = probs.to(q.dtype)
            chain.append(int(self.ids[row, prev]))
        return chain, q


def greedy_walk(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The temperature-0 walks [..., rows] of blocks' lattices (scores [..., rows, k, k], ids [..., rows, k]):
    each row's best candidate after the one chosen before it, the first of equal maxima (the
    better logit, as candidates come best first). Every row's best after every predecessor is
    found at once; the walk then only follows them, one gather per row for any number of blocks
    (as fast for one block as a walk over Python lists)."""
    *lead, rows, k = ids.shape
    best = scores.reshape(-1, rows, k, k).argmax(-1)  # [block, row, predecessor's index] -> candidate's
    prev = torch.zeros(best.shape[0], 1, dtype=torch.long, device=best.device)
    picks = []
    for row in range(rows):
        prev = best[:, row].gather(1, prev)
        picks.append(prev)
    return ids.reshape(-1, rows, k).gather(2, torch.cat(picks, 1)[..., None])[..., 0].view(*lead, rows)


def pair_scores(
    unary: torch.Tensor,
    ids: torch.Tensor,
    prev: torch.Tensor,
    gate: torch.Tensor,
    predecessor: torch.Tensor,
    successor: torch.Tensor,
) -> torch.Tensor:
    """Candidates' scores [..., k] given the token before them (prev [...]): unary + <predecessor[prev]
    * gate, successor[candidate]>, the leading dimensions broadcast. One formula for the walk's
    lattice and for training the codebooks."""
    return unary + torch.einsum("...kd,...d->...k", successor[ids], predecessor[prev] * gate)


def rerank(logits: torch.Tensor, chain: list[int], best: torch.Tensor | None = None) -> torch.Tensor:
    """Draft logits whose first choice at each position is the chain's token: its logit and the
    position's best one (`best`, where the candidates already name it) change places, the chain's
    then one ulp up, so a tie cannot hide it. So everything that reads first choices (a chain,
    the main path of a tree, the governor's estimates) follows the selector, and the other
    candidates keep their values."""
    out = logits.clone()
    rows = torch.arange(len(chain), device=logits.device)
    picked = torch.tensor(chain, device=logits.device)
    best = logits[: len(chain)].argmax(-1) if best is None else best[: len(chain)].to(logits.device)
    top = logits[rows, best]
    out[rows, best] = logits[rows, picked]
    out[rows, picked] = torch.nextafter(top, torch.full_like(top, float("inf")))
    return out
