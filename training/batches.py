"""What a training step reads: answers as samples (`Sample`), the drafter's vocabulary, the feature
scale, and a step's blocks built with tensor ops (`make_batch`: one gather for every block's window
of its answer), with the target's own rows where the loss distils from them (`teacher_rows`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from answers.store import Answer
from draft_node.config import DFlashConfig
from training.features import MAX_ROWS, FeatureCache, LiveFeatures


@dataclass
class Batch:
    # [S, T, W] context feature rows, fp16 as cached (zero past each sequence's end); None for live
    # features until the trainer computes them on the device (`Trainer.block_rows`)
    features: torch.Tensor | None
    anchors: torch.Tensor  # [S, N] anchor positions (0 for padding anchors)
    block_tokens: torch.Tensor  # [S, N, B] tok[a], then mask ids
    labels: torch.Tensor  # [S, N, B] tok[a+k], -100 where no loss
    # [S, N, B, hidden] the target's last tap (its final norm's output) at position a+k-1, fp16 as
    # cached: what its LM head turns into its own prediction of tok[a+k]; None where the cache
    # holds the drafter's taps alone.
    teacher: torch.Tensor | None = None
    # Live features only: each answer's tokens whose feature rows the batch reads (its context before
    # the last anchor, and the teacher's rows after it)
    context: list[list[int]] | None = None


@dataclass(frozen=True)
class Sample:
    """One answer as training sees it: its tokens and where its feature rows start in the cache."""

    tokens: list[int]  # prompt + answer, cut to the rows the cache holds + 1
    prompt_len: int
    offset: int  # first feature row in the cache (-1 for live features); the sample has len(tokens) - 1 rows
    key: str = ""  # the answer's, so a score can be told back to the answer it came from


def samples(answers: list[Answer], features: FeatureCache | LiveFeatures | None, max_len: int = 0) -> list[Sample]:
    """Answers with features (cached, or any for live ones; None: features not needed) and at least
    two answer tokens (one anchor, one label) within the first `max_len` tokens (0: all): an
    answer whose prompt filled them took batch slots and never gave an anchor (an audit)."""
    out = []
    for a in answers:
        if a.answer_tokens < 2 or (max_len and a.prompt_len > max_len - 2):
            continue
        if features is None or isinstance(features, LiveFeatures):
            offset, rows = -1, min(len(a.tokens) - 1, MAX_ROWS)
        elif a.key in features:
            offset, rows = features.index[a.key]
        else:
            continue
        tokens = a.tokens[: rows + 1]
        if len(tokens) - a.prompt_len >= 2:
            out.append(Sample(tokens, a.prompt_len, offset, a.key))
    return out


def draft_vocabulary(records: list[Sample], size: int) -> list[int]:
    """The `size` most frequent answer tokens, most frequent first: the drafter's vocabulary.

    A drafter only ever learns to propose tokens it saw in answers; projecting its hidden
    states onto just these rows of the target's LM head costs a fraction of the full head.
    """
    counts = Counter(t for r in records for t in r.tokens[r.prompt_len :])
    return [token for token, _ in counts.most_common(size)]


def feature_scale(features: np.ndarray, rows: int = 20000, seed: int = 0) -> torch.Tensor:
    """1 / per-channel RMS over a sample of rows: tames the outlier channels before fc."""
    if len(features) == 0:
        return torch.ones(features.shape[1])
    idx = np.sort(np.random.default_rng(seed).choice(len(features), min(rows, len(features)), replace=False))
    sample = torch.from_numpy(np.asarray(features[idx], dtype=np.float32))
    # Median-clipped so the huge first-position rows don't set the scale.
    norms = sample.pow(2).mean(1)
    sample = sample[norms <= norms.median() * 10]
    rms = sample.pow(2).mean(0).sqrt()
    return 1.0 / rms.clamp_min(rms.median() * 1e-2)


def make_batch(
    records: list[Sample],
    features: np.ndarray | None,
    cfg: DFlashConfig,
    anchors: int,
    max_len: int,
    gen: torch.Generator,
    part: slice = slice(None),
    known: float = 0.0,
) -> Batch:
    """Random anchors in each answer; a slot's label is the target's own token there. Anchors are
    drawn for all `records` and the batch is built of `records[part]` only: a rank's share of the
    batch one process would draw (training.distributed). A `known` share of the blocks get the
    target's tokens in their first slots after the anchor instead of masks (no loss there). Rows
    wider than the drafter's taps carry the target's last layer after them: the batch's `teacher`.
    `features` None (live features): the batch names each answer's tokens whose rows it reads
    instead, up to the teacher's last, and `Trainer.block_rows` computes them."""
    block, mask_id = cfg.block_size, cfg.mask_token_id
    chosen = []
    for r in records:
        n = min(len(r.tokens), max_len)
        lo, hi = r.prompt_len, n - 2  # anchors in the answer, with at least one label after
        if hi < lo:
            chosen.append(torch.zeros(0, dtype=torch.long))
            continue
        pick = torch.randperm(hi - lo + 1, generator=gen)[:anchors] + lo
        chosen.append(pick.sort().values)
    # Drawn for the whole batch before the rank's share is taken: N ranks build the batch one
    # process builds (drawn after, two ranks' --known blocks differed from one process's: an audit).
    coins = torch.rand(2, len(records), anchors, generator=gen)[:, part] if known > 0 else None
    records, chosen = records[part], chosen[part]
    span = max([int(c.max()) for c in chosen if len(c)] + [1])  # context rows needed: < largest anchor
    count, width = len(records), max([min(len(r.tokens), max_len) for r in records] + [0]) + block
    feats = torch.zeros(count, span, cfg.feature_width, dtype=torch.float16) if features is not None else None
    rows_of, anc = feats.numpy() if feats is not None else None, torch.zeros(count, anchors, dtype=torch.long)
    seq = torch.full((count, width), -100, dtype=torch.long)  # each answer's tokens, -100 past its end
    for i, (r, pick) in enumerate(zip(records, chosen, strict=True)):
        if rows_of is not None:
            rows = min(span, len(r.tokens) - 1)
            # fp16 as cached: the device widens them
            rows_of[i, :rows] = features[r.offset : r.offset + rows, : cfg.feature_width]
        n = min(len(r.tokens), max_len)
        seq[i, :n] = torch.tensor(r.tokens[:n])
        anc[i, : len(pick)] = pick
    real = torch.arange(anchors) < torch.tensor([len(c) for c in chosen], dtype=torch.long)[:, None]  # [S, N]
    # Every block's window of the answer: tok[a], tok[a + 1], ..., tok[a + B - 1] (-100 past the end).
    window = torch.gather(seq, 1, (anc[:, :, None] + torch.arange(block)).reshape(count, -1)).view(anc.shape + (block,))
    window[~real] = -100
    labels = window.clone()
    labels[..., 0] = -100
    toks = torch.full_like(window, mask_id)
    toks[..., 0] = torch.where(real, window[..., 0], mask_id)
    if known > 0:
        _give_known(window, toks, labels, real, coins, known)
    if features is None:  # every row a context or a teacher reads: those before a + B - 1
        context = [r.tokens[: min(len(r.tokens) - 1, span + block - 1)] for r in records]
        return Batch(None, anc, toks, labels, context=context)
    return Batch(feats, anc, toks, labels, teacher_rows(records, features, cfg, anc))


