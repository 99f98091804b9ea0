"""A target daemon's served requests recorded as drafter training data (`--record DIR`), in the
answer store's format, so `dflash-train --data DIR` learns the distribution users actually send."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from answers.store import Answer, AnswerStore, write_shard
from protocol import Message
from protocol.sampling import SamplingParams

if TYPE_CHECKING:  # the daemon checks --record before torch loads
    from target_node.decoding.sequence import Result

log = logging.getLogger("traffic")

FLUSH_EVERY_S = 10.0  # recorded answers are written out at least this often, and when the daemon stops
SHARD_RECORDS = 256  # answers a shard holds: each write rewrites the open one
PRESET = 3  # xz's: a shard of 256 answers in 75 ms where the committed store's 9e takes 344, 10% larger
# Tokens of shards the disk refused that are held to write again (~40 bytes each in memory): past
# it, the oldest are dropped (a long outage grew the daemon's memory without a bound: an audit).
MAX_HELD_TOKENS = 2_000_000


class TrafficError(ValueError):
    """A record folder this daemon cannot write."""


def record_folder(folder: str) -> Path:
    """`folder`, made if need be the operator's alone (0700: it holds users' prompts), or
    TrafficError where this process cannot write there: asked before the model loads too. A
    folder that exists keeps its mode, with a warning where others may read it: made 0700, a
    `--record .` or `--record ~` locked others out of it, even on a run that then failed (an audit)."""
    path = Path(folder)
    try:
        if not path.is_dir():
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        elif path.stat().st_mode & 0o077:
            log.warning("--record %s: others may read this folder and the prompts recorded in it (chmod 700)", folder)
        probe = path / ".writable"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise TrafficError(f"--record {folder}: cannot write there ({exc})") from None
    return path


class TrafficRecorder:
    """Record served greedy requests (prompt and answer token ids, and the chat messages) as drafter
    training data in the answer-store format, so `launch.train --data FOLDER` learns from them.

    Written out FLUSH_EVERY_S after the last write (`tick`, between the daemon's steps) and at
    `close`, not after each request, on a thread of its own (xz lets go of the interpreter while it
    compresses), one write at a time: rewriting the open shard on the serving thread stalled every
    request, after each one for 44-136 ms, then every 10 s for up to 15 s with long chats (two
    audits). The folder is the operator's alone (0700): it
    holds users' prompts. Sampled answers are not the target's own greedy answers, which training
    and the datastore read: they are not recorded."""

    def __init__(self, folder: str, model_name: str, made_by: str = "") -> None:
        """`made_by`: the target's numerics (TargetModel.numerics), which each answer records."""
        path = record_folder(folder)
        self.model_name, self.made_by = model_name, made_by
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder")
        self.writing: Future | None = None  # the last write handed to the writer (they run in order)
        self.failed: dict[Path, list[Answer]] = {}  # shards whose last write failed: tried again
        self.store = AnswerStore(path, shard_records=SHARD_RECORDS, remember=False, write=self.write_later)
        self.unwritten, self.written_at = 0, time.monotonic()

    def __call__(self, msg: Message, prompt: list[int], result: Result) -> None:
        if not SamplingParams.from_dict(msg["sampling"]).is_greedy:
            return
        messages = [[m["role"], m["content"]] for m in msg["messages"]]
        if not messages and msg["prompt"]:
            messages = [["user", msg["prompt"]]]
        tokens = prompt + result.tokens
        key = hashlib.sha1(json.dumps([messages, tokens]).encode()).hexdigest()[:20]
        answer = Answer(key, f"traffic-{key}", "traffic", messages, tokens, len(prompt), result.finish_reason)
        self.unwritten += self.store.add(
            replace(answer, model=self.model_name, made_by=self.made_by), flush_every_s=float("inf")
        )
        self.tick()

    def write_later(self, shard: Path, answers: list[Answer]) -> None:
        self.writing = self.writer.submit(self._write, shard, answers)

    def _write(self, shard: Path, answers: list[Answer]) -> None:
        """On the writer thread. A shard whose write fails is written again at the next tick: one
        failed write as a shard filled lost its 256 answers for good (a review)."""
        try:
            # A folder removed meanwhile is made again the operator's alone (it was made 0755: an audit).
            shard.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_shard(shard, answers, preset=PRESET)
        except Exception as exc:  # a full disk: the daemon serves on
            log.error("could not write the recorded requests out (tried again in %g s): %s", FLUSH_EVERY_S, exc)
            self.failed[shard] = answers
            self._drop_oldest_failed()
        else:
            self.failed.pop(shard, None)

    def _drop_oldest_failed(self) -> None:
        held = sum(len(a.tokens) for answers in self.failed.values() for a in answers)
        for shard in [shard for shard in self.failed if shard != self.store.current_shard]:  # oldest first
            if held <= MAX_HELD_TOKENS:
                break
            dropped = self.failed.pop(shard)
            held -= sum(len(a.tokens) for a in dropped)
            log.error("dropped %d recorded requests the disk would not take (%s)", len(dropped), shard.name)

    def tick(self) -> None:
        """Write out what is recorded where FLUSH_EVERY_S have passed since the last write (the
        daemon calls it between steps, so a quiet daemon writes its last requests out too), unless
        the last write still runs (a shard's writes would queue up behind a slow disk)."""
        if (self.unwritten or self.failed) and time.monotonic() - self.written_at >= FLUSH_EVERY_S:
            if self.writing is None or self.writing.done():
                self.flush()

    def flush(self) -> None:
        for shard, answers in dict(self.failed).items():
            if shard != self.store.current_shard:  # the open one is written below, whole
                self.write_later(shard, answers)
        self.store.flush()
        self.unwritten, self.written_at = 0, time.monotonic()

    def close(self) -> None:
        """Write out what is recorded, wait for the writes (the daemon stops after) and end the
        writer's thread."""
        self.writer.submit(lambda: None).result()  # what failed is known once the writes queued are done
        if self.unwritten or self.failed:
            self.flush()
        self.writer.shutdown(wait=True)
