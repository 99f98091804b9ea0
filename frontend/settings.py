"""What the front end answers with, as one object from dflash-serve's flags to `create_app`."""

from __future__ import annotations

from dataclasses import dataclass

# The target daemon takes a request of up to a 1 MiB header (512 Ki chars of text, 1024 messages,
# 65,536 token ids within it); as JSON, characters escaped as \uXXXX make that at most about 6 MiB.
MAX_BODY_BYTES = 8 << 20


@dataclass(frozen=True)
class FrontendSettings:
    model_name: str | None = None  # the id clients name (None: the daemon's model folder's, asked when needed)
    default_max_tokens: int = 512  # a chat answer's limit when the request gives none
    max_body_size: int = MAX_BODY_BYTES  # larger request bodies get 413
    api_key: str | None = None  # /v1 requests without it get 401 (None: open)
    # The Host names requests may give beside loopback ones (None: any name, as a server reached from
    # other hosts by names it cannot know): a loopback server answers no web page's own name (hosts.py).
    allowed_hosts: frozenset[str] | None = None


DEFAULTS = FrontendSettings()  # dflash-serve's flags' defaults
