"""OpenAI response bodies and stream chunks, built from the target daemon's replies.

The shapes are exactly OpenAI's (`chat.completion`, `chat.completion.chunk`,
`text_completion`), so clients parse them with their own types. Text is passed through
as the daemon produced it: the front end never alters what the model said.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi.sse import format_sse_event

from protocol.stats import RequestStats

# The daemon's finish reasons as OpenAI's. `cancelled` only happens to a client that left.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
DONE_EVENT = format_sse_event(data_str="[DONE]")


def finish_reason(daemon_reason: str) -> str:
    return FINISH_REASONS.get(daemon_reason, "stop")


def usage(stats: dict) -> dict:
    """Token counts from a `done` reply's stats; the prompt tokens the prefix cache gave, as OpenAI
    reports its own prompt caching."""
    figures = RequestStats.from_dict(stats)
    prompt, completion = int(figures.prompt_tokens), int(figures.new_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(figures.cached_tokens)},
    }


# Characters str.splitlines() ends a line at that JSON leaves raw (it escapes those below U+0020):
# httpx's iter_lines splits so, and a client reading a stream's lines over it got a chunk's `data:`
# line cut in two where the model wrote one (an audit). Their JSON escapes are the same text.
LINE_ENDS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse(body: dict) -> bytes:
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).translate(LINE_ENDS)
    return format_sse_event(data_str=data)


class Answer:
    """One answer's identity (id, time, model) and the OpenAI shapes it is sent in."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def _envelope(self, obj: str, choices: list) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def complete(self, text: str, daemon_reason: str, stats: dict) -> dict:
        """The whole answer at once (`stream: false`)."""
        reason = finish_reason(daemon_reason)
        if self.chat:
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
            body = self._envelope("chat.completion", [choice])
        else:
            body = self._envelope(
                "text_completion", [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}]
            )
        body["usage"] = usage(stats)
        return body

    def chunk(self, text: str | None = None, daemon_reason: str | None = None, first: bool = False) -> dict:
        """A stream chunk: the role announcement (chat, `first`), new text, or the finish reason."""
        reason = finish_reason(daemon_reason) if daemon_reason is not None else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"text": text or "", "index": 0, "logprobs": None, "finish_reason": reason}
            body = self._envelope("text_completion", [choice])
        if self.include_usage:
            body["usage"] = None  # OpenAI's chunks carry a null usage until the last one
        return body

    def usage_chunk(self, stats: dict) -> dict:
        """The extra last chunk `stream_options.include_usage` asks for: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(stats)
        return body
