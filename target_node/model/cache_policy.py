"""How the target's cache gives back positions it ran but did not commit.

A verify step runs `[last_tok, drafts...]` and keeps only what the target stands by; the
cache must then hold exactly the committed positions, as if the rejected ones had never
run. How to get there depends on the cache layer, and a model's cache may mix them:

- full attention (`DynamicLayer`): drop the tail (crop); a tree step keeps a chosen set of
  rows (gather, then crop);
- sliding window (`DynamicSlidingWindowLayer`): the layer keeps only its window, so it is
  told to keep everything a verify adds until the rollback (`activate_past_recording`),
  then the tail is cropped and the window restored;
- linear attention / state space (`LinearAttentionLayer`, and the attention-plus-recurrent
  `LinearAttentionAndFullAttentionLayer`): a recurrent state, which no crop rolls back; see
  recurrent.py (restore the state before the verify and replay the accepted tokens, or
  capture the state at every verified position);
- no cache at all (`DummyLayer`, for layers of MLPs or experts only): nothing to roll back.

The policy is chosen from the model's own cache layers, never from the model's name; a layer
type no policy serves is refused when the target loads, with the reason, not mid-request.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from target_node.model.policies import DEFAULT_RECURRENT, RECURRENT_POLICIES
from target_node.model.recurrent import RecurrentRollback

# Cache layer type -> (its attention part, whether it holds a recurrent state). Exact types only:
# a subclass may keep more state than its parent rolls back.
LAYER_KINDS: dict[type, tuple[str | None, bool]] = {
    DynamicLayer: ("full", False),
    DynamicSlidingWindowLayer: ("sliding", False),
    LinearAttentionLayer: (None, True),
    LinearAttentionAndFullAttentionLayer: ("full", True),
    DummyLayer: (None, False),  # a layer that caches nothing (MLP or experts only)
}


class UnsupportedCache(ValueError):
    """A cache layer type whose rollback this project does not know."""


class CachePolicy(Protocol):
    name: str
    tree: bool  # whether `keep` can select any rows (tree verification); otherwise only a prefix

    def prepare(self, cache: DynamicCache, start: int, count: int) -> None:
        """Called before `count` tokens run at positions `start`..: snapshot what rollback needs."""

    def rollback(self, cache: DynamicCache, length: int) -> None:
        """Keep positions [0, length)."""

    def keep(self, cache: DynamicCache, start: int, rows: list[int]) -> None:
        """After a forward from `start`: keep its rows `rows` (offsets, ascending, 0 first) at
        positions start, start + 1, ..., and drop every other row it ran."""

    def length(self, cache: DynamicCache) -> int:
        """Positions the cache holds (where `get_seq_length` cannot tell, e.g. recurrent layers only)."""


class CropPolicy:
    """Full attention: every position's keys and values sit in the cache, so dropping the
    tail rolls back, and gathering rows into place keeps a tree's accepted path."""

    name = "crop"
    tree = True

    def prepare(self, cache: DynamicCache, start: int, count: int) -> None:
        pass

    def rollback(self, cache: DynamicCache, length: int) -> None:
        cache.crop(length - cache.get_seq_length())

    def keep(self, cache: DynamicCache, start: int, rows: list[int]) -> None:
        if rows == list(range(len(rows))):
            self.rollback(cache, start + len(rows))
            return
        index = torch.tensor(rows, device=cache.layers[0].keys.device) + start
        for layer in cache.layers:
            layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, index)], -2)
            layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, index)], -2)

    def length(self, cache: DynamicCache) -> int:
        return cache.get_seq_length()


class LayeredPolicy:
    """Each cache layer rolled back its own way, within the last forward: attention parts
    cropped (sliding ones recording their past meanwhile), recurrent states put back.

    Only a prefix of a forward can be kept (tree = False): sliding windows and recurrent
    states hold no per-row entries to gather from."""

    tree = False

    def __init__(self, cache: DynamicCache, recurrent: RecurrentRollback | None) -> None:
        kinds = [LAYER_KINDS[type(layer)] for layer in cache.layers]
        self.full = [i for i, (attention, _) in enumerate(kinds) if attention == "full"]
        self.sliding = [i for i, (attention, _) in enumerate(kinds) if attention == "sliding"]
        self.recurrent = recurrent
        parts = ["crop"] * bool(self.full) + ["window"] * bool(self.sliding)
        self.name = "+".join(parts + ([recurrent.mode] if recurrent is not None else []))
        self.cache: DynamicCache | None = None
        self.start = self.end = 0  # the last forward ran positions [start, end) of `cache`

    def prepare(self, cache: DynamicCache, start: int, count: int) -> None:
        for i in self.sliding:
            cache.layers[i].activate_past_recording()
        if self.recurrent is not None:
            self.recurrent.prepare(cache, count)
        self.cache, self.start, self.end = cache, start, start + count

    def rollback(self, cache: DynamicCache, length: int) -> None:
        if cache is not self.cache or not self.start <= length <= self.end:
            raise ValueError(
                f"the {self.name} cache policy rolls back within the last forward only "
                f"(positions {self.start}..{self.end}), not to {length}"
            )
        drop = self.end - length
        if self.recurrent is not None and drop:
            states = self.recurrent.state_at(length - self.start)
            if states is None:  # not kept: back to the forward's start, then run the kept tokens again
                self._crop(cache, self.end - self.start)
                self.recurrent.load(cache, self.recurrent.state_at(0))
                self.recurrent.replay(cache, length - self.start)
                drop = 0
            else:
                self.recurrent.load(cache, states)
        self._crop(cache, drop)
        self.end = length

    def _crop(self, cache: DynamicCache, drop: int) -> None:
        """Drop the last `drop` positions of every attention part; sliding layers also go back to
        their window (even when nothing is dropped)."""
        for i in self.full:
            DynamicLayer.crop(cache.layers[i], -drop)
        for i in self.sliding:
            DynamicSlidingWindowLayer.crop(cache.layers[i], -drop)

    def keep(self, cache: DynamicCache, start: int, rows: list[int]) -> None:
        if rows != list(range(len(rows))):
            raise ValueError(f"the {self.name} cache policy keeps a prefix of a forward only (tree = False)")
        self.rollback(cache, start + len(rows))

    def length(self, cache: DynamicCache) -> int:
        return self.end if cache is self.cache else 0


def policy_for(cache: DynamicCache, model: nn.Module | None = None, recurrent: str | None = None) -> CachePolicy:
    """The rollback policy this cache's layers need. `model` (whose decoder fills such caches) is
    needed only by recurrent layers, whose rollback `recurrent` names (capture or replay)."""
    if recurrent is not None and recurrent not in RECURRENT_POLICIES:
        raise ValueError(f"unknown cache policy {recurrent!r}; choose one of {', '.join(RECURRENT_POLICIES)}")
    unknown = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in LAYER_KINDS})
    if unknown:
        known = ", ".join(kind.__name__ for kind in LAYER_KINDS)
        raise UnsupportedCache(f"cache layers {unknown} cannot be rolled back by any policy this project has ({known})")
    kinds = {type(layer) for layer in cache.layers}
    if kinds <= {DynamicLayer}:
        return CropPolicy()
    rollback = None
    if any(LAYER_KINDS[kind][1] for kind in kinds):
        if model is None:
            raise ValueError("recurrent cache layers need the model to roll back")
        rollback = RecurrentRollback(model, lambda: DynamicCache(config=model.config), recurrent or DEFAULT_RECURRENT)
    return LayeredPolicy(cache, rollback)
