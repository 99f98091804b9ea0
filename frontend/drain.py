"""When a server that shuts down ends the answers it still serves.

uvicorn gives open connections a grace period, then cancels their tasks: a stream cut that way
ended mid-body, with no error event and no `[DONE]`, and Python's http.client took the half
answer for a whole one (an audit). The answers still running when the grace is nearly over end
a moment earlier instead, with a 503 `server_shutting_down` (an error event in a stream), and
their requests are cancelled in the daemon as for a client that left.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Drain:
    def __init__(self, stopping: Callable[[], bool] = lambda: False, grace_s: float = 5.0) -> None:
        """`stopping`: whether the server's shutdown has begun; `grace_s`: what uvicorn gives a
        connection after that (its timeout_graceful_shutdown)."""
        self.stopping, self.grace_s = stopping, grace_s
        # Ahead of uvicorn's cut by more than a reply wait (WAIT_SLICE_S) and the error event's send.
        self.ahead_s = min(1.0, grace_s / 2)
        self.since: float | None = None  # when a request first saw the shutdown

    def due(self) -> bool:
        """Whether the answers still running end now. Asked by every running request at least
        every WAIT_SLICE_S, so the shutdown is seen within that of its start."""
        if self.since is None:
            if not self.stopping():
                return False
            self.since = time.monotonic()
        return time.monotonic() >= self.since + self.grace_s - self.ahead_s

    async def cut(self) -> bool:
        """`due`, in the shape LinkCall.next's `gone` takes."""
        return self.due()


NO_DRAIN = Drain()  # for an app whose server never says it stops: it never sets `since`, so one serves all
