"""Self-distillation data: the target's own greedy answers, with the features it tapped on the way.

Generation is the expensive part (the target decodes every token), so it runs once, caches
answers on disk and resumes where it stopped. The tapped features of every position come out
of the same forward passes for free, so they are stored too (fp16) and training never runs
the target again.

Batching refills finished rows: a row that hits EOS or the token cap is written out and
replaced by a fresh prompt at once, so the batch never idles waiting for its longest answer.
Rows are left-aligned to a shared KV length with a padding mask and explicit positions;
columns that no live row uses any more are trimmed from the left.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache


@dataclass
class Record:
    prompt: str
    tokens: list[int]  # prompt + answer
    prompt_len: int
    offset: int  # first feature row in the store; the record has len(tokens) - 1 rows


def draft_vocabulary(records: list[Record], size: int) -> list[int]:
    """The `size` most frequent answer tokens, most frequent first: the drafter's vocabulary.

    A drafter only ever learns to propose tokens it saw in answers; projecting its hidden
    states onto just these rows of the target's LM head costs a fraction of the full head.
    """
    counts = Counter(t for r in records for t in r.tokens[r.prompt_len :])
    return [token for token, _ in counts.most_common(size)]


class AnswerStore:
    """answers.jsonl (one record per answer) + features.f16 (rows of `width` fp16), append-only.

    Features are written before the jsonl line, so a crash leaves at most an unreferenced
    tail in features.f16, which the next open cuts off.
    """

    def __init__(self, folder: str | Path, width: int, readonly: bool = False) -> None:
        # readonly: a reader beside a live generator must not cut the tail it is still writing.
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.width = width
        self.index_path = self.folder / "answers.jsonl"
        self.features_path = self.folder / "features.f16"
        self.records: list[Record] = []
        if self.index_path.exists():
            for line in self.index_path.read_text().splitlines():
                try:
                    self.records.append(Record(**json.loads(line)))
                except (json.JSONDecodeError, TypeError):
                    break  # a torn last line from a crash
        self.rows = self.records[-1].offset + len(self.records[-1].tokens) - 1 if self.records else 0
        if readonly:
            return
        with open(self.features_path, "ab") as fh:
            fh.truncate(self.rows * width * 2)
        # Rewrite the index so a torn line is gone before we append after it.
        self.index_path.write_text("".join(json.dumps(r.__dict__) + "\n" for r in self.records))

    @property
    def done(self) -> set[str]:
        return {r.prompt for r in self.records}

    @property
    def answer_tokens(self) -> int:
        return sum(len(r.tokens) - r.prompt_len for r in self.records)

    def append(self, prompt: str, tokens: list[int], prompt_len: int, features: torch.Tensor) -> None:
        assert features.shape == (len(tokens) - 1, self.width), (features.shape, len(tokens))
        with open(self.features_path, "ab") as fh:
            fh.write(features.to(torch.float16).cpu().numpy().tobytes())
        record = Record(prompt, list(tokens), prompt_len, self.rows)
        with open(self.index_path, "a") as fh:
            fh.write(json.dumps(record.__dict__) + "\n")
        self.records.append(record)
        self.rows += len(tokens) - 1

    def features(self) -> np.ndarray:
        """All feature rows as a read-only memory map [rows, width] fp16."""
        if self.rows == 0:
            return np.zeros((0, self.width), dtype=np.float16)
        return np.memmap(self.features_path, dtype=np.float16, mode="r", shape=(self.rows, self.width))


@dataclass
class _Row:
    prompt: str
    tokens: list[int]
    prompt_len: int
    feats: list[torch.Tensor] = field(default_factory=list)


def _taps(hidden_states: tuple[torch.Tensor, ...], layer_ids: tuple[int, ...]) -> torch.Tensor:
    # Layer l's OUTPUT is hidden_states[l + 1], exactly what TargetModel.forward captures.
    return torch.cat([hidden_states[layer + 1] for layer in layer_ids], -1)


class RefillGenerator:
    """Batched greedy decoding where finished rows are replaced by new prompts mid-flight."""

    def __init__(
        self,
        model,
        layer_ids: tuple[int, ...],
        eos_ids: Iterable[int],
        batch: int,
        max_new: int,  # noqa: ANN001
    ) -> None:
        self.model, self.layer_ids, self.eos = model, tuple(layer_ids), frozenset(eos_ids)
        self.batch, self.max_new = batch, max_new
        self.device = next(model.parameters()).device

    def _layers(self, cache: DynamicCache) -> list:
        return list(cache.layers)

    @torch.inference_mode()
    def run(
        self,
        prompts: Iterable[tuple[str, list[int]]],
        on_done: Callable[[str, list[int], int, torch.Tensor], None],
        deadline: float | None = None,
    ) -> int:
        """Decode every (text, ids) prompt until the deadline; on_done(text, tokens, prompt_len, features)."""
        source = iter(prompts)
        rows: list[_Row] = []
        cache: DynamicCache | None = None
        mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        pending: list[int] = []
        finished = 0

        def admit() -> bool:
            nonlocal cache, mask
            item = next(source, None)
            if item is None:
                return False
            text, ids = item
            one = DynamicCache(config=self.model.config)
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                cache=one,
                use_cache=True,
                output_hidden_states=True,
                logits_to_keep=1,
            )
            p, length = len(ids), mask.shape[1]
            if cache is None:
                cache = one
                mask = torch.ones(1, p, dtype=torch.bool, device=self.device)
            else:
                if p > length:  # widen everyone on the left
                    grow = p - length
                    for layer in self._layers(cache):
                        layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, grow, 0))
                        layer.values = torch.nn.functional.pad(layer.values, (0, 0, grow, 0))
                    mask = torch.nn.functional.pad(mask, (grow, 0))
                    length = p
                for mine, new in zip(self._layers(cache), self._layers(one), strict=True):
                    k = mine.keys.new_zeros((1, *mine.keys.shape[1:]))
                    v = mine.values.new_zeros((1, *mine.values.shape[1:]))
                    k[..., length - p :, :], v[..., length - p :, :] = new.keys, new.values
                    mine.keys, mine.values = torch.cat([mine.keys, k]), torch.cat([mine.values, v])
                row_mask = torch.zeros(1, length, dtype=torch.bool, device=self.device)
                row_mask[0, length - p :] = True
                mask = torch.cat([mask, row_mask])
            first = int(out.logits[0, -1].argmax())
            rows.append(_Row(text, list(ids) + [first], p, [_taps(out.hidden_states, self.layer_ids)[0]]))
            pending.append(first)
            return True

        def retire(i: int) -> None:
            nonlocal mask
            row = rows.pop(i)
            pending.pop(i)
            keep = [j for j in range(mask.shape[0]) if j != i]
            for layer in self._layers(cache):
                layer.keys, layer.values = layer.keys[keep], layer.values[keep]
            mask = mask[keep]
            on_done(row.prompt, row.tokens, row.prompt_len, torch.cat(row.feats))

        while len(rows) < self.batch and admit():
            pass
        while rows:
            if deadline is not None and time.time() > deadline:
                break
            # Finished rows first: a finished row leaves, a new prompt takes its place.
            for i in reversed(range(len(rows))):
                row = rows[i]
                if row.tokens[-1] in self.eos or len(row.tokens) - row.prompt_len >= self.max_new:
                    retire(i)
                    finished += 1
            while len(rows) < self.batch and admit():
                pass
            if not rows:
                break
            live = mask.any(0).nonzero()
            first_col = int(live[0]) if len(live) else 0
            if first_col:  # nobody looks this far back any more
                for layer in self._layers(cache):
                    layer.keys, layer.values = layer.keys[..., first_col:, :], layer.values[..., first_col:, :]
                mask = mask[:, first_col:]
            positions = torch.tensor([[len(r.tokens) - 1] for r in rows], device=self.device)
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.bool, device=self.device)], 1)
            out = self.model(
                input_ids=torch.tensor([[t] for t in pending], device=self.device),
                attention_mask=mask.long(),
                position_ids=positions,
                cache=cache,
                use_cache=True,
                output_hidden_states=True,
            )
            feats = _taps(out.hidden_states, self.layer_ids)[:, -1]
            nxt = out.logits[:, -1].argmax(-1).tolist()
            for i, row in enumerate(rows):
                row.feats.append(feats[i : i + 1])
                row.tokens.append(nxt[i])
                pending[i] = nxt[i]
        return finished


def generate_answers(
    target,  # noqa: ANN001 - a TargetModel
    prompts: list[str],
    store: AnswerStore,
    layer_ids: tuple[int, ...],
    *,
    batch: int = 16,
    max_new: int = 160,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> int:
    """Answer every prompt the store lacks, appending as rows finish; returns how many were answered."""
    done = store.done
    todo = [p for p in prompts if p not in done]
    log(f"generation: {len(done)} answers cached, {len(todo)} prompts to go")
    start, tokens0 = time.time(), store.answer_tokens

    def encoded():
        for p in todo:
            yield p, target.encode_chat([{"role": "user", "content": p}])

    def on_done(prompt: str, tokens: list[int], prompt_len: int, feats: torch.Tensor) -> None:
        store.append(prompt, tokens, prompt_len, feats)
        n = len(store.records)
        if n % 50 == 0:
            made = store.answer_tokens - tokens0
            log(f"answers {n} | answer tokens {store.answer_tokens} | {made / (time.time() - start):.1f} tok/s")

    gen = RefillGenerator(target.model, layer_ids, target.eos_ids, batch, max_new)
    return gen.run(encoded(), on_done, deadline)
