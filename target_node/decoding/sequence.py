"""A request's decoding, one forward at a time, alone or batched with others.

A `Sequence` is one request's state: its slot in the target's cache, its prompt (prefilled in
chunks), its output, sampler, proposer and governor. Each forward it offers its rows (`part`: a
prefill chunk, or a step's plan) and takes back what the forward computed for them (`take`).
`step` runs any number of sequences' parts in one target forward and one head projection, so
the daemon batches requests; `generate` runs one sequence alone. The engine computes every row
as if it were alone, so a request's output is the same whichever way it ran.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

import dflash_kernels
from target_node.decoding.governor import Governor
from target_node.decoding.options import DecodeOptions
from target_node.decoding.output import OnCommit, Output
from target_node.decoding.pace import PrefillPace
from target_node.decoding.sampling import Sampler
from target_node.decoding.speculative import ForwardOut, Plan, Room, Step, finish_step, plan_step
from target_node.decoding.stats import Stats
from target_node.drafting.proposal import EMPTY
from target_node.drafting.proposers import PROMPT_LOOKUP, Proposer
from target_node.model.target import TargetModel

log = logging.getLogger("decoding")

NO_CAP = 1 << 30  # prefill_chunk 0: a prompt in one forward, hints all in one verify


@dataclass
class Result:
    tokens: list[int]
    text: str
    finish_reason: str  # "eos" | "length" | "stop" | "cancelled"
    stats: Stats


@dataclass
class Part:
    """One sequence's share of a forward."""

    tokens: list[int]
    parents: list[int] | None
    head_rows: int  # how many of the last rows need the target's head (0 for a prefill chunk mid-prompt)


