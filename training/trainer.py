"""Train a DFlash drafter on a frozen target's own answers.

One forward pass trains many blocks per sequence: every anchor `a` gets a block
`[tok[a], MASK, ...]` at positions a..a+B-1 that sees the context features of positions
< a, its own block (bidirectionally in full-attention layers) and nothing else. Slot k
predicts tok[a+k] through the target's frozen LM head; later slots weigh less
(exp(-(k-1)/gamma)) because a draft is only worth something after all earlier slots matched.

The tapped features have a few huge outlier channels, which makes fc learn slowly. We train
with a fixed per-channel scale in front of fc and fold it into fc.weight on export, so the
public checkpoint format (and inference) stay unchanged and exactly equivalent.
"""

from __future__ import annotations

import math
import pickle
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch.nn.parallel import DistributedDataParallel

from answers.store import Answer
from basics.errors import first_line
from basics.files import write_atomically
from draft_node.checkpoint import load_drafter, save_drafter
from draft_node.config import DFlashConfig
from draft_node.model import DFlashDrafter
from training.batches import Batch, Sample, draft_vocabulary, feature_scale, make_batch, samples, teacher_positions
from training.distributed import ONE, Ranks
from training.drafter_starts import export_drafter, grown_state, init_drafter, target_layers_state
from training.features import FeatureCache, LiveFeatures
from training.heap import release_freed_memory
from training.loader import BatchStream
from training.prompts import JOB_WEIGHTS
from training.stopping import Stopped, signals_between_steps
from training.variety import job_kind


@dataclass(frozen=True)
class TrainOptions:
    """A training run's settings; `launch.train --stage train` sets each from the flag of its name."""

    lr: float = 1e-3
    warmup: int = 100
    steps: int = 1000
    minutes: float = 0.0  # wall-clock cap; 0 means run all steps (with a cap, the schedule ends with it)
    batch: int = 8
    anchors: int = 24
    max_len: int = 320
    gamma: float = 4.0
    # How a block's slots are weighted: "decay", exp(-(k-1)/gamma) (DFlash's published schedule);
    # "acceptance", by how much the expected accepted length grows with each slot's log-probability
    # (D-PACE, arXiv 2605.18810), which moves as the drafter learns.
    slot_weights: str = "decay"
    # Share of the loss that is the KL divergence from the target's own distribution over the draft
    # vocabulary (ModelOpt's distillation), the rest cross-entropy on its greedy token. Needs a
    # feature cache that also holds the target's last layer, normed (`launch.train --distill ...`).
    distill: float = 0.0
    # Share of training blocks given 1..B-2 of the tokens after their anchor, as a pre-draft's
    # block [last_tok, d_1..d_j, b, MASK...] has them (issue 31); given slots carry no loss.
    known: float = 0.0
    seed: int = 0
    val_answers: int = 60
    val_anchors: int = 400
    eval_every: int = 200
    save_every: int = 200
    weight_decay: float = 0.01
    conv_lr_scale: float = 1.0  # DFlash2: the convolutions' learning rate, relative to lr
    out_scale: float = 0.3  # initial output-norm weight
    device: str = "cpu"
    # bf16 halves the head's memory, but CPUs without native bf16 units run its matmuls several
    # times slower (6x on an AVX2 machine: 1536x576 @ 576x8192 took 2.9 s vs 0.51 s in fp32).
    head_dtype: torch.dtype = torch.float32
    # The drafter's training forward under bf16 autocast (the loss and optimizer in fp32): where the
    # device computes bf16 natively (a GPU, a CPU with AVX512-BF16 or AMX), as the field's trainers do.
    autocast: bool = False
    save_dtype: torch.dtype = torch.bfloat16
    # Threads building the next batches while a step runs (training.loader); 0: each step builds its own.
    loader_threads: int = 0
    draft_vocab: int = 8192  # most frequent answer tokens the drafter proposes from; 0 = all
    # What a step draws its answers from: "answers", uniformly; "jobs", each job kind its share of
    # `prompts.JOB_WEIGHTS` (one ask job's questions are answered one by one: ask is 69% of the
    # store's answers where its jobs are 36%).
    mix: str = "answers"
    out: Path | None = None  # the public checkpoint `train` writes with each save; None: its state alone
    resume: bool = False  # `train` continues from its saved state, where there is one
    init: str | Path | None = None  # else starts from this checkpoint, or `target:L1,...` (TARGET_INIT)


