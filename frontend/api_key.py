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
        self.app, self.expected = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED_PREFIX):
            given = Headers(scope=scope).get("authorization", "")
            # The scheme's name is case-insensitive, and one or more spaces follow it (RFC 9110
            # 11.4): `bearer KEY` got 401 (an audit).
            scheme, _, token = given.partition(" ")
            right = hmac.compare_digest(token.lstrip(" ").encode("latin-1"), self.expected)
            if not (right and scheme.lower() == "bearer"):
                await unauthorized(bool(given)).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