class Sequence:
    def __init__(
        self,
        target: TargetModel,
        prompt: list[int],
        proposer: Proposer,
        options: DecodeOptions,
        *,
        slot: int = 0,
        on_commit: OnCommit | None = None,
        governor: Governor | None = None,
    ) -> None:
        """A `governor` passed in (the caller's, to carry what it learned across requests) decides
        whether to draft when `options.adaptive`; else a fresh one does."""
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        target.check_length(len(prompt), options.max_new_tokens)
        self.target, self.prompt, self.proposer, self.slot = target, list(prompt), proposer, slot
        eos = target.eos_ids if options.stop_on_eos else frozenset()
        self.output = Output(
            target.tokenizer,
            options.max_new_tokens,
            eos,
            options.stop_strings,
            list(options.hint_tokens),
            on_commit,
            context=self.prompt,
        )
        sampling = options.sampling
        self.sampler = None if sampling is None or sampling.is_greedy else Sampler(sampling, target.device)
        # The governor decides from wall-clock timings; a seeded sampled run must replay the same
        # draws, so it drafts every step instead (greedy output never depends on the governor).
        seeded = self.sampler is not None and sampling.seed is not None
        self.governor = (governor or Governor()) if options.adaptive and not seeded else None
        self.tree_nodes = options.tree_nodes
        # The most known rows, prompt or hints, this request puts in one forward (a pace resizes it).
        self.chunk = options.prefill_chunk if options.prefill_chunk > 0 else NO_CAP
        # Each hint verified in a sampled step draws a coin: a seeded request verifies them in
        # chunks of a fixed size, never the pace's (timing's), or its draws would not replay (an audit).
        self.hint_chunk = self.chunk if seeded else None
        self.stats = Stats(prompt_tokens=len(self.prompt), requests=1)
        self.prefilled = 0  # prompt positions run so far
        self.plan: Plan | None = None
        # Lookups find continuations at no drafting cost: the context's own, the target's earlier answers.
        context = (PROMPT_LOOKUP,) if options.lookup else ()
        self.lookups = (*context, options.datastore) if options.datastore is not None else context
        self.room = Room()  # what the next step may verify (prepare)
        self.drafting_failed = False  # drafting raised: this request's steps verify only what it knows
        self.asked = False  # this step asked the drafter (whatever came back)
        self.cancelled = False
        self.failed: Exception | None = None  # taking a forward's results raised: this request ends with it
        self.began = time.perf_counter()
        # Room for the whole request at once (within the model's positions): reserving only the
        # prompt had the first verify after it grow, and so copy, every slot's cache (an audit:
        # 1.7 s for that step after a 4,100-token prompt, 0.2 s without the growth).
        target.reset(slot, expect=len(self.prompt) + options.max_new_tokens + 1)
        proposer.begin(target)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def done(self) -> bool:
        return self.cancelled or self.failed is not None or self.output.done

    def cancel(self) -> None:
        self.cancelled = True
        self.output.finish = "cancelled"

    def reuse(
        self, length: int, rows: torch.Tensor, features: torch.Tensor | None, name: str = "", features_from: int = 0
    ) -> None:
        """Start from the first `length` positions of an earlier request (the prefix cache's hit):
        its KV `rows` and, for a proposer that reads them, its `features` of positions from
        `features_from` on (as far back as a prefill of the prefix would have left them in the
        ring), and its drafter's own context where a drafter kept it under `name`; only the rest
        of the prompt is prefilled. Before the first forward, and never the whole prompt (its last
        token must run: its logits give the first token)."""
        if self.prefilled or not 0 < length < len(self.prompt):
            raise ValueError(f"cannot reuse {length} positions of a {len(self.prompt)}-token prompt here")
        self.target.load_rows(self.slot, rows[:, :, :, :length])
        if self.proposer.taps:
            self.proposer.commit(features_from, features[: length - features_from])
            if name and not features_from:  # a drafter keeps contexts that start at 0
                self.proposer.restore(name, length)
        self.prefilled = self.stats.cached_tokens = length

    def committed(self) -> tuple[list[int], torch.Tensor, torch.Tensor | None, int]:
        """What a later request may start from: the tokens of the positions the slot's cache holds
        committed, their KV rows, and, where the proposer reads features, those it still holds
        and the first position they cover (past 0 once the ring has wrapped: without them a long
        chat's turns missed the cache whenever a drafter drafted, an audit)."""
        tokens = (self.prompt + self.output.tokens)[: self.target.length_of(self.slot)]
        held = self.proposer.held_features(len(tokens)) if self.proposer.taps else None
        if held is None:
            return tokens, self.target.cached_rows(self.slot, len(tokens)), None, 0
        start, features = held
        tokens = tokens[: start + features.shape[0]]
        return tokens, self.target.cached_rows(self.slot, len(tokens)), features, start

    def prepare(self, batch: int = 1) -> None:
        """Decide the next step before any sequence of the batch plans its own: whether to draft
        (the governor, at `batch` sequences) and how deep, and start the drafts, so a remote
        drafter works on this request's while the others' requests are on their way."""
        self.room, self.asked = Room(), False
        if self.prefilling:
            return
        budget = self.output.budget - 1  # the target's own next token always comes on top
        # Hints are known rows like a prompt's: a chunk of them a step, or 16,384 of them would stall
        # every other request for one long forward.
        hints = self.output.hinted(min(budget, self.hint_chunk or self.chunk))
        # Known continuations cost no drafting: they are verified whatever the governor thinks of the drafter;
        # neither does a lookup, so every step may verify one.
        governor = self.governor
        if self.drafting_failed:
            self.room = Room(0, tuple(hints))
            return
        drafting = governor is None or bool(hints) or governor.should_draft(batch)
        limit = budget if drafting else 0
        self.asked = limit > 0 and self.proposer.drafts
        self.room = Room(limit, tuple(hints), self.tree_nodes, budget if self.lookups else 0, self.lookups)
        if limit > 0:
            try:  # drafting starts here for a drafter elsewhere: what it raises fails only this request's drafts
                self.proposer.prefetch(self.prompt + self.output.tokens, limit)
            except Exception:
                self._drafting_failed()

    def _drafting_failed(self) -> None:
        """Drafting touches nothing the target holds, so a bug in it (a drafter's, a lookup's, the
        tree's) need not fail every request in the batch: this one decodes on without drafts or
        lookups (greedy, its output the same; sampled, another draw from the same law), and the
        log has the traceback."""
        log.exception("drafting failed; this request decodes on without drafts")
        self.drafting_failed, self.asked = True, False
        self.room = Room(0, self.room.hints)

    def part(self) -> Part:
        """This sequence's rows for the next forward (after `prepare`)."""
        if self.prefilling:
            tokens = self.prompt[self.prefilled : self.prefilled + self.chunk]
            last = self.prefilled + len(tokens) == len(self.prompt)
            return Part(tokens, None, 1 if last else 0)
        tokens = self.prompt + self.output.tokens
        try:
            self.plan = plan_step(self.target, self.proposer, tokens, self.room, self.sampler, self.governor)
        except Exception:
            self._drafting_failed()
            self.plan = plan_step(self.target, self.proposer, tokens, self.room, self.sampler, self.governor)
        return Part(self.plan.tokens, self.plan.parents, len(self.plan.tokens))

    def take(self, out: ForwardOut) -> None:
        """What the forward computed for this sequence's part."""
        if self.prefilling:
            start = self.prefilled
            rows = min(self.chunk, len(self.prompt) - start)
            self.prefilled += rows
            self.proposer.commit(start, out.features)
            if not self.prefilling:  # the prompt is in: the target's first token
                first = out.choices[0] if self.sampler is None else self.sampler.pick(out.logits[0])
                self.output.commit([first])
                self.stats.ttft_s = time.perf_counter() - self.began
            return
        step = finish_step(self.target, self.proposer, self.plan, out, self.sampler, self.slot)
        before = len(self.output.tokens)
        self.output.commit(step.committed)
        self._count(step.kept(len(self.output.tokens) - before))
        if self.governor is not None:
            for source, found in self.plan.lookups.items():
                self.governor.learn_lookup(found.tokens, step.committed, source, found.chances, found.kind)
            # A step that asked the drafter is a drafting step though nothing came back: recorded as
            # plain, a drafter's 2-s timeout made plain decoding look slow, and drafting that lost
            # ran on for good (an audit).
            self.governor.record(
                step.drafted or self.asked,
                len(step.committed),
                step.propose_s + step.verify_s,
                width=step.drafts + 1,
                draft_s=step.propose_s,
                predicted=step.predicted,
                chain=step.chain,
                timed=out.timed,
            )

    def _count(self, step: Step) -> None:
        stats = self.stats
        stats.steps += 1
        stats.plain_steps += not step.drafts
        stats.drafter_steps += self.asked or step.drafted
        stats.proposed += step.drafts
        stats.accepted += step.accepted
        stats.propose_s += step.propose_s
        stats.verify_s += step.verify_s
        if step.drafts:
            stats.histogram[step.accepted] += 1
            stats.sources[step.source] += 1
            stats.accepted_on_steps[step.source] += step.accepted
            stats.accepted_by_source[step.source] += step.accepted - sum(step.looked_up.values())
            for source, accepted in step.looked_up.items():
                stats.accepted_by_source[source] += accepted
            stats.propose_s_by_source[step.source] += step.propose_s

    def result(self) -> Result:
        stats = self.stats
        if self.prefilling:  # cancelled before its first token
            return Result([], "", "cancelled", stats)
        stats.governor = self.governor.to_dict() if self.governor is not None else {}
        tokens = self.output.tokens
        stats.new_tokens, stats.decode_tokens = len(tokens), max(len(tokens) - 1, 0)
        stats.decode_s = time.perf_counter() - self.began - stats.ttft_s
        return Result(tokens, self.output.text, self.output.finish, stats)


