"""ZeroMQ plumbing shared by both daemons and their clients: sockets, deadlines, shutdown.

REQ/REP lock-step hangs forever on a lost peer, so servers are ROUTER sockets and
clients DEALER sockets that wait with explicit deadlines and rebuild themselves after
a timeout (the "lazy pirate" pattern).
"""

from __future__ import annotations

import signal
import threading
import time

import zmq

from .codec import MAX_FRAME_BYTES, Message, decode, encode


def router(context: zmq.Context, address: str) -> zmq.Socket:
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # ZeroMQ drops oversized messages itself, before they cost us memory.
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + (1 << 20))
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    sock.bind(address)
    return sock


def dealer(context: zmq.Context, address: str) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + (1 << 20))
    sock.connect(address)
    return sock


def receive(sock: zmq.Socket, request_id: int, deadline: float) -> Message | None:
    """Wait for the reply to `request_id` until `deadline` (time.monotonic); None on timeout.

    Replies to older requests (answered after we gave up on them) are dropped.
    """
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(max(1, int(left * 1000))):
            return None
        reply = decode(sock.recv_multipart(copy=False))
        if reply.id == request_id:
            return reply


def request(
    context: zmq.Context, address: str, type_: str, fields: dict | None = None, timeout_s: float = 1.0
) -> Message | None:
    """One request on a fresh socket: for probes and readiness checks."""
    sock = dealer(context, address)
    try:
        sock.send_multipart(encode(type_, 1, fields or {}), copy=False)
        return receive(sock, 1, time.monotonic() + timeout_s)
    finally:
        sock.close(0)


def wait_ready(address: str, timeout_s: float, alive=lambda: True) -> bool:  # noqa: ANN001
    """Ping a daemon until it answers: a readiness check, not a sleep. `alive` aborts early."""
    context = zmq.Context.instance()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            return False
        reply = request(context, address, "ping", timeout_s=0.5)
        if reply is not None and reply.type == "pong":
            return True
    return False


def stop_on_signals() -> threading.Event:
    """SIGTERM and SIGINT set the returned event; the daemon's poll loop exits cleanly."""
    stop = threading.Event()

    def handler(signum, frame) -> None:  # noqa: ANN001
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop
