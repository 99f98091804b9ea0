"""What drafting needs from the target, kept beside it rather than inside it.

A DFlash drafter reads tapped target features of committed positions and returns hidden
states the target projects through its own LM head. The bridge holds those pieces for one
drafter: which layers to tap, the ring of committed features the drafter has not read yet
(or may need again after a restart), the noise block's embeddings, and the draft head (the
LM head's rows for the drafter's vocabulary, in bf16 where that is faster: drafts need not
be exact, verification is).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

import dflash_kernels
from protocol.messages import fit_problems
from target_node.drafting.feature_ring import FeatureRing
from target_node.drafting.proposal import Proposal
from target_node.drafting.selector import Selector, SelectorSpec, rerank
from target_node.model.target import TargetModel


class DrafterMismatch(ValueError):
    """A drafter built for a different target."""


class DrafterBridge:
    """One drafter's pieces on the target's side (the module says which), built once the drafter
    has described itself and checked against this target."""

    def __init__(
        self,
        target: TargetModel,
        drafter: dict,
        codebooks: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """`drafter`: the drafter's description (the wire's DRAFTER_INFO), from wherever it runs;
        `codebooks()` fetches a DFlash2 drafter's selector codebooks (once per target and drafter)."""
        problems = fit_problems(drafter, target.info)
        if problems:
            raise DrafterMismatch("drafter does not fit this target: " + "; ".join(problems))
        self.target, self.info = target, dict(drafter)
        self.taps = tuple(drafter["target_layer_ids"])
        self.block_size, self.mask_token_id = drafter["block_size"], drafter["mask_token_id"]
        # Rows past the model's positions are never written: a ring the model cannot fill costs nothing.
        capacity = min(drafter["ring_capacity"], target.max_positions or drafter["ring_capacity"])
        self.ring = FeatureRing(capacity, drafter["feature_width"], target.model.dtype, target.device)
        self.mask_row = target.embed([self.mask_token_id])
        self.head = draft_head(target, tuple(drafter.get("draft_vocab") or ()))
        spec = SelectorSpec.from_info(drafter)
        self.selector = None if spec is None or codebooks is None else selector_for(target, spec, drafter, codebooks)

    def noise(self, last_token: int) -> torch.Tensor:
        """The embedded block [last_tok, MASK, ..., MASK]."""
        return torch.cat([self.target.embed([last_token]), self.mask_row.expand(self.block_size - 1, -1)])

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.project(hidden)

    def guesses(self, hidden: torch.Tensor, gate: torch.Tensor | None, anchor: int) -> Proposal:
        """The drafts of the drafter's rows after `anchor` and their logits: the argmaxes over the
        drafter's vocabulary's columns, or with a DFlash2 selector its greedy chain, made the logits'
        first choices (selector.rerank), with its lattice (sampled steps walk it by drawing)."""
        if self.selector is not None and gate is not None:
            logits = self.project(hidden)
            lattice = self.selector.lattice(logits, gate, anchor, self.head.vocab)
            # Finite codebooks and gates can still overflow in their product: a walk over inf or NaN
            # scores made a sampled step's softmax NaN and failed the whole batch (an audit), so
            # such a block drafts as a DFlash one would, by the head's argmaxes.
            if bool(torch.isfinite(lattice.scores).all()):
                chain = lattice.greedy()
                # The candidates' first made the argmax, over the whole vocabulary (the lattice's ids are tokens).
                return Proposal(chain, rerank(logits, chain, lattice.ids[:, 0]), walk=lattice)
        logits, columns = self.head.compact(hidden), self.head.columns
        best = dflash_kernels.argmax(logits)
        return Proposal((best if columns is None else columns[best]).tolist(), logits, columns=columns)


class DraftHead:
    """The target's LM head for drafts: its rows for the drafter's vocabulary (all of them if it
    has none), in bf16 where that is faster, packed for the CPU kernels where they run (their
    small-row matmul beats torch's), torch's matmul elsewhere."""

    def __init__(self, target: TargetModel, vocab: tuple[int, ...]) -> None:
        # Weakly: the heads are kept per target in a WeakKeyDictionary, and a value holding its key
        # kept every target that ever drafted alive, GPU memory and all (an audit).
        self.target = weakref.proxy(target)
        weight = target.head.weight.detach()
        self.vocab = torch.tensor(vocab, dtype=torch.long, device=target.device) if vocab else None
        # The columns of `compact` logits, ascending: an argmax over them breaks ties as one over
        # the whole vocabulary would (the selector reads full logits in the drafter's own order).
        self.columns = self.vocab.sort().values if self.vocab is not None else None
        rows = weight[self.columns] if self.columns is not None else weight
        self.weight = rows.to(torch.bfloat16) if target.fast_bf16 else rows
        self.packed = None
        if self.weight.device.type == "cpu":
            try:
                dflash_kernels.load()
                self.packed = dflash_kernels.pack(self.weight)
            except dflash_kernels.KernelsUnavailable:
                pass

    @torch.inference_mode()
    def compact(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [rows, columns]: the drafter's hidden states through the target's own head,
        for the tokens of `columns` only (all tokens where the drafter has no vocabulary)."""
        if self.packed is not None:
            return self.target.scale_logits(dflash_kernels.linear(hidden.float().contiguous(), self.packed))
        hidden = hidden.to(device=self.weight.device, dtype=self.weight.dtype)
        return self.target.scale_logits((hidden @ self.weight.T).float())

    @torch.inference_mode()
    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [rows, vocab] over the whole vocabulary (-inf outside the drafter's)."""
        return Proposal([], self.compact(hidden), columns=self.columns).full_logits(self.target.vocab_size)


# One head per target and vocabulary, however many requests draft at once: building one packs
# the whole LM head (tens of MB, ~0.1 s), which every slot's proposer would otherwise repeat.
_HEADS: weakref.WeakKeyDictionary[TargetModel, dict[tuple[int, ...], DraftHead]] = weakref.WeakKeyDictionary()


# A few of each per target: a drafter daemon that re-handshakes with ever new vocabularies or
# codebooks must not pile up heads and selectors (each up to hundreds of MB); bridges in use keep theirs.
KEPT_PER_TARGET = 4


def _remember(cache: dict, key: object, value: object) -> None:
    while len(cache) >= KEPT_PER_TARGET:
        cache.pop(next(iter(cache)))
    cache[key] = value


def draft_head(target: TargetModel, vocab: tuple[int, ...]) -> DraftHead:
    heads = _HEADS.setdefault(target, {})
    if vocab not in heads:
        _remember(heads, vocab, DraftHead(target, vocab))
    return heads[vocab]


# One selector per target and codebooks (named by their checksum): fetched once however many
# slots draft, and not again when the same drafter comes back after a restart.
_SELECTORS: weakref.WeakKeyDictionary[TargetModel, dict[tuple[str, SelectorSpec], Selector]] = (
    weakref.WeakKeyDictionary()
)


def selector_for(
    target: TargetModel, spec: SelectorSpec, drafter: dict, codebooks: Callable[[], tuple[torch.Tensor, torch.Tensor]]
) -> Selector:
    selectors = _SELECTORS.setdefault(target, {})
    key = (drafter["selector"]["checksum"], spec)  # the same codebooks with another top-k are another selector
    if key not in selectors:
        predecessor, successor = codebooks()
        _remember(selectors, key, Selector(spec, predecessor.to(target.device), successor.to(target.device)))
    return selectors[key]