def step(
    target: TargetModel,
    sequences: list[Sequence],
    pace: PrefillPace | None = None,
    waiting: bool = False,
    prepared: bool = False,
) -> None:
    """One forward for all `sequences` (not done), each offering its part; then one head projection
    for every row that needs it, and each sequence takes its share. A `pace` sizes the prompt
    chunks in it to a time budget (else each sequence's own `prefill_chunk`), unless one prompt
    runs alone and no other request is `waiting` to start. `prepared`: each sequence's `prepare`
    ran already (a schedule that starts one group's drafts while another group's forward runs).
    A sequence whose taking of its results raises ends `failed`; the others go on (a bug in one
    request's acceptance failed every request in the batch)."""
    prefilling = [seq for seq in sequences if seq.prefilling]
    hinted = [seq for seq in sequences if not seq.prefilling and seq.output.hinted(1)]
    if pace is not None:  # hints are paced as prompt chunks are
        alone = len(sequences) == 1 and not waiting
        for seq in prefilling + hinted:
            seq.chunk = pace.chunk(len(prefilling) + len(hinted), alone)
    began = time.perf_counter()
    if not prepared:
        for seq in sequences:
            seq.prepare(len(sequences))
    parts = [seq.part() for seq in sequences]
    _share_draft_time(sequences, time.perf_counter() - began)
    prompt_rows = sum(len(p.tokens) for seq, p in zip(sequences, parts, strict=True) if seq.prefilling)
    prompt_rows += sum(len(seq.room.hints) for seq in hinted)  # known rows, timed for the pace alike
    taps = tuple(dict.fromkeys(t for seq in sequences for t in seq.proposer.taps))
    began = time.perf_counter()
    outs = target.forward_batch(
        [(seq.slot, p.tokens, p.parents) for seq, p in zip(sequences, parts, strict=True)], taps
    )
    heads = [hidden[len(hidden) - p.head_rows :] for (hidden, _), p in zip(outs, parts, strict=True)]
    rows = torch.cat(heads) if heads else None
    sampled = any(seq.sampler is not None for seq in sequences)
    logits = target.logits(rows) if sampled and rows is not None and rows.shape[0] else None
    if logits is not None:
        choices = dflash_kernels.argmax(logits).tolist()
    else:
        choices = target.greedy(rows) if rows is not None and rows.shape[0] else []
    forward_s = time.perf_counter() - began
    width = sum(len(p.tokens) for p in parts)
    if pace is not None:
        pace.record(width, prompt_rows, forward_s)
    if not prefilling:
        _measured(sequences, width, forward_s)
    at = 0
    for seq, part, (_, features) in zip(sequences, parts, outs, strict=True):
        end = at + part.head_rows
        mine = None if features is None else _select(features, taps, seq.proposer.taps, target.hidden_size)
        try:
            picked = None if logits is None else logits[at:end]
            # Timed only where the forward was this step's alone: another request's prompt or hint chunk is not.
            timed = not prefilling and all(other is seq for other in hinted)
            seq.take(ForwardOut(mine, choices[at:end], picked, forward_s, timed=timed))
        except Exception as exc:  # its slot alone is in doubt: the others take their rows as if it were not there
            log.exception("a request failed taking its step's results")
            seq.failed = exc
        at = end


