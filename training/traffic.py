"""A target daemon's served requests recorded as drafter training data (`--record DIR`), in the
answer store's format, so `dflash-train --data DIR` learns the distribution users actually send."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

from protocol import Message
from protocol.sampling import SamplingParams
from target_node.decoding.sequence import Result
from training.answer_store import Answer, AnswerStore

FLUSH_EVERY_S = 10.0  # recorded answers are written out at least this often, and when the daemon stops


class TrafficError(ValueError):
    """A record folder this daemon cannot write."""


class TrafficRecorder:
    """Record served greedy requests (prompt and answer token ids, and the chat messages) as drafter
    training data in the answer-store format, so `launch.train --data FOLDER` learns from them.

    Written out FLUSH_EVERY_S after the last write (`tick`, between the daemon's steps) and at
    `close`, not after each request: rewriting the open
    shard (xz, its strongest preset) after each one stalled the serving loop for 44-136 ms a
    request, and seconds for long chats (an audit). The folder is the operator's alone (0700): it
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
        self.store = AnswerStore(path, shard_records=256, remember=False)
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

    def tick(self) -> None:
        """Write out what is recorded where FLUSH_EVERY_S have passed since the last write (the
        daemon calls it between steps, so a quiet daemon writes its last requests out too)."""
        if self.unwritten and time.monotonic() - self.written_at >= FLUSH_EVERY_S:
            self.close()

    def close(self) -> None:
        if self.unwritten:
            self.store.flush()
        self.unwritten, self.written_at = 0, time.monotonic()
