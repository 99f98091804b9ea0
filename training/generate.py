"""Generate self-distillation data: the target answers self-instruct turns greedily, in batches.

Batching refills finished rows: a row that hits EOS or the token cap is handed out and
replaced by the next turn at once, so the batch never idles waiting for its longest
answer. The rows run on the target's engine through the decoder the daemon serves with,
so the answers and their features are exactly what the daemon would produce.

The pipeline keeps follow-up turns ahead of fresh jobs, so few conversations are open at
once, and it resumes from the store: turns already answered are skipped, and the turns
that stored answers lead to (a follow-up, the questions a meta turn produced) are queued
again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from answers.store import Answer, AnswerStore
from target_node.decoding.options import DecodeOptions
from target_node.decoding.sequence import Sequence, step
from target_node.drafting.proposers import NoProposer
from target_node.model.target import TargetModel
from training.features import DiskReserve, FeatureCache
from training.prompts import Ask, HeldOut, next_turns


class FeatureRecorder(NoProposer):
    """Drafts nothing and keeps what the forwards tapped for the committed positions, in order:
    the drafter's features for an answer, captured while it is generated."""

    def __init__(self, taps: tuple[int, ...]) -> None:
        self.taps = taps
        self.rows: list[torch.Tensor] = []

    def commit(self, start: int, features: torch.Tensor | None) -> None:
        if features is not None:
            self.rows.append(features)


class RefillGenerator:
    """Batched greedy decoding on the target's engine, the daemon's own decoder (`Sequence`, `step`):
    a row per engine slot, and a finished row replaced by the next prompt at once, so the batch
    never idles waiting for its longest answer. Each answer is the target's greedy answer to its
    prompt alone, bit for bit (the engine computes every row as if alone)."""

    def __init__(self, target: TargetModel, batch: int, max_new: int, layer_ids: tuple[int, ...] = ()) -> None:
        """`layer_ids`: also capture these layers' outputs for every position (the drafter's features)."""
        if target.slots < batch:
            raise ValueError(f"a batch of {batch} needs a target with as many slots, not {target.slots}")
        self.target, self.batch, self.layer_ids = target, batch, tuple(layer_ids)
        self.options = DecodeOptions(max_new, adaptive=False)
        self.produced = 0  # tokens the target committed, rows still running included

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
        running: dict[int, tuple[object, Sequence, FeatureRecorder]] = {}
        free, finished = list(range(self.batch))[::-1], 0
        while deadline is None or time.monotonic() <= deadline:
            while free:  # asked again each step: an answer handed out may have queued its next turn
                item = take()
                if item is None:
                    break
                slot, recorder = free.pop(), FeatureRecorder(self.layer_ids)
                running[slot] = (item[0], Sequence(self.target, item[1], recorder, self.options, slot=slot), recorder)
            if not running:
                break
            before = sum(len(seq.output.tokens) for _, seq, _ in running.values())
            step(self.target, [seq for _, seq, _ in running.values()])
            self.produced += sum(len(seq.output.tokens) for _, seq, _ in running.values()) - before
            for slot in [slot for slot, (_, seq, _) in running.items() if seq.done]:
                thing, seq, recorder = running.pop(slot)
                free.append(slot)
                result = seq.result()
                tokens = seq.prompt + result.tokens
                features = torch.cat(recorder.rows)[: len(tokens) - 1] if recorder.rows else None
                on_done(thing, tokens, len(seq.prompt), result.finish_reason, features)
                finished += 1
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
        for answer in store.stored():
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
        target = self.target
        answer = Answer(ask.key, ask.job, ask.stage, messages, tokens, prompt_len, finish, ask.then, target.name)
        answer.made_by = target.numerics
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
    deadline: float | None = None  # a time.monotonic() to stop at; None: when the openings run out
    held_out: HeldOut | None = None  # None: HeldOut.load(), the committed held-out prompts
    max_feature_rows: int = 1024  # feature rows kept per answer


def generate(
    target: TargetModel,
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
    the way are kept too, so training needs no second pass over these answers, until the disk
    reaches the cache's `DiskReserve`: then answers go on without them (a fill adds them later).
    """
    held_out = opts.held_out if opts.held_out is not None else HeldOut.load()
    turns = Turns(target, store, openings, opts.seed, held_out, opts.max_prompt)
    log(f"generation: {len(store)} answers stored ({store.answer_tokens} answer tokens), {len(turns.follow)} pending")
    started, made = time.monotonic(), 0
    disk = DiskReserve(features.folder) if features is not None else None
    disk_said = False

    def on_done(ask: Ask, tokens: list[int], prompt_len: int, finish: str, rows: torch.Tensor | None) -> None:
        nonlocal made, disk_said
        answer = turns.answered(ask, tokens, prompt_len, finish)
        if answer is None:
            return
        if features is not None and rows is not None and disk is not None:
            if not disk.full():
                features.add(answer.key, rows[: opts.max_feature_rows])
            elif not disk_said:
                disk_said = True
                log("generation: the disk is nearly full; answers go on without features (--stage features adds them)")
        made += answer.answer_tokens
        if len(store) % 100 == 0:
            rate = made / max(time.monotonic() - started, 1e-9)
            log(f"answers {len(store)} | answer tokens {store.answer_tokens} | {rate:.1f} tok/s")

    taps = layer_ids if features is not None else ()
    batch = min(opts.batch, target.slots)
    if batch < opts.batch:
        log(f"generation: batch {batch}, as many rows as the target decodes at once (asked for {opts.batch})")
    generator = RefillGenerator(target, batch, opts.max_new, taps)
    try:
        done = generator.run(turns.take, on_done, opts.deadline)
    finally:
        store.flush()
    log(
        f"generation stopped: {done} answered, {made} answer tokens in {time.monotonic() - started:.0f} s; "
        f"{len(store)} stored; {turns.too_long} prompts too long"
    )
    return done
