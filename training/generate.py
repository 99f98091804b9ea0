"""Generate self-distillation data: the target answers self-instruct turns greedily, in batches.

Batching refills finished rows: a row that hits EOS or the token cap is handed out and
replaced by the next turn at once, so the batch never idles waiting for its longest
answer. Rows sit in fixed slots of one preallocated KV cache, their last tokens aligned
at a shared write column, with a padding mask and explicit positions (`_SlotCache`).

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
from transformers.cache_utils import DynamicLayer

from target_node.model.taps import tap_features
from training.answer_store import Answer, AnswerStore
from training.features import FeatureCache
from training.prompts import Ask, HeldOut, next_turns


@dataclass
class _Row:
    item: object
    tokens: list[int]
    prompt_len: int
    features: list[torch.Tensor]

    def finish(self, eos: frozenset[int], max_new: int) -> str:
        """Why the row is done ("eos" or "length"), or "" while it goes on."""
        if self.tokens[-1] in eos:
            return "eos"
        return "length" if len(self.tokens) - self.prompt_len >= max_new else ""


class _BufferLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values are views of preallocated buffers.

    Appending a token writes one column where `DynamicLayer` concatenates (copies) the whole
    cache: at 64 rows x 300 columns those copies were 30% of a decode step.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.key_buffer, self.value_buffer = keys, values
        self.device, self.is_initialized = keys.device, True
        self.resize(length)

    def resize(self, length: int) -> None:
        self.length = length
        self.keys, self.values = self.key_buffer[..., :length, :], self.value_buffer[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.key_buffer[..., self.length : end, :] = key_states
        self.value_buffer[..., self.length : end, :] = value_states
        self.resize(end)
        return self.keys, self.values


class _SlotCache:
    """One KV cache for rows of different lengths: fixed slots, one shared write column.

    Every row writes its next token at column `width`; a new row's prompt is placed to end
    there (shifting everyone right if the prompt is longer), and a finished row's slot is
    refilled in place. Columns no row looks at any more are dropped only when the buffers
    fill, so a decode step writes one column instead of copying the cache.
    """

    def __init__(self, slots: int, device: torch.device) -> None:
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(slots, 0, dtype=torch.bool, device=device)
        self.width = 0

    def _rebuild(self, slots: list[int], width: int = 0, room: int = 1) -> None:
        """Keep `slots`, drop dead columns on the left, shift right to at least `width`, leave `room` free."""
        used = self.mask[slots, : self.width].any(0).nonzero()
        first = int(used[0]) if len(used) else self.width
        shift = max(width - (self.width - first), 0)
        width = self.width - first + shift
        capacity = width + max(room, 128)  # zeroing a buffer costs as much as it holds: no doubling
        index = torch.tensor(slots, device=self.mask.device)
        for layer in self.cache.layers:
            for name in ("key_buffer", "value_buffer"):
                old = getattr(layer, name)
                new = old.new_zeros(len(slots), old.shape[1], capacity, old.shape[3])
                new[:, :, shift:width] = old[index, :, first : self.width]
                setattr(layer, name, new)
            layer.resize(width)
        mask = self.mask.new_zeros(len(slots), capacity)
        mask[:, shift:width] = self.mask[index, first : self.width]
        self.mask, self.width = mask, width

    def place(self, slot: int, one: DynamicCache, length: int) -> None:
        """Put a row whose prompt (`length` positions) sits in its own cache `one` into `slot`."""
        if self.cache is None:
            self.cache = DynamicCache()
            shapes = [(self.mask.shape[0], layer.keys.shape[1], 0, layer.keys.shape[3]) for layer in one.layers]
            self.cache.layers = [
                _BufferLayer(layer.keys.new_zeros(shape), layer.values.new_zeros(shape), 0)
                for layer, shape in zip(one.layers, shapes, strict=True)
            ]
        if length > self.width:
            self._rebuild(list(range(self.mask.shape[0])), length, length)
        span = slice(self.width - length, self.width)
        for mine, new in zip(self.cache.layers, one.layers, strict=True):
            mine.key_buffer[slot, :, span], mine.value_buffer[slot, :, span] = new.keys[0], new.values[0]
        self.mask[slot] = False
        self.mask[slot, span] = True

    def free(self, slot: int) -> None:
        self.mask[slot] = False

    def keep(self, slots: list[int]) -> None:
        """Only these slots go on, in this order: no compute for slots nothing will refill."""
        self._rebuild(slots)

    def next_mask(self) -> torch.Tensor:
        """Open the shared column for the next token (empty slots see only it) and return the mask."""
        if self.width + 1 > self.mask.shape[1]:
            self._rebuild(list(range(self.mask.shape[0])))
        self.mask[:, self.width] = True
        self.width += 1
        return self.mask[:, : self.width].long()


class RefillGenerator:
    """Batched greedy decoding where finished rows are replaced by new prompts mid-flight."""

    def __init__(
        self,
        model,  # a transformers causal LM
        eos_ids: Iterable[int],
        batch: int,
        max_new: int,
        layer_ids: tuple[int, ...] = (),
    ) -> None:
        """`layer_ids`: also capture these layers' outputs for every position (the drafter's features)."""
        self.model, self.eos = model, frozenset(eos_ids)
        self.batch, self.max_new, self.layer_ids = batch, max_new, tuple(layer_ids)
        self.device = next(model.parameters()).device

    def _run(self, **inputs: object) -> tuple[list[int], torch.Tensor | None]:
        """The model on `inputs`: each row's greedy next token, and its tapped features if wanted."""
        out = self.model(**inputs, use_cache=True, output_hidden_states=bool(self.layer_ids))
        features = tap_features(out.hidden_states, self.layer_ids) if self.layer_ids else None
        return out.logits[:, -1].argmax(-1).tolist(), features

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
        rows: list[_Row | None] = [None] * self.batch
        slots = _SlotCache(self.batch, self.device)
        finished = 0

        def check(i: int) -> None:
            """Hand row i out if it is done (EOS, or the cap), freeing its slot."""
            nonlocal finished
            row = rows[i]
            if finish := row.finish(self.eos, self.max_new):
                rows[i] = None
                slots.free(i)
                on_done(row.item, row.tokens, row.prompt_len, finish, torch.cat(row.features) if row.features else None)
                finished += 1

        while deadline is None or time.time() <= deadline:
            drained = False
            for i in range(len(rows)):
                while rows[i] is None and not drained:
                    if (item := take()) is None:
                        drained = True
                        break
                    thing, ids = item
                    one = DynamicCache(config=self.model.config)
                    prompt = torch.tensor([ids], device=self.device)
                    (first,), features = self._run(input_ids=prompt, cache=one, logits_to_keep=1)
                    slots.place(i, one, len(ids))
                    rows[i] = _Row(thing, [*ids, first], len(ids), [] if features is None else [features[0]])
                    check(i)  # the first token may already end it
            live = [i for i, row in enumerate(rows) if row is not None]
            if not live:
                break
            if drained and len(live) <= len(rows) // 2:
                slots.keep(live)
                rows = [rows[i] for i in live]
            tokens, features = self._run(
                input_ids=torch.tensor([[r.tokens[-1] if r else 0] for r in rows], device=self.device),
                attention_mask=slots.next_mask(),
                position_ids=torch.tensor([[len(r.tokens) - 1 if r else 0] for r in rows], device=self.device),
                cache=slots.cache,
            )
            for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
                if row is not None:
                    row.tokens.append(token)
                    if features is not None:
                        row.features.append(features[i, -1:])
                    check(i)
        return finished


class Turns:
    """The line of turns to answer: follow-ups first (so few conversations stay open), then openings.

    On creation it re-queues the turns that stored answers lead to but that were never
    answered (what a crash left open); each answer it records queues the turns it leads to.
    """

    def __init__(
        self,
        target,  # a TargetModel: chat template, tokenizer
        store: AnswerStore,
        openings: Iterator[Ask],
        seed: int,
        held_out: HeldOut,
        max_prompt: int,
    ) -> None:
        self.target, self.store, self.openings = target, store, openings
        self.seed, self.held_out, self.max_prompt = seed, held_out, max_prompt
        self.follow: deque[Ask] = deque()
        self.too_long = 0
        for answer in store.answers:
            ask = Ask(answer.job, answer.stage, tuple((r, c) for r, c in answer.messages), answer.then)
            self.follow.extend(
                t for t in self._next(ask, answer.tokens[answer.prompt_len :]) if t.key not in store.keys
            )

    def _next(self, ask: Ask, answer_ids: list[int]) -> list[Ask]:
        text = self.target.tokenizer.decode(answer_ids, skip_special_tokens=True)
        return next_turns(ask, text, self.seed, self.held_out)

    def take(self) -> tuple[Ask, list[int]] | None:
        """The next unanswered turn and its prompt ids; None when there is none."""
        while True:
            ask = self.follow.popleft() if self.follow else next(self.openings, None)
            if ask is None:
                return None
            if ask.key in self.store.keys:
                continue
            ids = self.target.encode_chat(ask.chat())
            if len(ids) > self.max_prompt:
                self.too_long += 1
                continue
            return ask, ids

    def answered(self, ask: Ask, tokens: list[int], prompt_len: int, finish: str) -> Answer | None:
        """Store an answer and queue what follows it; None if it was already stored."""
        messages = [list(m) for m in ask.messages]
        model = Path(self.target.config.name_or_path).name
        answer = Answer(ask.key, ask.job, ask.stage, messages, tokens, prompt_len, finish, ask.then, model)
        if not self.store.add(answer):
            return None
        self.follow.extend(self._next(ask, tokens[prompt_len:]))
        return answer