def _measured(sequences: list[Sequence], width: int, seconds: float) -> None:
    """A decode forward: what its width costs, once per table (a daemon's requests share one)."""
    governors = [seq.governor for seq in sequences if seq.governor is not None]
    for governor in {id(governor.costs): governor for governor in governors}.values():
        governor.measured(width, seconds)


def _share_draft_time(sequences: list[Sequence], seconds: float) -> None:
    """Give every drafting sequence an even share of the time the step spent drafting. A batch's
    drafts are one pass (local, or the draft daemon's burst): the first sequence to ask waits for
    all of them and the rest for none, so each one's own wait would tell its governor that
    drafting costs it the whole pass or nothing."""
    drafting = [seq for seq in sequences if not seq.prefilling and seq.plan.proposal is not EMPTY]
    for seq in drafting:
        seq.plan = replace(seq.plan, propose_s=seconds / len(drafting))


def _select(features: torch.Tensor, have: tuple[int, ...], want: tuple[int, ...], width: int) -> torch.Tensor | None:
    """The columns of `want` taps out of features tapped at `have`."""
    if not want:
        return None
    if want == have:
        return features
    return torch.cat([features[:, have.index(t) * width : (have.index(t) + 1) * width] for t in want], -1)


def generate(
    target: TargetModel,
    prompt: list[int],
    proposer: Proposer,
    options: DecodeOptions,
    *,
    on_commit: OnCommit | None = None,
    cancel: threading.Event | None = None,
    governor: Governor | None = None,
    on_prefill: Callable[[], None] | None = None,
) -> Result:
    """Decode one request alone, in slot 0 (see Sequence). `on_prefill` runs between prefill
    chunks (a daemon serves its socket there); `cancel` is checked between forwards."""
    seq = Sequence(target, prompt, proposer, options, on_commit=on_commit, governor=governor)
    while not seq.done:
        if seq.prefilling and seq.prefilled and on_prefill is not None:
            on_prefill()
        if cancel is not None and cancel.is_set():
            seq.cancel()
            break
        step(target, [seq])
    if seq.failed is not None:
        raise seq.failed
    return seq.result()
