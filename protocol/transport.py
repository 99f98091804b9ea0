"""Where bytes meet the socket: both daemons and every client send and receive through here.

REQ/REP lock-step hangs forever on a lost peer, so servers are ROUTER sockets and
clients DEALER sockets that wait with explicit deadlines and rebuild themselves after
a timeout (the "lazy pirate" pattern). A reply is checked against what its request
allows (`SCHEMAS[request].replies`, or `error`), so a confused peer is caught at once.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from .codec import MAX_FRAME_BYTES, Message, decode, encode
from .errors import ErrorCode, ProtocolError
from .messages import SCHEMAS

Frames = list  # [header, tensor frames...] as encode() builds them


def router(context: zmq.Context, address: str, max_message_bytes: int = MAX_FRAME_BYTES + (1 << 20)) -> zmq.Socket:
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # ZeroMQ drops oversized messages itself, before they cost us memory.
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    sock.bind(address)
    return sock


def dealer(context: zmq.Context, address: str, max_message_bytes: int = MAX_FRAME_BYTES + (1 << 20)) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.connect(address)
    return sock


def check_reply(request_type: str, reply: Message) -> Message:
    """The reply itself if its type may answer `request_type`; an error reply always may."""
    allowed = SCHEMAS[request_type].replies
    if reply.type != "error" and reply.type not in allowed:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE,
            f"a '{request_type}' request cannot be answered by '{reply.type}' (expected {list(allowed)} or error)",
            request_id=reply.id,
        )
    return reply


def receive(sock: zmq.Socket, request_id: int, deadline: float, request_type: str | None = None) -> Message | None:
    """Wait for a reply to `request_id` until `deadline` (time.monotonic); None on timeout.

    Replies to older requests (answered after we gave up on them) are dropped.
    """
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(max(1, int(left * 1000))):
            return None
        reply = decode(sock.recv_multipart(copy=False))
        if reply.id == request_id:
            return check_reply(request_type, reply) if request_type else reply


class Client:
    """A DEALER endpoint: numbered requests, replies waited for with deadlines."""

    def __init__(self, address: str, context: zmq.Context | None = None) -> None:
        self.address = address
        self.context = context or zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.next_id = 0
        self.bytes_out = 0

    def send(
        self,
        type_: str,
        fields: Mapping[str, Any] | None = None,
        tensors: Mapping[str, Any] | None = None,
        wire_dtype: str = "float32",
        request_id: int | None = None,
    ) -> int:
        """Send a request; returns its id (a fresh one unless given)."""
        if self.sock is None:
            self.sock = dealer(self.context, self.address)
        if request_id is None:
            self.next_id += 1
            request_id = self.next_id
        frames = encode(type_, request_id, fields, tensors, wire_dtype=wire_dtype)
        self.bytes_out += sum(len(memoryview(f)) for f in frames)
        self.sock.send_multipart(frames, copy=False)
        return request_id

    def wait(self, request_id: int, request_type: str, timeout_s: float) -> Message | None:
        """The next reply to `request_id` within `timeout_s`, checked against `request_type`; None on timeout."""
        if self.sock is None:
            return None
        return receive(self.sock, request_id, time.monotonic() + timeout_s, request_type)

    def call(
        self,
        type_: str,
        fields: Mapping[str, Any] | None = None,
        tensors: Mapping[str, Any] | None = None,
        timeout_s: float = 1.0,
        wire_dtype: str = "float32",
    ) -> Message | None:
        return self.wait(self.send(type_, fields, tensors, wire_dtype), type_, timeout_s)

    def close(self) -> None:
        """Also the lazy pirate's move: a socket that missed a reply may hold a stale one, so
        it is dropped after a timeout and the next send builds a new one."""
        if self.sock is not None:
            self.sock.close(0)
        self.sock = None


class Server:
    """A ROUTER endpoint: requests in, decoded (or the reason they could not be), replies out."""

    def __init__(self, address: str, context: zmq.Context | None = None) -> None:
        self.address = address
        self.sock = router(context or zmq.Context.instance(), address)

    def next(self, timeout_ms: int = 0) -> tuple[bytes, Message | ProtocolError] | None:
        """One request, waiting up to timeout_ms: (peer identity, the message or its decode error)."""
        if not self.sock.poll(timeout_ms):
            return None
        identity, *frames = self.sock.recv_multipart(copy=False)
        try:
            return identity.bytes, decode(frames)
        except ProtocolError as exc:
            return identity.bytes, exc

    def send(self, identity: bytes, frames: Frames) -> None:
        self.sock.send_multipart([identity, *frames], copy=False)

    def close(self) -> None:
        self.sock.close(0)


def request(address: str, type_: str, fields: dict | None = None, timeout_s: float = 1.0) -> Message | None:
    """One request on a fresh socket: for probes and readiness checks."""
    client = Client(address)
    try:
        return client.call(type_, fields or {}, timeout_s=timeout_s)
    finally:
        client.close()


def wait_ready(address: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Ping a daemon until it answers: a readiness check, not a sleep. `alive` aborts early."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            return False
        reply = request(address, "ping", timeout_s=0.5)
        if reply is not None and reply.type == "pong":
            return True
    return False


def stop_on_signals() -> threading.Event:
    """SIGTERM and SIGINT set the returned event; the daemon's poll loop exits cleanly."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop
