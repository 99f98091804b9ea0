"""The transformers path: any decoder's own forward over a `DynamicCache`, rolled back by policy.

This runs what the engine does not serve (sliding-window-only caches on the GPU, mixtures of
experts, linear attention and state-space layers, families with other norms or activations):
the model's own decoder stack, a cache that grows by concatenation, and the rollback policy its
cache layers call for (cache_policy.py). Its rows are not batch-invariant: a verify forward may
round a row differently from the one-token step, which in fp32 rarely flips an argmax and in
bf16 often does. The engine exists for that; this path exists so every decoder still serves.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from target_node.engine.rows import tree_depths, tree_paths
from target_node.model.cache_policy import CachePolicy, policy_for
from target_node.model.taps import tap_features


class TransformersPath:
    def __init__(self, model, cache_policy: str | None = None) -> None:
        self.model = model
        self.cache: DynamicCache | None = None
        self.policy: CachePolicy = policy_for(self.new_cache(), model, cache_policy)
        self.name, self.tree = self.policy.name, self.policy.tree
        self.tap_offset = 1  # where decoder layer 0's output sits in hidden_states (support.probe)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    slots = 1  # one DynamicCache: one sequence at a time, in slot 0

    def _one(self, slot: int) -> None:
        if slot != 0:
            raise ValueError(f"the transformers path holds one sequence (slot 0), not slot {slot}; the engine batches")

    def length(self, slot: int = 0) -> int:
        self._one(slot)
        return 0 if self.cache is None else self.policy.length(self.cache)

    def reset(self, slot: int = 0) -> None:
        self._one(slot)
        self.cache = None

    @torch.inference_mode()
    def step(
        self, tokens: list[int], taps: tuple[int, ...] = (), parents: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.cache is None:
            self.cache = self.new_cache()
        start = self.length()
        self.policy.prepare(self.cache, start, len(tokens))
        device = self.model.device
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        extra = {} if parents is None else self._tree_inputs(parents, start)
        out = self.model.get_decoder()(
            input_ids=ids, cache=self.cache, use_cache=True, output_hidden_states=bool(taps), **extra
        )
        features = tap_features(out.hidden_states, taps, self.tap_offset)[0] if taps else None
        return out.last_hidden_state[0], features

    def _tree_inputs(self, parents: list[int], start: int) -> dict:
        """Positions by depth, and a 4-D mask through the model's own attention: each row sees the
        committed context, its ancestors and itself."""
        if not self.policy.tree:
            raise ValueError(f"the {self.policy.name} cache policy cannot verify trees")
        device = self.model.device
        positions = torch.tensor([[start + d for d in tree_depths(parents)]], device=device)
        rows = len(parents) + 1
        allowed = torch.ones(rows, start + rows, dtype=torch.bool, device=device)
        seen = torch.zeros(rows, rows, dtype=torch.bool)
        for row, path in enumerate(tree_paths(parents)):
            seen[row, path] = True
        allowed[:, start:] = seen.to(device)
        dtype = self.model.dtype
        mask = torch.zeros(1, 1, rows, start + rows, dtype=dtype, device=device)
        return {"position_ids": positions, "attention_mask": mask.masked_fill(~allowed, torch.finfo(dtype).min)}

    def step_batch(
        self, parts: list[tuple[int, list[int], list[int] | None]], taps: tuple[int, ...] = ()
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        for slot, _, _ in parts:
            self._one(slot)
        return [self.step(tokens, taps, parents) for _, tokens, parents in parts]

    @torch.inference_mode()
    def features_batch(self, token_lists: list[list[int]], taps: tuple[int, ...]) -> list[torch.Tensor]:
        """Tap features of several sequences from position 0 in one forward, without the cache:
        right-padded, so causal attention keeps every row blind to the padding after it. Only the
        rounding of a batched matmul differs from each sequence alone: fine for training data,
        which the drafter learns from, never for verification."""
        width = max(len(tokens) for tokens in token_lists)
        ids = torch.zeros(len(token_lists), width, dtype=torch.long)
        for i, tokens in enumerate(token_lists):
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        out = self.model.get_decoder()(input_ids=ids.to(self.model.device), use_cache=False, output_hidden_states=True)
        features = tap_features(out.hidden_states, taps, self.tap_offset)
        return [features[i, : len(tokens)] for i, tokens in enumerate(token_lists)]

    def rollback(self, length: int, slot: int = 0) -> None:
        self._one(slot)
        self.policy.rollback(self.cache, length)

    def keep(self, start: int, rows: list[int], slot: int = 0) -> None:
        self._one(slot)
        self.policy.keep(self.cache, start, rows)
