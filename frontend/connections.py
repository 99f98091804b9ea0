"""The HTTP server's connections: how many may be open, and how long one may take to say what it wants.

uvicorn's h11 server gives a new connection all the time it likes to send its request's head
and keeps as many connections as it can accept: an audit held 20,000 connections that sent half
a request line, and the front end, out of file descriptors, answered nobody, /health included;
the API key cannot help, as it is read from the head those connections never finish. So a
connection must finish each request's head within `head_deadline_s` of being ready for it (on
connecting, and after each answer on a kept-alive connection), and past `max_connections` open
at once a new one gets 503 and is closed. A request's body has its own deadline (`BodyLimit`).

A refused connection's 503 goes first, then the end of its stream; what the client sends is read
and dropped until it closes, or for `REFUSED_LINGER_S`: closed at once, a connection with its
request still unread was reset, and a client that sent a body got a broken pipe, not the 503 (a
review). At most `REFUSALS_DRAINED` are drained at once, past them one is closed at once: a flood
of refused connections held open took the files the admitted requests' sockets needed (a review).
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

# As nginx's client_header_timeout (60 s) but shorter: a request's head is a few hundred bytes.
HEAD_DEADLINE_S = 20.0
REFUSED_LINGER_S = 2.0
REFUSALS_DRAINED = 16  # files beside the connections' bound (launch/serve.py keeps them free)


def full_answer(max_connections: int) -> bytes:
    """The whole HTTP answer to a connection past the limit, in OpenAI's error shape."""
    body = json.dumps(
        {
            "error": {
                "message": f"{max_connections} connections are open, this server's most; retry later",
                "type": "service_unavailable_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with its bounds: made by `bounded_h11`, which sets them."""

    max_connections = 0
    head_deadline_s = HEAD_DEADLINE_S
    refusal = b""
    draining = 0  # refused connections being drained, of every instance of a bounded class

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_timer: asyncio.TimerHandle | None = None
        self.drains = False
        bounds = type(self)
        self.refused = len(self.connections) - bounds.draining > self.max_connections
        if self.refused:
            transport.write(self.refusal)
            if bounds.draining >= REFUSALS_DRAINED or not transport.can_write_eof():
                transport.close()
                return
            transport.write_eof()
            bounds.draining += 1
            self.drains = True
            self.head_timer = self.loop.call_later(REFUSED_LINGER_S, transport.close)
            return
        self.await_head()

    def data_received(self, data: bytes) -> None:
        if not self.refused:  # a refused connection's request is dropped unread
            super().data_received(data)

    def eof_received(self) -> bool | None:
        if self.refused:
            self.transport.close()
        return super().eof_received()

    def await_head(self) -> None:
        """From now, the next request's head is due within the deadline."""
        self.cancel_head_timer()
        self.awaited = self.cycle  # the cycle before that request
        self.head_timer = self.loop.call_later(self.head_deadline_s, self.head_overdue)

    def cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def head_overdue(self) -> None:
        self.head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.head_timer is not None and self.cycle is not self.awaited:
            self.cancel_head_timer()  # a head arrived: its request runs

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self.await_head()  # before super(), which may start a pipelined request at once
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_head_timer()
        if self.drains:
            type(self).draining -= 1
            self.drains = False
        super().connection_lost(exc)


def bounded_h11(max_connections: int, head_deadline_s: float = HEAD_DEADLINE_S) -> type[BoundedH11]:
    """uvicorn's h11 protocol (pass as `http=`) with at most `max_connections` open at once, beside
    up to REFUSALS_DRAINED refused ones, and each request's head due within `head_deadline_s`."""
    bounds = {"max_connections": max_connections, "head_deadline_s": head_deadline_s, "draining": 0}
    return type("BoundedH11", (BoundedH11,), {**bounds, "refusal": full_answer(max_connections)})
