"""Per-stream draft state: a ring of context keys/values, one slot per committed position.

Context K/V depend only on a committed position's features and its position, so each is
computed once, when its feature row arrives, and kept until the ring wraps over it. A step
then costs the same at 128 or 4096 tokens of context. Noise-block K/V never enter the ring.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dflash_kernels.row_blocks import row_independence
from draft_node.model import Context, DFlashDrafter


class OutOfOrderError(ValueError):
    """Feature rows that would leave a hole in the context."""


class DraftKVCache:
    def __init__(self, drafter: DFlashDrafter, capacity: int) -> None:
        cfg = drafter.config
        self.drafter = drafter
        self.capacity = capacity
        # [layer, kv_head, slot, head_dim]: per layer, one contiguous run attention can read
        # directly; block_size spare slots past the ring hold the block's own keys/values.
        shape = (len(drafter.layers), cfg.num_key_value_heads, capacity + cfg.block_size, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=drafter.dtype, device=drafter.device)
        self.values = torch.zeros_like(self.keys)
        # positions[slot] is the position a slot holds, -1 when empty or stale.
        self.positions = torch.full((capacity,), -1, dtype=torch.long, device=drafter.device)
        self.length = 0  # context covers positions [0, length)

    def reset(self, position: int) -> None:
        """Make the context end at `position`.

        Going back forgets what a new request (0) or a rolled-back target made stale. Going
        forward (a sender whose older rows are gone) forgets everything: the context then
        starts at `position`, and the next rows must start there.
        """
        if position < self.length:
            self.positions[self.positions >= position] = -1
        elif position > self.length:
            self.positions.fill_(-1)
        self.length = position

    def held_from_start(self, rows: int) -> int:
        """How many of positions [0, rows) the ring still holds, from 0 on (0 once it has wrapped)."""
        held = min(rows, self.length, self.capacity)
        if held and not bool((self.positions[:held] == torch.arange(held, device=self.positions.device)).all()):
            return 0
        return held

    def prefix(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the context keys and values of positions [0, rows) (`held_from_start` of them)."""
        return self.keys[:, :, :rows].clone(), self.values[:, :, :rows].clone()

    def load_prefix(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The context becomes positions [0, n) with these keys and values (as `prefix` gave them)."""
        rows = keys.shape[2]
        self.reset(0)
        self.keys[:, :, :rows] = keys
        self.values[:, :, :rows] = values
        self.positions[:rows] = torch.arange(rows, device=self.positions.device)
        self.length = rows

    def check(self, start: int) -> None:
        """Refuse, before anything changes, feature rows that would leave a hole in the context."""
        if start > self.length:
            raise OutOfOrderError(f"feature rows start at {start} but the context ends at {self.length}")

    def take(self, start: int, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Make room for rows [start, start + n): the context ends at `start`; returns the
        positions and rows to compute (only the newest `capacity` can be kept)."""
        self.check(start)
        self.reset(start)
        if features.shape[0] > self.capacity:
            start, features = start + features.shape[0] - self.capacity, features[-self.capacity :]
        return torch.arange(start, start + features.shape[0], device=self.drafter.device), features

    def store(self, positions: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep per-layer context keys/values [n, kv_heads, head_dim] of `positions` (from `take`)."""
        if positions.numel() == 0:
            return
        slots = positions % self.capacity
        for i, (k, v) in enumerate(kv):  # computed in the activations' dtype, kept in the ring's
            self.keys[i][:, slots] = k.transpose(0, 1).to(self.keys.dtype)
            self.values[i][:, slots] = v.transpose(0, 1).to(self.values.dtype)
        self.positions[slots] = positions
        self.length = int(positions[-1]) + 1

    def append(self, start: int, features: torch.Tensor) -> None:
        """Add feature rows for positions [start, start+rows). Rows we already hold are recomputed."""
        propose([DraftStep(self, start, features)])

    @property
    def block_reads(self) -> int:
        """The keys a block drafted now reads: the live context, then the block's own (what a draft
        pass costs grows with it: `predraft.PassCost`)."""
        return min(self.length, self.capacity) + self.drafter.config.block_size

    def context(self) -> Context:
        """Where a block drafted now reads its context: the whole ring, and the block's own
        keys/values in the slots at and past `live`, which hold nothing valid (before the ring
        wraps, slot == position), right after the context."""
        live = min(self.length, self.capacity)
        kv = [(self.keys[i][None], self.values[i][None]) for i in range(len(self.drafter.layers))]
        return Context(kv, self.positions[:live])

    def draft_rows(self, noise: torch.Tensor, position: int, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hidden states of block slots 1..rows (slot 0, last_tok, is never a draft) and, for
        a DFlash2 drafter, their selector gate, for a noise block whose slot 0 is the token at
        `position`: what a proposal carries, wherever it is drafted."""
        if position != self.length:
            raise OutOfOrderError(f"noise block at position {position} but the context ends at {self.length}")
        empty = torch.empty(0, self.drafter.config.feature_width)
        return propose([DraftStep(self, position, empty, noise, rows)])[0]


@dataclass
class DraftStep:
    """One session's step: feature rows for [start, start + n), then (with `noise`) the block
    `noise` [block, hidden] whose slot 0 sits at start + n, of which slots 1..rows are drafts."""

    cache: DraftKVCache
    start: int
    features: torch.Tensor
    noise: torch.Tensor | None = None
    rows: int = 0


@torch.inference_mode()
def propose(steps: list[DraftStep]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Many sessions' steps in one pass: every row-wise layer (the fusion of features, the
    projections, the MLP, the selector's gate) runs over all their rows at once, and attention
    over each session's own ring, where its keys lie. It runs inside `row_independence`, so
    where `drafts_alone_in_one_pass` holds on the device, a session's bits are those of its
    step alone. Every step is checked before any cache changes. Returns (hidden [rows, hidden],
    gate or None) per step with a noise block, in order."""
    caches = [step.cache for step in steps]
    if len({id(c) for c in caches}) < len(caches):
        raise ValueError("two steps of one session in one pass")
    for step in steps:
        step.cache.check(step.start)
    if not steps:
        return []
    drafter = caches[0].drafter
    with row_independence(drafter.device):
        return _propose(drafter, steps)


def _propose(drafter: DFlashDrafter, steps: list[DraftStep]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    taken = [step.cache.take(step.start, step.features.to(drafter.device)) for step in steps]
    counts = [positions.numel() for positions, _ in taken]
    if sum(counts):
        kv = drafter.context_kv(torch.cat([f for _, f in taken]), torch.cat([p for p, _ in taken]))
        split = [(k.split(counts), v.split(counts)) for k, v in kv]
        for i, (step, (positions, _)) in enumerate(zip(steps, taken, strict=True)):
            step.cache.store(positions, [(k[i], v[i]) for k, v in split])
    drafting = [step for step in steps if step.noise is not None]
    if not drafting:
        return []
    block = drafting[0].noise.shape[0]
    noise = torch.stack([step.noise.to(drafter.device) for step in drafting])
    anchors = torch.tensor([step.cache.length for step in drafting], device=drafter.device)[:, None]
    row_positions = anchors + torch.arange(block, device=drafter.device)
    hidden = drafter.run_blocks(
        noise, row_positions, anchors.expand(-1, block), [step.cache.context() for step in drafting]
    )
    drafts = [hidden[i, 1 : 1 + step.rows] for i, step in enumerate(drafting)]
    if not drafter.config.dflash2:
        return [(h, None) for h in drafts]
    gates = drafter.gate(torch.cat(drafts)).split([step.rows for step in drafting])
    return list(zip(drafts, gates, strict=True))


def timed_pass(steps: list[DraftStep], together: bool) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None]], float]:
    """`propose` of steps that each draft a block, in one pass or (not `together`) one by one,
    and each step's share of the time it took, in ms (the device synchronized first)."""
    began = time.perf_counter()
    drafted = propose(steps) if together else [propose([step])[0] for step in steps]
    finish_queued(steps[0].cache.drafter.device)
    return drafted, (time.perf_counter() - began) * 1000 / len(steps)


def finish_queued(device: torch.device) -> None:
    """Wait for the work queued on `device`: on CUDA a clock read right after a pass measures its
    launches only, and the pass costs learned from it let every pre-draft outcome through."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def drafts_alone_in_one_pass(drafter: DFlashDrafter, seed: int = 0) -> bool:
    """Whether sessions drafted in one pass get, on this drafter's device, the bits each gets
    alone: a few random sessions (an empty context, a wrapped ring, more rows than one block of
    the fixed row block) drafted both ways and compared. A daemon checks at load, as the engine checks its
    model, and drafts one by one where this fails."""
    cfg = drafter.config
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(drafter.device, drafter.dtype)

    contexts, capacity = (0, 7, 90), 64
    plans = [
        (rand(n, cfg.feature_width), rand(3, cfg.feature_width), rand(cfg.block_size, cfg.hidden_size))
        for n in contexts
    ]
    ways = []
    for together in (False, True):
        caches = [DraftKVCache(drafter, capacity) for _ in plans]
        for cache, (context, _, _) in zip(caches, plans, strict=True):
            cache.append(0, context)
        steps = [
            DraftStep(c, c.length, new, noise, cfg.block_size - 1)
            for c, (_, new, noise) in zip(caches, plans, strict=True)
        ]
        ways.append(propose(steps) if together else [propose([step])[0] for step in steps])
    return all(
        torch.equal(h_alone, h_together) and (g_alone is None or torch.equal(g_alone, g_together))
        for (h_alone, g_alone), (h_together, g_together) in zip(*ways, strict=True)
    )
