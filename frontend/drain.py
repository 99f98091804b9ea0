"""When a server that shuts down ends the answers it still serves.

uvicorn gives open connections a grace period, then cancels their tasks: a stream cut that way
ended mid-body, with no error event and no `[DONE]`, and Python's http.client took the half
answer for a whole one (an audit). The answers still running about a second before the grace
ends stop instead, with a 503 `server_shutting_down` (an error event then `[DONE]` in a stream),
sent before their requests are cancelled in the daemon, whose confirmation may take its time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MIN_GRACE_S = 1.0  # what leaves the drain room before uvicorn's cut (--shutdown-grace's least)


class Drain:
    def __init__(self, since: Callable[[], float | None] = lambda: None, grace_s: float = 5.0) -> None:
        """`since`: when the server's shutdown began (time.monotonic), None while it serves;
        `grace_s`: what uvicorn gives a connection after that (its timeout_graceful_shutdown)."""
        self.since, self.grace_s = since, grace_s
        # Ahead of uvicorn's cut by more than a reply wait (WAIT_SLICE_S) and the error's send.
        self.ahead_s = min(1.0, grace_s / 2)

    def due(self) -> bool:
        """Whether the answers still running end now: asked by each at least every WAIT_SLICE_S."""
        since = self.since()
        return since is not None and time.monotonic() >= since + self.grace_s - self.ahead_s

    def cancel_wait_s(self) -> float:
        """How long an answer the drain ended waits for the daemon to confirm its cancel: half the
        time left before uvicorn's cut. A hung daemon's wait, --daemon-timeout, outlasted the cut:
        the stream was cut after its error event, and the wait's thread held the server's exit
        for seconds more (an audit)."""
        since = self.since()
        left = self.grace_s if since is None else since + self.grace_s - time.monotonic()
        return max(0.0, left / 2)

    async def cut(self) -> bool:
        """`due`, in the shape LinkCall.next's `gone` takes."""
        return self.due()


NO_DRAIN = Drain()  # for an app whose server never stops: it holds no state, so one serves all
