"""Where committed tokens go: the budget, EOS, stop strings, hints and the text stream.

The speculative loop only says "these tokens were committed"; the output decides how many
of them the request keeps and whether generation is over, and streams text that never
runs past a stop string.
"""

from __future__ import annotations

from collections.abc import Callable

OnCommit = Callable[[list[int], str], None]


class TextStream:
    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tokens: list[int] = []
        self.sent = 0  # characters of text already handed out
        self.text = ""
        self.stopped = False
        self.decoded: tuple[tuple[int, tuple[int, ...]], str] = ((0, ()), "")  # the last _text_with

    def _text_with(self, more: list[int]) -> str:
        """The text of the tokens so far plus `more`, decoded whole (so it is exactly what decoding
        the answer gives), and kept for the next call: a step's stop check and its push ask for the
        same tokens, and pay one decode."""
        key = (len(self.tokens), tuple(more))
        if self.decoded[0] != key:
            text = (
                self.tokenizer.decode(self.tokens + more, skip_special_tokens=True)
                if self.tokenizer is not None
                else ""
            )
            self.decoded = (key, text)
        return self.decoded[1]

    def stop_token_count(self, tokens: list[int]) -> int | None:
        """If adding `tokens` completes a stop string, how many of them to keep; else None.

        One decode where none completes (every step but the last); else a bisection for the first
        token whose text holds a stop string. Trying each count in turn cost a decode of the whole
        answer per token: a step that verified 512 hints of a request with a stop string decoded a
        4,000-token answer 512 times, on the thread every request shares."""
        if not self.stop_strings:
            return None

        def stops(count: int) -> bool:
            text = self._text_with(tokens[:count])
            return any(s in text for s in self.stop_strings)

        if not tokens or not stops(len(tokens)):
            return None
        shown, holds = 0, len(tokens)  # the text so far holds no stop string (it would have ended)
        while holds - shown > 1:
            middle = (shown + holds) // 2
            shown, holds = (shown, middle) if stops(middle) else (middle, holds)
        return holds

    def push(self, tokens: list[int], final: bool = False) -> str:
        """Add committed tokens; return the new text that is safe to show."""
        text = self._text_with(tokens)
        self.tokens.extend(tokens)
        cut = min((text.find(s) for s in self.stop_strings if s in text), default=-1)
        if cut >= 0:
            text, final, self.stopped = text[:cut], True, True
        self.text = text
        safe = len(text)
        if not final:
            # Hold back a trailing partial character and anything that may grow into a stop string.
            while safe and text[safe - 1] == "\ufffd":
                safe -= 1
            for s in self.stop_strings:
                for k in range(min(len(s) - 1, safe), 0, -1):
                    if text[safe - k : safe] == s[:k]:
                        safe -= k
                        break
        safe = max(safe, self.sent)
        delta, self.sent = text[self.sent : safe], safe
        return delta


class Output:
    """One request's output: what is kept of each commit, and when to stop."""

    def __init__(
        self,
        tokenizer,  # a transformers tokenizer, or None for token-id requests
        max_new_tokens: int,
        eos_ids: frozenset[int] = frozenset(),
        stop_strings: tuple[str, ...] = (),
        hints: list[int] | None = None,
        on_commit: OnCommit | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        self.max_new_tokens, self.eos_ids, self.on_commit = max_new_tokens, eos_ids, on_commit
        self.stream = TextStream(tokenizer, stop_strings)
        self.hints = list(hints or [])
        self.tokens: list[int] = []
        self.finish = "length"
        self.done = False

    @property
    def budget(self) -> int:
        """Tokens a step may still commit."""
        return self.max_new_tokens - len(self.tokens)

    def hinted(self, count: int) -> list[int]:
        """The next `count` hinted tokens (known continuations to verify), if the output still follows them."""
        return self.hints[len(self.tokens) : len(self.tokens) + count]

    def commit(self, new: list[int]) -> bool:
        """Keep what the request allows of `new` (cut at the budget, EOS or a stop string); True when done."""
        new = new[: self.budget]
        done = len(self.tokens) + len(new) >= self.max_new_tokens
        for i, tok in enumerate(new):
            if tok in self.eos_ids:
                new, done, self.finish = new[: i + 1], True, "eos"
                break
        keep = self.stream.stop_token_count(new)
        if keep is not None:
            new, done, self.finish = new[:keep], True, "stop"
        if self.hints and self.hinted(len(new)) != new:
            self.hints = []  # the output left the hinted path: later hints no longer line up
        self.tokens.extend(new)
        text = self.stream.push(new, final=done)
        if self.on_commit is not None and (new or text):
            self.on_commit(new, text)
        if self.stream.stopped:
            self.finish, done = "stop", True
        self.done = done
        return done

    @property
    def text(self) -> str:
        return self.stream.text