def acceptance_weights(ce: torch.Tensor, slots: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    """D-PACE's slot weights (arXiv 2605.18810) for the labelled slots. A block's expected accepted
    length is E = sum_k prod_{j<=k} p_j over its slots 1..B-1 (p: the label's probability now), and
    d E / d log p_i = sum_{k>=i} prod_{j<=k} p_j: how much of the acceptance slot i carries. Its
    mean over the batch's blocks weighs slot i in every block, so the schedule follows the slots
    that limit acceptance as the drafter learns (the decay's exp(-(k-1)/gamma) never moves), and a
    block the drafter gets wrong early still teaches its first slots (a weight per block would mute
    it). `ce`: each labelled slot's cross-entropy (detached); a label outside the draft vocabulary
    (-100), or none, is a sure miss; the anchor's slot, 0, weighs nothing."""
    p = torch.zeros(labelled.shape, dtype=ce.dtype, device=ce.device)
    p[labelled] = torch.exp(-ce) * (slots >= 0)
    p[..., 0] = 1.0
    reach = p.cumprod(-1)
    carried = reach.flip(-1).cumsum(-1).flip(-1)
    blocks = labelled[..., 1:].any(-1)  # blocks with a label to learn
    per_slot = carried[blocks].mean(0) if bool(blocks.any()) else carried.new_zeros(labelled.shape[-1])
    per_slot[0] = 0.0
    return per_slot.expand_as(labelled)[labelled] * (slots >= 0)


def mix_weights(kinds: list[str], shares: dict[str, float]) -> torch.Tensor:
    """Per-record draw weights that give each kind in `shares` that share of the draws (scaled to
    what the other kinds leave); a kind not in `shares` keeps its share of the records, what a
    uniform draw gives it."""
    counts, n = Counter(kinds), len(kinds)
    present = {k: s for k, s in shares.items() if counts[k] and s > 0}
    rest = sum(c for k, c in counts.items() if k not in present) / n
    scale = (1.0 - rest) / sum(present.values()) if present else 0.0
    return torch.tensor([present[k] * scale / counts[k] if k in present else 1.0 / n for k in kinds])


EMBED_CHUNK = 8192  # token rows embedded per call while building the training table


@torch.no_grad()
def embedding_table(model: torch.nn.Module, device: torch.device | str) -> torch.Tensor:
    """Every token's input embedding [vocab, hidden] fp32 on `device`, as the target's embedding
    module gives it: what serving sends as the noise block (`TargetModel.embed`). Gemma-family
    modules scale their weight rows by sqrt(hidden) in their forward; the bare `.weight` rows missed
    that, so a drafter trained for such a target saw blocks 1/sqrt(hidden) the size of those it is
    served. Filled chunk by chunk: the table is the one copy held (a review)."""
    module = model.get_input_embeddings()
    rows, width = module.weight.shape
    table = torch.empty(rows, width, device=device, dtype=torch.float32)
    for start in range(0, rows, EMBED_CHUNK):
        ids = torch.arange(start, min(start + EMBED_CHUNK, rows), device=module.weight.device)
        table[start : start + len(ids)] = module(ids)
    return table


class TrainingError(ValueError):
    """A run that cannot go on as asked: nothing to train on, a loss that is no number."""


LIVE_SCALE_ROWS = 4096  # live feature rows the feature scale is measured on
TARGET_INIT = "target:"  # `--init target:26,27,...`: the drafter's layers start as these target layers


class _Anchored(torch.nn.Module):
    """The drafter's training forward as a module's `forward`, which is what DDP wraps."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.drafter.forward_anchors(*args)


class Trainer:
    """The drafter, its optimizer, the frozen target pieces, and a deterministic batch stream."""

    def __init__(
        self,
        target,  # a TargetModel (its embedding table and LM head are used frozen)
        cfg: DFlashConfig,
        answers: list[Answer],
        features: FeatureCache | LiveFeatures,
        opts: TrainOptions,
        ranks: Ranks = ONE,
    ) -> None:
        """`ranks`: this process's place among training processes (training.distributed): each
        takes its share of every batch and DDP sums the gradients."""
        self.cfg, self.opts, self.ranks = cfg, opts, ranks
        self.dev = torch.device(opts.device)
        self.live = features if isinstance(features, LiveFeatures) else None
        self.features = None if self.live else features.array()
        if self.features is not None and not opts.distill:  # a wider cache's teacher columns are read only to distill
            self.features = self.features[:, : cfg.feature_width]
        self.train_records = samples([a for a in answers if not a.held_out], features, opts.max_len)
        self.val_records = samples([a for a in answers if a.held_out], features, opts.max_len)[: opts.val_answers]
        self.draw = self._draw_weights(answers)
        model = target.model
        self.embed = embedding_table(model, self.dev)
        self.full_head = model.get_output_embeddings().weight.detach()
        # What the target applies after its head (Gemma 2's softcap, Falcon-H1's multiplier, ...), as
        # serving's draft logits and the target's own logits do: the loss and the teacher apply it too.
        self.scale_logits = target.scale_logits
        if opts.distill and features.width == cfg.feature_width:
            raise ValueError(
                "distillation needs the target's last layer beside the drafter's taps in the feature cache "
                "(launch.train --distill fills such a cache)"
            )
        self.use_vocabulary(draft_vocabulary(self.train_records, opts.draft_vocab) if opts.draft_vocab else [])
        self.drafter = init_drafter(cfg, opts.seed, opts.out_scale).to(self.dev)
        # Rank 0's: ranks that opened a growing cache at different moments measured different scales (an audit).
        self.scale = ranks.tensor_from_main(feature_scale(self._scale_rows()[:, : cfg.feature_width], seed=opts.seed))
        self.scale = self.scale.to(self.dev)
        self.forward = self.drafter.forward_anchors
        if ranks.many:  # DFlash2's selector learns later (training.selector): unused in these steps
            self.forward = DistributedDataParallel(_Anchored(self.drafter), find_unused_parameters=cfg.dflash2)
        self.optimizer = torch.optim.AdamW(self._param_groups(), lr=opts.lr, betas=(0.9, 0.95))
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        if opts.slot_weights not in ("decay", "acceptance"):
            raise ValueError(f"slot_weights must be decay or acceptance, not {opts.slot_weights!r}")
        k = torch.arange(cfg.block_size, dtype=torch.float32)
        self.slot_weight = torch.where(k >= 1, torch.exp(-(k - 1) / opts.gamma), torch.zeros(())).to(self.dev)
        self.step = 0
        self.history: list[float] = []
        self.time_spent = 0.0  # the share of opts.minutes gone (rank 0's clock): the schedule ends with it
        # Seconds trained so far, before any resume too: a resumed run's --minutes and its schedule
        # go on from where it stopped (they restarted: a resumed run went back to its peak lr, and
        # trained its whole budget again).
        self.seconds = 0.0
        self.positions = 0  # labelled slots trained on, all ranks (this rank's share times their number)

    def _scale_rows(self) -> np.ndarray:
        """The rows the feature scale is measured on: the whole cache (it samples them), or live rows
        of a seeded sample of training answers (a few thousand rows: a CPU computes 600 a second)."""
        if self.live is None:
            return self.features
        order = np.random.default_rng(self.opts.seed).permutation(len(self.train_records))[:64]
        return self.live.sample([self.train_records[i].tokens[:-1] for i in order], LIVE_SCALE_ROWS)

    def _draw_weights(self, answers: list[Answer]) -> torch.Tensor | None:
        """The training records' draw weights for `opts.mix` (None: a uniform draw)."""
        if self.opts.mix == "answers":
            return None
        if self.opts.mix != "jobs":
            raise ValueError(f"mix {self.opts.mix!r} is not one of answers, jobs")
        kind_of = {a.key: job_kind(a.job) for a in answers}
        return mix_weights([kind_of[r.key] for r in self.train_records], JOB_WEIGHTS)

    def _param_groups(self) -> list[dict]:
        """The backbone learns here; a DFlash2 selector learns on its outputs afterwards
        (training.selector). Norms and DFlash2's base kernels start at one and stay undecayed;
        DFlash2's convolutions may learn at their own rate (`conv_lr_scale`), so that on a trained
        backbone the new, identity-started parts do not shake it while Adam finds their scale."""
        groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
        for name, p in self.drafter.named_parameters():
            if name.startswith("candidate_selector."):
                continue
            conv = "_conv." in name
            keep = name.endswith(("norm.weight", "base_kernel"))
            groups.setdefault((conv, keep), []).append(p)
        return [
            {
                "params": params,
                "weight_decay": 0.0 if keep else self.opts.weight_decay,
                "lr": self.opts.lr * (self.opts.conv_lr_scale if conv else 1.0),
            }
            for (conv, keep), params in groups.items()
        ]

    def use_vocabulary(self, ids: list[int]) -> None:
        """Propose from these tokens only ([]: all of them).

        The loss softmaxes over the drafter's vocabulary only, as inference projects onto it:
        the same objective the drafter is used for, at a fraction of the full head's cost.
        """
        rows = self.full_head.shape[0]
        self.vocab = torch.tensor(ids, dtype=torch.long) if ids else torch.arange(rows)
        self.head = self.full_head[self.vocab].to(self.dev, self.opts.head_dtype)
        self.vocab_slot = torch.full((rows,), -100, dtype=torch.long)
        self.vocab_slot[self.vocab] = torch.arange(len(self.vocab))
        self.vocab, self.vocab_slot = self.vocab.to(self.dev), self.vocab_slot.to(self.dev)

    def _lr_factor(self, step: int) -> float:
        warm = max(self.opts.warmup, 1)
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, max((step - warm) / max(self.opts.steps - warm, 1), self.time_spent))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    def batch(self, step: int, records: list[Sample] | None = None, count: int | None = None) -> Batch:
        """The batch for a step depends only on (seed, step): resuming replays the same stream."""
        gen = torch.Generator().manual_seed(self.opts.seed * 1_000_003 + step)
        pool = records if records is not None else self.train_records
        size = count or self.opts.batch
        if records is None and self.draw is not None:
            idx = torch.multinomial(self.draw, size, replacement=True, generator=gen).tolist()
        else:
            idx = torch.randint(len(pool), (size,), generator=gen).tolist()
        part = self.ranks.share(len(idx)) if records is None else slice(None)
        chosen, opts = [pool[i] for i in idx], self.opts
        batch = make_batch(chosen, self.features, self.cfg, opts.anchors, opts.max_len, gen, part, opts.known)
        if self.dev.type == "cuda" and opts.loader_threads and batch.features is not None:
            batch.features = batch.features.pin_memory()  # built ahead, page-locked: copied in while it computes
            batch.teacher = batch.teacher.pin_memory() if batch.teacher is not None else None
        return batch

    def logits(self, batch: Batch, forward=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft logits [rows, draft vocab] for the labelled slots, their labels as draft-vocab
        indices (-100 for tokens the drafter cannot propose), and the slots' mask [S, N, B].

        Only labelled slots go through the LM head: it is most of the step's cost.
        """
        hidden, labels = self.block_rows(batch, forward)
        labelled = labels >= 0
        return self.project(hidden[labelled]), self.vocab_slot[labels[labelled]], labelled

    def block_rows(self, batch: Batch, forward=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's block hidden states [S, N, B, hidden] and the labels [S, N, B], on the device;
        `forward`: the training forward (DDP's, on many ranks), else the drafter's own. Live features
        are computed here, on the target's device, into the batch (its teacher too, to distill)."""
        if batch.features is None:
            self._live_rows(batch)
        noise = self.noise(batch.block_tokens)
        features = batch.features.to(self.dev, non_blocking=True).float()
        anchors = batch.anchors.to(self.dev)
        hidden = (forward or self.drafter.forward_anchors)(features, anchors, noise, self.scale)
        return hidden, batch.labels.to(self.dev)

    def noise(self, block_tokens: torch.Tensor) -> torch.Tensor:
        """The blocks' embeddings [..., hidden] on the device, as serving embeds them."""
        return F.embedding(block_tokens.to(self.dev), self.embed)

    def _live_rows(self, batch: Batch) -> None:
        """The batch's context rows [S, T, W] and, to distill, its teacher rows, from the target now:
        laid out as `make_batch` lays out cached ones."""
        rows = self.live.rows(batch.context)
        span = max(int(batch.anchors.max()) if batch.anchors.numel() else 0, 1)
        device = rows[0].device if rows else self.dev
        length = max([len(r) for r in rows] + [span])
        full = torch.zeros(len(rows), length, self.live.width, dtype=torch.float16, device=device)
        for i, r in enumerate(rows):
            full[i, : len(r)] = r
        width = self.cfg.feature_width
        batch.features = full[:, :span, :width]
        if self.opts.distill:
            extra = full[..., width:]
            last = torch.tensor([max(len(r) - 1, 0) for r in rows], device=device)
            pos = teacher_positions(batch.anchors.to(device), self.cfg.block_size, last)
            flat = pos.reshape(len(rows), -1, 1).expand(-1, -1, extra.shape[2])
            batch.teacher = torch.gather(extra, 1, flat).view(pos.shape + (extra.shape[2],))

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [rows, draft vocab] of hidden rows, through the target's frozen head and the
        scaling it applies after it (`TargetModel.scale_logits`): the logits serving drafts from."""
        return self.scale_logits((hidden.to(self.head.dtype) @ self.head.T).float())

    @torch.no_grad()
    def teacher_logprobs(self, batch: Batch, labelled: torch.Tensor) -> torch.Tensor:
        """The target's log-probabilities [rows, draft vocab] for the labelled slots' tokens: its last
        tap (the final norm's output, as the last of transformers' hidden states is) through its LM
        head, renormalised over the draft vocabulary."""
        last = batch.teacher[labelled.to(batch.teacher.device)].to(self.dev)
        return self.project(last).log_softmax(-1)

    def _weighted_ce(self, logits: torch.Tensor, slots: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
        return torch.div(*self._weighted_loss_parts(logits, slots, labelled))

    def _weighted_loss_parts(
        self, logits: torch.Tensor, slots: torch.Tensor, labelled: torch.Tensor, teacher: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The weighted loss's sum and its weight (clamped above 0): cross-entropy on the labels, mixed
        with the KL divergence from `teacher` (log-probabilities) by opts.distill where given."""
        loss = F.cross_entropy(logits, slots, reduction="none", ignore_index=-100)
        if self.opts.slot_weights == "acceptance":
            weight = acceptance_weights(loss.detach(), slots, labelled)
        else:
            weight = self.slot_weight.expand_as(labelled)[labelled] * (slots >= 0)
        if teacher is not None:
            kl = (teacher.exp() * (teacher - logits.log_softmax(-1))).sum(-1)
            loss = (1 - self.opts.distill) * loss + self.opts.distill * kl
        return (loss * weight).sum(), weight.sum().clamp_min(1e-6)

    def loss(self, batch: Batch) -> torch.Tensor:
        return self._weighted_ce(*self.logits(batch))

    def train_step(self, batch: Batch | None = None) -> float:
        """One optimizer step, on `batch` (built ahead: `self.batch(self.step)`); the loss of the
        whole batch (all ranks' shares)."""
        self.drafter.train()
        batch = batch if batch is not None else self.batch(self.step)
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.opts.autocast):
            logits, slots, labelled = self.logits(batch, self.forward)
        teacher = self.teacher_logprobs(batch, labelled) if self.opts.distill else None
        total, weight = self._weighted_loss_parts(logits.float(), slots, labelled, teacher)
        # Normalised by the whole batch's weight, times the ranks DDP averages over: the gradient
        # of the loss one process computes on the whole batch. The labelled slots are summed too:
        # rank 0's times the ranks counted 22% too many where the batch does not divide (an audit).
        # (A step's slots, far below 2**24, are exact in float32.)
        summed = self.ranks.total(torch.stack([total.detach(), weight.detach(), labelled.sum().to(total.dtype)]))
        value, weight, labelled_slots = float(summed[0] / summed[1]), summed[1], int(summed[2])
        if not math.isfinite(value):  # the same on every rank: all stop before the step, none saves
            raise TrainingError(
                f"the loss became {value} at step {self.step + 1}: the run stops before it (lower --lr, "
                "check --gamma and the feature cache)"
            )
        loss = total / weight * self.ranks.world
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        self.optimizer.step()
        self.schedule.step()
        self.step += 1
        self.history.append(value)
        self.positions += labelled_slots
        return value

    @torch.no_grad()
    def evaluate(self, records: list[Sample] | None = None, anchors: int | None = None) -> dict:
        """Greedy-path acceptance on held-out answers: leading block slots whose argmax is the target's token.

        tau is estimated as 1 + mean accepted drafts per block, counting only blocks whose
        labels are all inside the answer (what a decoding step would see).
        """
        self.drafter.eval()
        records = records if records is not None else self.val_records
        if not records:
            return {}
        per_seq = anchors or max(1, self.opts.val_anchors // len(records))
        accepted, losses, hist = [], [], torch.zeros(self.cfg.block_size, dtype=torch.long)
        sums, counts = [], []  # per record: drafts accepted, blocks scored
        for start in range(0, len(records), self.opts.batch):
            chunk = records[start : start + self.opts.batch]
            gen = torch.Generator().manual_seed(12345 + start)
            batch = make_batch(chunk, self.features, self.cfg, per_seq, self.opts.max_len, gen)
            logits, slots, labelled = self.logits(batch)
            losses.append(float(self._weighted_ce(logits, slots, labelled)))
            labels = batch.labels.to(self.dev)
            guess = torch.full_like(labels, -1)
            guess[labelled] = self.vocab[logits.argmax(-1)]  # a token outside the draft vocab is a miss
            guess, labels = guess[..., 1:], labels[..., 1:]
            full = (labels >= 0).all(-1)
            leads = (guess == labels).long().cumprod(-1).sum(-1) * full
            lead = leads[full]
            accepted.append(lead)
            hist += torch.bincount(lead, minlength=self.cfg.block_size).cpu()
            sums += leads.sum(-1).tolist()
            counts += full.sum(-1).tolist()
        acc = torch.cat(accepted).float()
        return {
            "loss": sum(losses) / len(losses),
            "tau": 1.0 + float(acc.mean()) if len(acc) else 1.0,
            "histogram": hist.tolist(),
            "per_record": [[k, n] for k, n in zip(sums, counts, strict=True)],
        }

    def state(self) -> dict:
        return {
            "step": self.step,
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "scale": self.scale.cpu(),
            "history": self.history,
            "seconds": self.seconds,
            "positions": self.positions,
            "config": self.cfg.to_json(),
            "train_answers": len(self.train_records),
        }

    def init_from(self, drafter: DFlashDrafter) -> None:
        """Start from a trained checkpoint: its weights, with the feature scale taken back out of fc.

        A checkpoint with fewer layers is grown (`grown_state`): the deeper drafter starts out
        computing exactly what the trained one does, so added capacity costs no relearning.
        """
        with torch.no_grad():
            state = grown_state(drafter, self.cfg)
            self.drafter.load_state_dict({k: v.to(self.dev, torch.float32) for k, v in state.items()})
            self.drafter.fc.weight.div_(self.scale[None, :])

    def init_from_target(self, model: torch.nn.Module, layer_ids: list[int]) -> None:
        """Start the drafter's layers from the target's decoder layers `layer_ids` (target_layers_state)."""
        with torch.no_grad():
            state = target_layers_state(model, self.cfg, layer_ids)
            own = self.drafter.state_dict()
            for name, weight in state.items():
                if own[name].shape != weight.shape:
                    raise ValueError(
                        f"{name}: the target's {list(weight.shape)}, the drafter's {list(own[name].shape)}"
                    )
                own[name].copy_(weight)

    def load_state(self, state: dict) -> None:
        self.step = state["step"]
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        # The rates these options ask for: a resumed run took its saved ones, whatever --lr said (an audit).
        wanted = [group["lr"] for group in self._param_groups()]
        for i, (group, lr) in enumerate(zip(self.optimizer.param_groups, wanted, strict=True)):
            ratio = lr / group["initial_lr"]
            if ratio != 1.0:
                group["lr"], group["initial_lr"] = group["lr"] * ratio, lr
                self.schedule.base_lrs[i] = lr
        self.scale = state["scale"].to(self.dev)
        self.history = list(state["history"])
        self.seconds, self.positions = float(state.get("seconds", 0.0)), int(state.get("positions", 0))

    def save(self, state_path: Path, out: Path | None) -> None:
        """The run's state and its public checkpoint, each replaced whole; TrainingError where the
        disk refuses either (a traceback before: an audit), the last good ones kept."""
        state = self.state()
        self._written(state_path.parent, lambda: write_atomically(state_path, lambda tmp: torch.save(state, tmp)))
        if out is not None:
            exported = export_drafter(self.drafter, self.scale).to(self.opts.save_dtype)
            exported.draft_vocab = self.vocab.tolist() if self.opts.draft_vocab else []
            self._written(out, lambda: save_drafter(exported, out))

    def _written(self, folder: Path, write: Callable[[], object]) -> None:
        try:
            write()
        except (OSError, RuntimeError, SafetensorError) as exc:  # torch.save's full disk is a RuntimeError
            raise TrainingError(
                f"step {self.step}: cannot save into {folder} ({_why(exc, folder)}); the last save there is kept"
            ) from exc


def train(
    target,  # a TargetModel (its embedding table and LM head are used frozen)
    cfg: DFlashConfig,
    answers: list[Answer],
    features: FeatureCache,
    opts: TrainOptions,
    state_path: Path,
    *,
    log: Callable[[str], None] = print,
    ranks: Ranks = ONE,
) -> Trainer:
    """Train until opts.steps (or opts.minutes), saving state + the public checkpoint periodically.

    `opts.resume` continues a run from its saved state (saved on any number of ranks); otherwise
    `opts.init` starts from a checkpoint's weights. On many `ranks`, rank 0 alone logs, evaluates
    and saves.
    """
    if not ranks.main:
        log = _quiet
    trainer = Trainer(target, cfg, answers, features, opts, ranks)
    if not trainer.train_records:
        raise TrainingError(
            f"nothing to train on: of {len(answers)} answers none outside the held-out split has cached "
            f"features and two answer tokens within --max-len {opts.max_len} (generate more, or run --stage features)"
        )
    _start(trainer, target, state_path, log)
    log(
        f"train: {len(trainer.train_records)} answers "
        f"({sum(len(r.tokens) - r.prompt_len for r in trainer.train_records)} answer tokens), "
        f"{len(trainer.val_records)} held out; {cfg.num_hidden_layers} layer(s), block {cfg.block_size}, "
        f"taps {list(cfg.target_layer_ids)}, {sum(p.numel() for p in trainer.drafter.parameters())} params"
    )
    stopped_by = _steps(trainer, state_path, log)
    if ranks.main:
        trainer.save(state_path, opts.out)
        ev = trainer.evaluate() if stopped_by is None else None  # a stopped run ends now
        if ev:
            log(f"final step {trainer.step} | val loss {ev['loss']:.4f} | est tau {ev['tau']:.3f}")
    ranks.barrier()  # the checkpoint is written before any rank goes on to read it
    if stopped_by is not None:
        raise Stopped(stopped_by, trainer.step)
    return trainer


def _steps(trainer: Trainer, state_path: Path, log: Callable[[str], None]) -> int | None:
    """The optimizer steps up to opts.steps, or until opts.minutes have passed on rank 0's clock
    (the schedule then ends with the budget); batches built ahead by opts.loader_threads threads.
    Returns the signal that stopped it between two steps (training.stopping), if one did."""
    opts, ranks = trainer.opts, trainer.ranks
    last = time.monotonic()
    start = last - trainer.seconds  # a resumed run's clock goes on
    window: list[float] = []
    seen = trainer.positions
    with BatchStream(trainer.batch, trainer.step, opts.loader_threads) as batches, signals_between_steps() as heard:
        while True:
            # Before the step count: one heard during the last step stops the run too (a review).
            if stopped_by := ranks.most(heard[0] if heard else 0):  # every rank after the same step
                log(f"stopping after step {trainer.step}: saving")
                return stopped_by
            if trainer.step >= opts.steps:
                return None
            if opts.minutes:  # rank 0's clock decides, for the schedule as for the stop
                trainer.time_spent = ranks.from_main(trainer.seconds / (opts.minutes * 60))
                if trainer.time_spent >= 1:
                    log("time budget reached")
                    return None
            window.append(trainer.train_step(batches.take(trainer.step)))
            trainer.seconds = time.monotonic() - start
            if trainer.step % 20 == 0 or trainer.step == 1:
                lr, spent = trainer.schedule.get_last_lr()[0], time.monotonic() - last
                log(
                    f"step {trainer.step} | loss {sum(window) / len(window):.4f} | lr {lr:.2e} | "
                    f"{spent / len(window):.2f} s/step | {(trainer.positions - seen) / spent:.0f} positions/s"
                )
                window, last, seen = [], time.monotonic(), trainer.positions
                release_freed_memory()
            _checkpoints(trainer, state_path, log)


def _checkpoints(trainer: Trainer, state_path: Path, log: Callable[[str], None]) -> None:
    """On rank 0, after a step: an evaluation and a save as often as opts asks."""
    opts, step = trainer.opts, trainer.step
    if not trainer.ranks.main:
        return
    if opts.eval_every and step % opts.eval_every == 0:
        ev = trainer.evaluate()
        if ev:
            log(f"eval step {step} | val loss {ev['loss']:.4f} | est tau {ev['tau']:.3f} | hist {ev['histogram']}")
    if opts.save_every and step % opts.save_every == 0:
        try:
            trainer.save(state_path, opts.out)
        except TrainingError as exc:  # the weights live on in memory: the next save tries again
            log(f"{exc}; training goes on")


def _start(trainer: Trainer, target, state_path: Path, log: Callable[[str], None]) -> None:
    """Where a run's weights start: its saved state (resuming), a checkpoint, target layers, or fresh."""
    init = trainer.opts.init
    if trainer.opts.resume:
        state = saved_state(state_path, trainer.cfg, trainer.dev)
        try:
            trainer.load_state(state)
        except (ValueError, KeyError) as exc:  # an optimizer's groups of another version (out of memory is not one)
            raise TrainingError(
                f"--resume: {state_path} was saved by another version of the trainer and cannot continue here "
                f"({first_line(exc)}); start a new --name with --init from its drafter"
            ) from exc
        log(f"resumed at step {trainer.step}")
    elif init and str(init).startswith(TARGET_INIT):
        layer_ids = [int(x) for x in str(init)[len(TARGET_INIT) :].split(",")]
        trainer.init_from_target(target.model, layer_ids)
        log(f"layers initialized from the target's decoder layers {layer_ids}")
    elif init:
        trainer.init_from(load_drafter(init))
        log(f"initialized from {init}")


def saved_state(state_path: Path, cfg: DFlashConfig, device: torch.device | str = "cpu") -> dict:
    """The state a --resume continues from, refused with the reason where it cannot be: missing,
    cut short, or of another drafter shape than `cfg` (naming the fields that differ)."""
    if not state_path.exists():
        raise TrainingError(f"--resume: no saved state at {state_path} (is --name the run's?)")
    try:
        # Tensors and plain values only: a state.pt handed on by someone else runs no code here.
        state = torch.load(state_path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise TrainingError(
            f"--resume: {state_path} cannot be read: it holds objects other than tensors and plain values, "
            "which would run code as they load (a trainer's state never does)"
        ) from exc
    except (RuntimeError, EOFError, OSError) as exc:  # a copy cut short
        raise TrainingError(f"--resume: {state_path} cannot be read ({exc})") from exc
    if not isinstance(state, dict) or not STATE_KEYS <= state.keys():
        raise TrainingError(f"--resume: {state_path} is no trainer state (it lacks {', '.join(sorted(STATE_KEYS))})")
    saved, asked = state.get("config", cfg.to_json()), cfg.to_json()
    if saved != asked:
        differ = ", ".join(
            f"{k} {saved.get(k)} (asked: {asked.get(k)})" for k in sorted(saved | asked) if saved.get(k) != asked.get(k)
        )
        raise TrainingError(
            f"--resume: {state_path} is a run of another drafter shape than these flags ask for: {differ}"
        )
    return state


STATE_KEYS = {"step", "drafter", "optimizer", "schedule", "scale", "history"}  # what load_state reads


def _why(exc: BaseException, folder: Path) -> str:
    """What a failed write says, with the room left where the writer's own words do not say it
    (torch.save's are "unexpected pos 576 vs 534")."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    try:
        free = f"{shutil.disk_usage(folder).free / (1 << 20):.0f} MiB free there"
    except OSError:
        free = "the folder cannot be read"
    return f"{exc}; {free}"


def _quiet(message: str) -> None:
    """The log of ranks other than 0: rank 0 speaks for the run."""