@dataclass(frozen=True)
class GenerateOptions:
    """How a generation run answers: its job stream's seed, batch, lengths, and when it stops."""

    seed: int = 0  # picks the follow-up turns an answer leads to (training.prompts.next_turns)
    batch: int = 16  # rows decoded at once
    max_new: int = 192  # answer token cap
    max_prompt: int = 768  # longer prompts are skipped
    deadline: float | None = None  # a time.time() to stop at; None: when the openings run out
    held_out: HeldOut | None = None  # None: HeldOut.load(), the committed held-out prompts
    max_feature_rows: int = 1024  # feature rows kept per answer


def generate(
    target,  # a TargetModel (model, tokenizer, chat template, eos ids)
    store: AnswerStore,
    openings: Iterator[Ask],
    opts: GenerateOptions = GenerateOptions(),
    *,
    features: FeatureCache | None = None,
    layer_ids: tuple[int, ...] = (),
    log: Callable[[str], None] = print,
) -> int:
    """Answer turns until the deadline (or the openings run out); returns how many were answered.

    With a feature cache and the drafter's `layer_ids`, the features the target computes on
    the way are kept too, so training needs no second pass over these answers.
    """
    held_out = opts.held_out if opts.held_out is not None else HeldOut.load()
    turns = Turns(target, store, openings, opts.seed, held_out, opts.max_prompt)
    log(f"generation: {len(store)} answers stored ({store.answer_tokens} answer tokens), {len(turns.follow)} pending")
    started, made = time.time(), 0

    def on_done(ask: Ask, tokens: list[int], prompt_len: int, finish: str, rows: torch.Tensor | None) -> None:
        nonlocal made
        answer = turns.answered(ask, tokens, prompt_len, finish)
        if answer is None:
            return
        if features is not None and rows is not None:
            features.add(answer.key, rows[: opts.max_feature_rows])
        made += answer.answer_tokens
        if len(store) % 100 == 0:
            rate = made / max(time.time() - started, 1e-9)
            log(f"answers {len(store)} | answer tokens {store.answer_tokens} | {rate:.1f} tok/s")

    taps = layer_ids if features is not None else ()
    generator = RefillGenerator(target.model, target.eos_ids, opts.batch, opts.max_new, taps)
    try:
        done = generator.run(turns.take, on_done, opts.deadline)
    finally:
        store.flush()
    log(
        f"generation stopped: {done} answered, {made} answer tokens in {time.time() - started:.0f} s; "
        f"{len(store)} stored; {turns.too_long} prompts too long"
    )
    return done
