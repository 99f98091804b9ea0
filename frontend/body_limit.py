"""The request body's size limit (`dflash-serve --max-body-size`): a body over it gets 413.

A Content-Length over the limit is refused before a byte of the body is read; a body without
one (chunked) is read until it passes the limit and refused then. Either way a refused request
costs the front end about the limit in memory at most, however large its body. A body within the
limit reaches the routes whole, as they would have read it anyway (one JSON document).

Only the routes that read a body are buffered (the others never read one), and a body must arrive
whole within `deadline_s`: a client that sent all but the last byte of 8 MiB and waited used to
hold them for as long as it kept the connection, on any path, past the API key (an audit).

The bodies arriving at once share `budget` bytes (at least one whole body): 40 clients that each
sent 8 MiB less a byte held 400 MiB of the front end for the deadline, and as many clients as
connections would have held 8 GiB (an audit). A body whose bytes so far would pass the budget
gets 429. Only bytes received count: eight clients that declared 8 MiB and sent nothing shut out
every other body (a review).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.errors import bodies_over_budget, body_too_slow, too_large
from frontend.settings import MAX_BODY_BYTES

# MAX_BODY_BYTES (8 MiB) arrive within it at 140 KB/s.
BODY_DEADLINE_S = 60.0
# Bytes of the bodies arriving at once: bounded memory, where stalled bodies that fill it refuse
# others until their deadline (64 MiB took eight stalled 8 MiB bodies: a review); 512 MiB takes
# 64, that is 512 MiB sent every minute.
BODIES_BUDGET = 512 << 20


class BodyLimit:
    """ASGI middleware: refuse a request whose body is over `limit` bytes, reading no more than one
    chunk past it, or slower than `deadline_s`; on `paths` (None: every path)."""

    def __init__(
        self,
        app: ASGIApp,
        limit: int = MAX_BODY_BYTES,
        paths: Collection[str] | None = None,
        deadline_s: float = BODY_DEADLINE_S,
        budget: int = BODIES_BUDGET,
    ) -> None:
        self.app, self.limit, self.paths, self.deadline_s = app, limit, paths, deadline_s
        self.budget, self.buffered = max(budget, limit), 0  # one event loop: no lock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self.paths is not None and _route_path(scope) not in self.paths):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await too_large(self.limit, int(declared)).response()(scope, receive, send)
            return
        chunks, size = [], 0  # this body's bytes so far: its share of the budget
        try:
            deadline = time.monotonic() + self.deadline_s
            while True:
                try:
                    message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
                except TimeoutError:
                    await body_too_slow(self.deadline_s).response()(scope, receive, send)
                    return
                if message["type"] != "http.request":  # the client left: the routes hear it
                    break
                chunk = message.get("body", b"")
                if size + len(chunk) > self.limit:
                    await too_large(self.limit).response()(scope, receive, send)
                    return
                if self.buffered + len(chunk) > self.budget:
                    await bodies_over_budget(self.budget).response()(scope, receive, send)
                    return
                chunks.append(chunk)
                size, self.buffered = size + len(chunk), self.buffered + len(chunk)
                if not message.get("more_body", False):
                    message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                    break
        finally:
            self.buffered -= size
            del chunks
        await self.app(scope, _replay(message, receive), send)


def _route_path(scope: Scope) -> str:
    """The path the routes match: behind a `root_path` (a proxy's prefix) the server's path holds it too."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _replay(first: Message, receive: Receive) -> Receive:
    """`receive` that answers `first` once, then passes on to the server's (disconnects, ...)."""
    pending = [first]

    async def again() -> Message:
        return pending.pop() if pending else await receive()

    return again
