"""The API key (`dflash-serve --api-key`): /v1 answers only requests that carry it.

As OpenAI's API and vLLM's server do it: `Authorization: Bearer KEY` on every /v1 request, a
wrong or missing key 401 with `invalid_api_key`. /health, /metrics, /stats and the page stay
open, for probes and scrapers (they show counts, never a prompt or an answer). The key is
compared in constant time, so timing tells a guesser nothing of how close a guess came.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend.errors import unauthorized

GUARDED_PREFIX = "/v1/"


class ApiKey:
    """ASGI middleware: a /v1 request without `Authorization: Bearer <key>` gets 401, unread."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        if not key:
            raise ValueError("an API key must not be empty")
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED_PREFIX):
            given = Headers(scope=scope).get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, self.expected):
                await unauthorized(bool(given)).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
