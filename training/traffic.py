"""A target daemon's served requests recorded as drafter training data (`--record DIR`), in the
answer store's format, so `dflash-train --data DIR` learns the distribution users actually send."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from functools import partial
from pathlib import Path

from protocol import Message
from protocol.sampling import SamplingParams
from target_node.decoding.sequence import Result
from training.answer_store import Answer, AnswerStore, write_shard

log = logging.getLogger("traffic")

FLUSH_EVERY_S = 10.0  # recorded answers are written out at least this often, and when the daemon stops
PRESET = 3  # xz's: a shard of 256 answers in 75 ms where the committed store's 9e takes 344, 10% larger


class TrafficError(ValueError):
    """A record folder this daemon cannot write."""


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

    def __init__(self, folder: str, model_name: str) -> None:
        path = Path(folder)
        try:
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o700)
            probe = path / ".writable"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise TrafficError(f"--record {folder}: cannot write there ({exc})") from None
        self.model_name = model_name
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder")
        self.writing: Future | None = None  # the last write handed to the writer (they run in order)
        self.store = AnswerStore(path, shard_records=256, remember=False, write=self.write_later)
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
        self.unwritten += self.store.add(replace(answer, model=self.model_name), flush_every_s=float("inf"))
        self.tick()

    def write_later(self, shard: Path, answers: list[Answer]) -> None:
        self.writing = self.writer.submit(partial(write_shard, preset=PRESET), shard, answers)
        self.writing.add_done_callback(_log_failure)

    def tick(self) -> None:
        """Write out what is recorded where FLUSH_EVERY_S have passed since the last write (the
        daemon calls it between steps, so a quiet daemon writes its last requests out too), unless
        the last write still runs (a shard's writes would queue up behind a slow disk)."""
        if self.unwritten and time.monotonic() - self.written_at >= FLUSH_EVERY_S:
            if self.writing is None or self.writing.done():
                self.flush()

    def flush(self) -> None:
        self.store.flush()
        self.unwritten, self.written_at = 0, time.monotonic()

    def close(self) -> None:
        """Write out what is recorded and wait for the writes (the daemon stops after)."""
        if self.unwritten:
            self.flush()
        if self.writing is not None:
            wait([self.writing])


def _log_failure(write: Future) -> None:
    if write.exception() is not None:  # a full disk: the daemon serves on, the answers are lost
        log.error("could not write the recorded requests out: %s", write.exception())
