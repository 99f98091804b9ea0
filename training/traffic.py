"""A target daemon's served requests recorded as drafter training data (`--record DIR`), in the
answer store's format, so `dflash-train --data DIR` learns the distribution users actually send."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from protocol import Message
from target_node.decoding.sequence import Result
from training.answer_store import Answer, AnswerStore


def traffic_recorder(folder: str, model_name: str) -> Callable[[Message, list[int], Result], None]:
    """Record every served request (prompt and answer token ids, and the chat messages) as drafter
    training data in the answer-store format, so `launch.train --data FOLDER` can learn from it."""
    store = AnswerStore(Path(folder), shard_records=256)  # small shards: each answer is written out at once

    def record(msg: Message, prompt: list[int], result: Result) -> None:
        messages = [[m["role"], m["content"]] for m in msg["messages"]]
        if not messages and msg["prompt"]:
            messages = [["user", msg["prompt"]]]
        tokens = prompt + result.tokens
        key = hashlib.sha1(json.dumps([messages, tokens]).encode()).hexdigest()[:20]
        finish = result.finish_reason
        store.add(Answer(key, f"traffic-{key}", "traffic", messages, tokens, len(prompt), finish, "", model_name))
        store.flush()

    return record
