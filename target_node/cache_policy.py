"""How the target's cache gives back positions it ran but did not commit.

A verify step runs `[last_tok, drafts...]` and keeps only what the target stands by; the
cache must then hold exactly the committed positions, as if the rejected ones had never
run. How to get there depends on the cache layer: a full-attention layer simply drops
the tail (crop); a tree step keeps a chosen set of rows (gather, then crop). The policy is
chosen from the model's own cache layers, never from the model's name; a layer type no
policy serves is refused when the target loads, with the reason, not mid-request.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


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


def policy_for(cache: DynamicCache) -> CachePolicy:
    """The rollback policy this cache's layers need."""
    kinds = {type(layer) for layer in cache.layers}
    if kinds <= {DynamicLayer}:
        return CropPolicy()
    names = sorted(k.__name__ for k in kinds - {DynamicLayer})
    raise UnsupportedCache(f"cache layers {names} cannot be rolled back by any policy this project has")
