"""Train a DFlash2 candidate selector on a trained backbone, cheaply.

The backbone stays as it is (a DFlash drafter becomes a DFlash2 one whose convolutions are the
identity, `training.drafter_starts.as_dflash2`: it drafts exactly as before), and only the selector
learns. Its data are the backbone's block rows at answer anchors, computed once without
gradients; each draft position is then a tiny classification, teacher-forced as the published
recipe does: the predecessor is the answer's token before the position (the anchor for the
first), the classes are the top-k candidates of the draft logits, and the answer's token is the
label (positions whose token is not among them teach nothing). Scores are the walk's own
(`pair_scores`) under the spec the target reads (`selector_of`), so what is trained is what the
target runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draft_node.config import selector_info
from draft_node.model import DFlashDrafter
from target_node.drafting.selector import Selector, SelectorSpec, greedy_walk, pair_scores
from training.batches import Batch, Sample, make_batch
from training.trainer import Trainer


@dataclass
class Positions:
    """Draft positions of many blocks, what the selector is trained and judged on."""

    hidden: torch.Tensor  # [n, hidden]: the backbone's row
    unary: torch.Tensor  # [n, k]: the candidates' scores
    ids: torch.Tensor  # [n, k]: the candidates (token ids)
    prev: torch.Tensor  # [n]: the answer's token before the position
    label: torch.Tensor  # [n]: the answer's token there


def positions(trainer: Trainer, selector: Selector, batches: Iterable[Batch]) -> Positions:
    """The draft positions of `batches`, made one batch at a time: a batch's context features are
    tens of MB (400 batches held at once took 12 GB), its positions a tenth of that."""
    parts = []
    with torch.no_grad():
        for batch in batches:
            hidden, labels = trainer.block_rows(batch)
            before = torch.cat([batch.block_tokens[..., :1].to(labels.device), labels[..., :-1]], -1)
            labelled = labels >= 0
            unary, slots = selector.candidates(trainer.project(hidden[labelled]))
            parts.append((hidden[labelled], unary, trainer.vocab[slots], before[labelled], labels[labelled]))
    return Positions(*(torch.cat(column) for column in zip(*parts, strict=True)))


def fit(
    drafter: DFlashDrafter, data: Positions, steps: int, lr: float = 3e-3, batch: int = 2048, seed: int = 0
) -> list[float]:
    """Train the selector's three tensors on `data`; returns the loss per step."""
    selector = drafter.candidate_selector
    params = [selector.hidden_projection.weight, selector.predecessor_codebook, selector.successor_codebook]
    for p in drafter.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(params, lr=lr)
    target = (data.ids == data.label[:, None]).float()
    usable = target.any(-1).nonzero().flatten()  # the answer's token is a candidate
    g = torch.Generator().manual_seed(seed)
    losses = []
    with torch.enable_grad():
        for _ in range(steps):
            pick = usable[torch.randint(len(usable), (min(batch, len(usable)),), generator=g)]
            gate = F.linear(data.hidden[pick].float(), selector.hidden_projection.weight)
            scores = pair_scores(
                data.unary[pick], data.ids[pick], data.prev[pick], gate,
                selector.predecessor_codebook, selector.successor_codebook,
            )  # fmt: skip
            loss = F.cross_entropy(scores, target[pick].argmax(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    for p in params:
        p.requires_grad_(False)
    return losses


def selector_of(drafter: DFlashDrafter) -> Selector:
    """The selector a target runs for `drafter`: its spec read from the description the wire
    carries (the head's multiplier and cap included), over the drafter's current codebooks."""
    return Selector(SelectorSpec.from_info(selector_info(drafter.config, "")), *drafter.codebooks())


def train_selector(trainer: Trainer, batches: int, steps: int, lr: float, log: Callable[[str], None] = print) -> dict:
    """Train the selector of `trainer`'s DFlash2 drafter on its backbone's rows at the anchors of
    the first `batches` training batches; returns (and logs) chain tau on the held-out answers
    with each position's first choice and with the walk, before and after."""
    picker = selector_of(trainer.drafter)  # for its candidates: its codebooks are not read
    data = positions(trainer, picker, (trainer.batch(i) for i in range(batches)))
    log(f"selector: {len(data.label)} draft positions from {batches} batches")
    before = chain_tau(trainer, trainer.drafter, trainer.val_records)
    losses = fit(trainer.drafter, data, steps, lr, seed=trainer.opts.seed)
    after = chain_tau(trainer, trainer.drafter, trainer.val_records)
    log(f"selector: loss {losses[0]:.4f} -> {sum(losses[-20:]) / len(losses[-20:]):.4f} over {len(losses)} steps")
    log(
        f"chain tau on {after['blocks']} held-out blocks: first choices {after['chain']:.3f}, "
        f"selector walk {after['selector']:.3f} (before training {before['selector']:.3f})"
    )
    return {"before": before, "after": after}


def chain_tau(trainer: Trainer, drafter: DFlashDrafter, records: list[Sample], anchors: int = 8) -> dict:
    """Chain tau on `records`' blocks two ways: each position's first choice (DFlash's chain) and
    the selector's walk from the anchor. tau = 1 + leading drafts equal to the answer, over
    blocks whose labels all lie inside the answer (what a decoding step sees)."""
    selector = selector_of(drafter)
    lead = {"chain": [], "selector": []}
    with torch.no_grad():
        for start in range(0, len(records), trainer.opts.batch):
            gen = torch.Generator().manual_seed(12345 + start)
            batch = make_batch(
                records[start : start + trainer.opts.batch],
                trainer.features,
                trainer.cfg,
                anchors,
                trainer.opts.max_len,
                gen,
            )
            hidden, labels = trainer.block_rows(batch)
            full = (labels[..., 1:] >= 0).all(-1)  # blocks wholly inside their answers
            rows, want = hidden[full][:, 1:], labels[full][:, 1:]
            unary, slots = selector.candidates(trainer.project(rows))
            ids = trainer.vocab[slots]
            tokens_at_anchor = batch.block_tokens[..., 0].to(full.device)[full]
            walk = greedy_walk(selector.block_scores(unary, ids, drafter.gate(rows), tokens_at_anchor), ids)
            for name, chain in (("chain", ids[..., 0]), ("selector", walk)):
                lead[name] += (chain == want).long().cumprod(-1).sum(-1).tolist()
    return {name: 1.0 + sum(v) / max(len(v), 1) for name, v in lead.items()} | {"blocks": len(lead["chain"])}
