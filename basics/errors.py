"""An error's message as one line a person reads."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """The start of an error's message on one line: transformers' and torch's can run to a page."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines()[:2])
    return (text or type(exc).__name__)[:300]
