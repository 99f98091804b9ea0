"""Sampling at any temperature that stays exact under speculation.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a draft x drawn from q is
accepted with probability min(1, p(x)/q(x)); at the first rejection the token is drawn from the
normalized residual max(0, p - q). Either way the committed token is distributed exactly as p,
whatever q is, so a drafter only changes speed, never the output distribution. A one-hot q (an
n-gram guess, a hint) is the same rule: accept with probability p(x), else draw from p without x.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from protocol.sampling import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """The one source of randomness for a request, so a seed replays the whole request."""
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


@torch.no_grad()
def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed distribution over the last axis: temperature, then top-k, then top-p (as transformers orders them).

    Target and drafter rows both go through here, so p and q are shaped by the same options.
    """
    logits = logits.float()
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        # Exactly k survive, even on ties, so top_k=1 is greedy.
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.scatter_(-1, logits.topk(params.top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        probs = _nucleus(probs, params.top_p)
    return probs


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest most-likely set whose mass reaches top_p; the top token always survives."""
    ordered, order = probs.sort(-1, descending=True)
    mass_before = ordered.cumsum(-1) - ordered
    beyond = mass_before >= top_p
    beyond[..., 0] = False  # even when top_p rounds to 0 in the probabilities' dtype (1e-300 in fp32)
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, beyond)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token index per row of `probs` [..., vocab]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What p has left over q, unnormalized; p itself if rounding left nothing (then p == q and rejection is moot)."""
    left = (p - q).clamp_min(0)
    return left if float(left.sum()) > 0 else p


@torch.no_grad()
def verify_sampled(p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator: torch.Generator) -> tuple[int, int]:
    """Speculative sampling over one block: how many drafts survive, and the token that follows them.

    p [k+1, vocab]: the target's processed distributions after last_tok, d1..dk.
    q [k, vocab]: the distributions the drafts were drawn from (one-hot rows for fixed guesses).
    Always draws k coins then one token, so a seed replays the same draws whatever gets accepted.
    """
    k = len(drafts)
    accepted = 0
    if k:
        rows = torch.arange(k, device=p.device)
        chosen = torch.tensor(drafts, device=p.device)
        coins = torch.rand(k, generator=generator, device=p.device)
        # coin < p/q without dividing: accepts with probability min(1, p/q), rejects when p(x) == 0.
        keep = coins * q[rows, chosen] < p[rows, chosen]
        accepted = int(keep.long().cumprod(0).sum())
    final = p[k] if accepted == k else residual(p[accepted], q[accepted])
    return accepted, int(sample(final, generator))


def one_hot_drafts(drafts: list[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """q for guesses that were not drawn from a distribution: all mass on the guess."""
    q = torch.zeros(len(drafts), vocab, device=device)
    if drafts:
        q[torch.arange(len(drafts), device=device), torch.tensor(drafts, device=device)] = 1.0
    return q


class Walk(Protocol):
    """Drafts drawn one after another, each from a distribution that depends on the one before (a
    DFlash2 selector's lattice): `draw(scores)` gives a distribution over a row's candidates and
    one of them; `sample` returns the drafts and q [rows, vocab]."""

    def sample(self, draw: Callable[[torch.Tensor], tuple[torch.Tensor, int]]) -> tuple[list[int], torch.Tensor]: ...


class Sampler:
    """One request's sampling: its options, and the generator every draw comes from."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator = make_generator(params, device)

    def pick(self, logits: torch.Tensor) -> int:
        """The token after a prefill: a plain draw from the processed target distribution."""
        return int(sample(probabilities(logits, self.params), self.generator))

    def draft(
        self, tokens: list[int], logits: torch.Tensor | None, walk: Walk | None = None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Drafts and the distributions q they were drawn from: each position on its own from the
        drafter's processed distribution, or, with a DFlash2 selector's `walk`, each from the
        processed scores of its candidates after the draft before it. Guesses without logits
        stay one-hot (q None)."""
        if walk is not None and tokens:
            return walk.sample(self._draw)
        if logits is None or not tokens:
            return tokens, None
        q = probabilities(logits[: len(tokens)], self.params)
        return sample(q, self.generator).tolist(), q

    def _draw(self, scores: torch.Tensor) -> tuple[torch.Tensor, int]:
        probs = probabilities(scores, self.params)
        return probs, int(sample(probs, self.generator))

    def verify(
        self, logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, fixed: int = 0
    ) -> tuple[int, int]:
        """Accept drafts against the target's logits [k+1, vocab].

        The first `fixed` drafts were forced (hints), not drawn from q, so their q is one-hot:
        using the drafter's q there would over-accept them.
        """
        full = one_hot_drafts(drafts, logits.shape[-1], logits.device)
        if q is not None:
            end = min(len(drafts), q.shape[0])
            if fixed < end:
                full[fixed:end] = q[fixed:end].to(full.device)
        return verify_sampled(probabilities(logits, self.params), full, drafts, self.generator)