def _give_known(
    window: torch.Tensor,
    toks: torch.Tensor,
    labels: torch.Tensor,
    real: torch.Tensor,
    coins: torch.Tensor,
    known: float,
) -> None:
    """A `known` share of the blocks (by `coins[0]`) shown 1..learnable-1 of the target's tokens after
    their anchor (how many by `coins[1]`), in place of masks and with no loss there."""
    learnable = (labels[..., 1:] >= 0).sum(-1)  # labelled slots after the anchor
    drawn = real & (learnable >= 2) & (coins[0] < known)
    given = (coins[1] * (learnable - 1).clamp_min(1)).long() + 1  # 1..learnable-1
    slot = torch.arange(window.shape[-1])
    shown = drawn[..., None] & (slot >= 1) & (slot <= given[..., None])
    toks[shown], labels[shown] = window[shown], -100


def teacher_rows(
    records: list[Sample], features: np.ndarray, cfg: DFlashConfig, anc: torch.Tensor
) -> torch.Tensor | None:
    """The cached columns past the drafter's taps (the target's last layer) at position a+k-1 of
    every block slot k: [S, N, B, extra] fp16, or None where the cache has no such columns. Slots
    past an answer's end repeat its last row; they carry no label."""
    extra = features.shape[1] - cfg.feature_width
    if not extra or not records:
        return None
    pos = teacher_positions(anc, cfg.block_size, torch.tensor([len(r.tokens) - 2 for r in records]))
    rows = (torch.tensor([r.offset for r in records])[:, None, None] + pos).reshape(-1).numpy()
    picked = np.asarray(features[rows, cfg.feature_width :], dtype=np.float16)
    return torch.from_numpy(picked).view(pos.shape + (extra,))


def teacher_positions(anc: torch.Tensor, block: int, last: torch.Tensor) -> torch.Tensor:
    """[S, N, B] the row whose target output teaches slot k of each block: a + k - 1, within 0 and
    each answer's last row `last` [S] (slots past it carry no label)."""
    return (anc[:, :, None] + torch.arange(block, device=anc.device) - 1).clamp(min=0).minimum(last[:, None, None])
