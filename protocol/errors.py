"""Error vocabulary shared by both peers.

Codes are plain lowercase strings on the wire so a peer in any language can
switch on them; the Python side keeps them as an Enum so typos fail early.
"""

from __future__ import annotations

import reprlib
from enum import Enum


class ErrorCode(str, Enum):  # noqa: UP042 (StrEnum would change how a code formats in messages)
    BAD_VERSION = "bad_version"
    MALFORMED = "malformed"
    UNKNOWN_TYPE = "unknown_type"
    BAD_FIELD = "bad_field"
    BAD_TENSOR = "bad_tensor"
    TOO_LARGE = "too_large"
    UNKNOWN_SESSION = "unknown_session"
    OUT_OF_ORDER = "out_of_order"
    CONFIG_MISMATCH = "config_mismatch"
    CONTEXT_LENGTH = "context_length"  # prompt + max_new_tokens beyond what the model can hold
    BUSY = "busy"  # a queue limit: try again later
    UNKNOWN_REQUEST = "unknown_request"  # a heartbeat for a request the target daemon does not hold
    INTERNAL = "internal"


class ProtocolError(Exception):
    """The only exception type the codec lets escape.

    `request_id` is the id of the offending message when it could be read, so
    a server can still address its error reply; `remote` is True when the
    error arrived from the peer as an `error` message rather than being
    detected locally.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        request_id: int | None = None,
        remote: bool = False,
    ) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        self.remote = remote
        # Who sent the request that could not be decoded, named as a Message's `peer` (a server's
        # transport sets it): its replies keep their order across the error's.
        self.peer: str | None = None


# A peer's value may nest as deep as msgpack allows (1024), past what repr() can recurse:
# this one stops at a few levels and a few items, so the error path cannot fail.
_SHORT = reprlib.Repr()
_SHORT.maxlevel = 3
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 60


def describe(value: object, limit: int = 60) -> str:
    """Short `type value` rendering for error messages; never huge, never deep."""
    text = _SHORT.repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(value).__name__} {text}"
