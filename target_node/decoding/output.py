"""Where committed tokens go: the budget, EOS, stop strings, hints and the text stream.

The speculative loop only says "these tokens were committed"; the output decides how many
of them the request keeps and whether generation is over, and streams text that never
runs past a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

OnCommit = Callable[[list[int], str], None]


# Prompt tokens the answer's text is decoded after: a SentencePiece decoder strips the leading
# space of what it decodes, so the answer decoded alone lost the space its first token carries.
CONTEXT_TOKENS = 5
# Tokens a character may take to complete before its bytes are shown as they decode (U+FFFD):
# UTF-8 needs at most 4; a model writing invalid bytes must not grow the decoded window forever.
MOST_UNSETTLED = 16


class TextStream:
    """The answer's text, built token by token as an incremental detokenizer does (vLLM's
    scheme): each token's text is what decoding a short window of the tokens before it and it
    adds to decoding the window without it, held back while it ends in an unfinished character.

    So the text only ever grows, the stream is its exact prefix, and a stop string is looked for
    after each token, as plain decoding commits them: where a stop string ends never depends on
    how many tokens a step commits. Decoding the whole answer again did not give that: a step's
    text could end in the U+FFFD of a half-decoded character that a stop matched, and byte-fallback
    decoders turn complete characters back into U+FFFD when an unfinished one follows (an audit).
    """

    def __init__(
        self, tokenizer, stop_strings: tuple[str, ...] = (), context: list[int] | tuple[int, ...] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.ids, self.prefix_text = self._context(list(context)) if tokenizer is not None else ([], "")
        self.prefix_offset, self.read_offset = 0, len(self.ids)  # the window: ids[prefix_offset:]
        self.unfinished_since: int | None = None  # where the window began to end in an unfinished character
        self.text = ""  # settled text of the answer so far (ends at a stop string's start once stopped)
        self.sent = 0  # characters of it already handed out
        self.stopped = False

    def _context(self, prompt: list[int]) -> tuple[list[int], str]:
        """The prompt's last tokens to decode the answer after, and their text: at least
        CONTEXT_TOKENS, reaching back past a character their start would cut (a byte-fallback
        decoder shows the whole run as U+FFFD then, the review of this scheme found); none where
        the prompt itself ends inside a character."""
        for length in range(CONTEXT_TOKENS, CONTEXT_TOKENS + MOST_UNSETTLED):
            tail = prompt[-length:]
            text = self._decode(tail)
            if not text.endswith("\ufffd"):
                return tail, text
            if length >= len(prompt):
                break
        return [], ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None and ids else ""

    def _settle(self, force: bool = False) -> None:
        """Add the text of the tokens past the read offset, unless it ends in an unfinished
        character (or `force`: the answer ended, or too many tokens wait)."""
        window = self._decode(self.ids[self.prefix_offset :])
        if not window.endswith("\ufffd"):
            self.unfinished_since = None
        elif self.unfinished_since is None:
            self.unfinished_since = len(self.ids) - 1
        if not force:
            if self.unfinished_since is not None:  # a character in the making, up to MOST_UNSETTLED tokens
                if len(self.ids) - self.unfinished_since < MOST_UNSETTLED:
                    return
            elif len(window) <= len(self.prefix_text) and len(self.ids) - self.read_offset < MOST_UNSETTLED:
                return  # tokens without text yet (special ones): held, as a few, so the window stays short
        self.unfinished_since = None
        if window.startswith(self.prefix_text):
            added = window[len(self.prefix_text) :]
        else:  # a decoder that rewrote the window's start (byte fallback): the new tokens alone
            added = self._decode(self.ids[self.read_offset :])
        self.text += added
        self.prefix_text = self._decode(self.ids[self.read_offset :])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _stop_in(self, since: int) -> int:
        """Where the first stop string starts in the text, looking from `since` on; -1: none."""
        found = [i for s in self.stop_strings if (i := self.text.find(s, since)) >= 0]
        return min(found, default=-1)

    def push(self, tokens: list[int], final: bool = False) -> tuple[int, str]:
        """Add committed tokens, one at a time; returns how many of them the answer keeps (fewer
        when a stop string completes: up to the token that completed it) and the new text that is
        safe to show. `final`: the answer ends with them, so nothing is held back."""
        longest = max(map(len, self.stop_strings), default=0)
        kept = len(tokens)
        if self.tokenizer is None:
            return kept, ""
        for i, token in enumerate(tokens):
            before = len(self.text)
            self.ids.append(token)
            self._settle()
            if self.stop_strings and len(self.text) > before and self._cut(max(0, before - longest + 1)):
                kept = i + 1
                break
        if final and not self.stopped:
            before = len(self.text)
            self._settle(force=True)
            if self.stop_strings:
                self._cut(max(0, before - longest + 1))
        return kept, self._safe_delta(final or self.stopped)

    def _cut(self, since: int) -> bool:
        """End the text at the first stop string from `since` on, if any."""
        cut = self._stop_in(since)
        if cut < 0:
            return False
        self.text, self.stopped = self.text[:cut], True
        return True

    def _safe_delta(self, final: bool) -> str:
        """The text not yet handed out, less a tail that may still grow into a stop string."""
        text, safe = self.text, len(self.text)
        if not final:
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
        context: Sequence[int] = (),
    ) -> None:
        """`context`: the prompt, whose last tokens the answer's text is decoded after."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        self.max_new_tokens, self.eos_ids, self.on_commit = max_new_tokens, eos_ids, on_commit
        self.stream = TextStream(tokenizer, stop_strings, context)
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
        keep, text = self.stream.push(new, final=done)
        new = new[:keep]
        if self.stream.stopped:
            self.finish, done = "stop", True
        if self.hints and self.hinted(len(new)) != new:
            self.hints = []  # the output left the hinted path: later hints no longer line up
        self.tokens.extend(new)
        if self.on_commit is not None and (new or text):
            self.on_commit(new, text)
        self.done = done
        return done

    @property
    def text(self) -> str:
        return self.stream.text
