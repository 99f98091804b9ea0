"""Generate self-distillation data: the target answers self-instruct turns greedily, in batches.

Batching refills finished rows: a row that hits EOS or the token cap is handed out and
replaced by the next turn at once, so the batch never idles waiting for its longest
answer. Rows are left-aligned to a shared KV length with a padding mask and explicit
positions; columns no live row uses any more are trimmed from the left.

The pipeline keeps follow-up turns ahead of fresh jobs, so few conversations are open at
once, and it resumes from the store: turns already answered are skipped, and the turns
that stored answers lead to (a follow-up, the questions a meta turn produced) are queued
again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from target_node.taps import tap_features
from training.answer_store import Answer, AnswerStore
from training.features import FeatureCache
from training.prompts import Ask, HeldOut, next_turns


@dataclass
class _Row:
    item: object
    tokens: list[int]
    prompt_len: int
    features: list[torch.Tensor]


class RefillGenerator:
    """Batched greedy decoding where finished rows are replaced by new prompts mid-flight."""

    def __init__(
        self,
        model,  # noqa: ANN001 - a transformers causal LM
        eos_ids: Iterable[int],
        batch: int,
        max_new: int,
        layer_ids: tuple[int, ...] = (),
    ) -> None:
        """`layer_ids`: also capture these layers' outputs for every position (the drafter's features)."""
        self.model, self.eos = model, frozenset(eos_ids)
        self.batch, self.max_new, self.layer_ids = batch, max_new, tuple(layer_ids)
        self.device = next(model.parameters()).device

    def _features(self, out) -> torch.Tensor | None:  # noqa: ANN001
        return tap_features(out.hidden_states, self.layer_ids) if self.layer_ids else None

    @torch.inference_mode()
    def run(
        self,
        take: Callable[[], tuple[object, list[int]] | None],
        on_done: Callable[[object, list[int], int, str, torch.Tensor | None], None],
        deadline: float | None = None,
    ) -> int:
        """Decode (item, ids) prompts from `take()` until it has none (None) or the deadline.

        on_done(item, tokens, prompt_len, finish, features): features [len(tokens) - 1, width]
        for every position but the last, or None without `layer_ids`.
        `take` is called whenever a row is free, after on_done, so on_done may feed it new prompts.
        """
        rows: list[_Row] = []
        cache: DynamicCache | None = None
        mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        finished = 0

        def admit() -> bool:
            nonlocal cache, mask
            item = take()
            if item is None:
                return False
            thing, ids = item
            one = DynamicCache(config=self.model.config)
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                cache=one,
                use_cache=True,
                logits_to_keep=1,
                output_hidden_states=bool(self.layer_ids),
            )
            p, length = len(ids), mask.shape[1]
            if cache is None:
                cache, mask = one, torch.ones(1, p, dtype=torch.bool, device=self.device)
            else:
                if p > length:  # widen everyone on the left
                    for layer in cache.layers:
                        layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, p - length, 0))
                        layer.values = torch.nn.functional.pad(layer.values, (0, 0, p - length, 0))
                    mask = torch.nn.functional.pad(mask, (p - length, 0))
                    length = p
                for mine, new in zip(cache.layers, one.layers, strict=True):
                    k = mine.keys.new_zeros((1, *mine.keys.shape[1:]))
                    v = mine.values.new_zeros((1, *mine.values.shape[1:]))
                    k[..., length - p :, :], v[..., length - p :, :] = new.keys, new.values
                    mine.keys, mine.values = torch.cat([mine.keys, k]), torch.cat([mine.values, v])
                row_mask = torch.zeros(1, length, dtype=torch.bool, device=self.device)
                row_mask[0, length - p :] = True
                mask = torch.cat([mask, row_mask])
            features = self._features(out)
            rows.append(
                _Row(thing, list(ids) + [int(out.logits[0, -1].argmax())], p, [] if features is None else [features[0]])
            )
            return True

        def retire(i: int, finish: str) -> None:
            nonlocal mask
            row = rows.pop(i)
            keep = [j for j in range(mask.shape[0]) if j != i]
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[keep], layer.values[keep]
            mask = mask[keep]
            on_done(row.item, row.tokens, row.prompt_len, finish, torch.cat(row.features) if row.features else None)

        while True:
            for i in reversed(range(len(rows))):
                row = rows[i]
                if row.tokens[-1] in self.eos:
                    retire(i, "eos")
                    finished += 1
                elif len(row.tokens) - row.prompt_len >= self.max_new:
                    retire(i, "length")
                    finished += 1
            if deadline is not None and time.time() > deadline:
                break
            while len(rows) < self.batch and admit():
                pass
            if not rows:
                break
            live = mask.any(0).nonzero()
            first_col = int(live[0]) if len(live) else 0
            if first_col:  # nobody looks this far back any more
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[..., first_col:, :], layer.values[..., first_col:, :]
                mask = mask[:, first_col:]
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.bool, device=self.device)], 1)
            out = self.model(
                input_ids=torch.tensor([[r.tokens[-1]] for r in rows], device=self.device),
                attention_mask=mask.long(),
                position_ids=torch.tensor([[len(r.tokens) - 1] for r in rows], device=self.device),
                cache=cache,
                use_cache=True,
                output_hidden_states=bool(self.layer_ids),
            )
            features = self._features(out)
            for i, (row, token) in enumerate(zip(rows, out.logits[:, -1].argmax(-1).tolist(), strict=True)):
                row.tokens.append(token)
                if features is not None:
                    row.features.append(features[i, -1:])
        return finished


def pending_turns(
    store: AnswerStore, seed: int, decode: Callable[[list[int]], str], held_out: HeldOut
) -> list[Ask]:
    """Turns that stored answers lead to but that are not answered yet (what a crash left open)."""
    out = []
    for answer in store.answers:
        ask = Ask(answer.job, answer.stage, tuple((r, c) for r, c in answer.messages), answer.then)
        text = decode(answer.tokens[answer.prompt_len :])
        out += [t for t in next_turns(ask, text, seed, held_out) if t.key not in store.keys]
    return out


def generate(
    target,  # noqa: ANN001 - a TargetModel (model, tokenizer, chat template, eos ids)
    store: AnswerStore,
    openings: Iterator[Ask],
    *,
    seed: int = 0,
    batch: int = 16,
    max_new: int = 192,
    max_prompt: int = 768,
    deadline: float | None = None,
    held_out: HeldOut | None = None,
    features: FeatureCache | None = None,
    layer_ids: tuple[int, ...] = (),
    max_feature_rows: int = 1024,
    log: Callable[[str], None] = print,
) -> int:
    """Answer turns until the deadline (or the openings run out); returns how many were answered.

    With a feature cache and the drafter's `layer_ids`, the features the target computes on
    the way are kept too, so training needs no second pass over these answers.
    """

    def decode(ids: list[int]) -> str:
        return target.tokenizer.decode(ids, skip_special_tokens=True)

    held_out = held_out if held_out is not None else HeldOut.load()
    follow: deque[Ask] = deque(pending_turns(store, seed, decode, held_out))
    skipped = {"too_long": 0}
    log(f"generation: {len(store)} answers stored ({store.answer_tokens} answer tokens), {len(follow)} turns pending")
    started, made = time.time(), 0

    def take() -> tuple[Ask, list[int]] | None:
        """The next turn to answer: follow-ups first, so few conversations stay open."""
        while True:
            ask = follow.popleft() if follow else next(openings, None)
            if ask is None:
                return None
            if ask.key in store.keys:
                continue
            ids = target.encode_chat(ask.chat())
            if len(ids) > max_prompt:
                skipped["too_long"] += 1
                continue
            return ask, ids

    def on_done(ask: Ask, tokens: list[int], prompt_len: int, finish: str, rows: torch.Tensor | None) -> None:
        nonlocal made
        answer = Answer(
            ask.key,
            ask.job,
            ask.stage,
            [list(m) for m in ask.messages],
            tokens,
            prompt_len,
            finish,
            ask.then,
            Path(target.config.name_or_path).name,
        )
        if store.add(answer):
            if features is not None and rows is not None:
                features.add(answer.key, rows[:max_feature_rows])
            made += answer.answer_tokens
            follow.extend(next_turns(ask, decode(tokens[prompt_len:]), seed, held_out))
            if len(store) % 100 == 0:
                rate = made / max(time.time() - started, 1e-9)
                log(
                    f"answers {len(store)} | answer tokens {store.answer_tokens} | {rate:.1f} tok/s | skipped {skipped}"
                )

    taps = layer_ids if features is not None else ()
    generator = RefillGenerator(target.model, target.eos_ids, batch, max_new, taps)
    try:
        done = generator.run(take, on_done, deadline)
    finally:
        store.flush()
    log(
        f"generation stopped: {done} answered, {made} answer tokens in {time.time() - started:.0f} s; "
        f"{len(store)} stored; skipped {skipped}"
    )
    return done
