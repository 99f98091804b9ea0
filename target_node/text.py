"""Turn committed tokens into streamed text that never runs past a stop string."""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()) -> None:  # noqa: ANN001
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tokens: list[int] = []
        self.sent = 0  # characters of text already handed out
        self.text = ""
        self.stopped = False

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""

    def stop_token_count(self, tokens: list[int]) -> int | None:
        """If adding `tokens` completes a stop string, how many of them to keep; else None."""
        if not self.stop_strings:
            return None
        for i in range(1, len(tokens) + 1):
            text = self._decode(self.tokens + tokens[:i])
            if any(s in text for s in self.stop_strings):
                return i
        return None

    def push(self, tokens: list[int], final: bool = False) -> str:
        """Add committed tokens; return the new text that is safe to show."""
        self.tokens.extend(tokens)
        text = self._decode(self.tokens)
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
