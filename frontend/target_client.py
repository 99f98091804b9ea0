"""The target daemon's generate client, one for every caller: the CLI, the HTTP front end, benchmarks.

A request runs on a DEALER socket of its own: its cancel is then unambiguous (the daemon matches
a cancel by the sending identity and the request id) and the daemon's per-client round robin sees
concurrent requests as the separate clients they are. While a caller waits, the request sends the
heartbeats it promised, by the clock (replies coming in are no beat), so the daemon drops a
request whose client died. A request given up on is cancelled, and its `done` awaited: a socket
drops unsent messages when it closes, so that `done` is the proof the daemon stopped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import zmq

from protocol import Message, ProtocolError
from protocol.keys import ClientKeys
from protocol.transport import CONTROL_MAX_FRAME, Client

CANCEL_WAIT_S = 1.0  # how long a cancelled request waits for the daemon's `done`
QUIET_S = 5.0  # silence after which a waiting client pings the daemon
PING_S = 10.0  # how long that ping may take: a busy daemon answers within about 50 ms, a new
# connection over a lossy link may need a SYN resent (1 s, then 3 s)
SLICE_S = 0.2  # longest one wait blocks while a cancel drains


class GenerateCall:
    """One generate request in flight: its replies in order, its heartbeats, its cancel.

    `beat_s` > 0 sends a heartbeat that often (what the request promised in its `heartbeat_s`
    field, or more often); 0 sends none. One caller at a time, which may be a different thread
    each time; `stop` alone may come from any thread while another reads.
    """

    def __init__(
        self,
        address: str,
        fields: dict,
        beat_s: float,
        curve: ClientKeys | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.client = Client(address, context, curve=curve, max_message_bytes=CONTROL_MAX_FRAME)
        self.beat_s = beat_s
        self.beat = time.monotonic() + beat_s  # when the next heartbeat is due
        self.finished = False  # a `done` or `error` reply arrived, or the request was cancelled
        # Held by the thread using the socket: a ZeroMQ socket is not thread-safe, and a close from
        # another thread while one read raised "Socket operation on non-socket" (an audit).
        self.using = threading.Lock()
        self.stop_asked = False  # another thread asked for a cancel: the reading thread sends it
        self.cancel_sent = False
        self.closed = False
        self.last: Message | None = None  # the `done` or `error` a cancel read, for a reader to end with
        try:
            self.id = self.client.send("generate", fields)
        except Exception:
            self.client.close()
            raise

    def next(self, timeout_s: float) -> Message | None:
        """The next `chunk`, `done` or `error` reply within `timeout_s`; None when none came. Once
        closed, the `done` or `error` its cancel read (once), then None."""
        with self.using:
            if self.closed:
                last, self.last = self.last, None
                return last
            end = time.monotonic() + timeout_s
            while True:
                now = time.monotonic()
                if self.stop_asked and not self.cancel_sent and not self.finished:
                    self.cancel_sent = True  # the daemon's `done` (cancelled) ends the stream as ever
                    self.client.send("cancel", {}, request_id=self.id)
                if self.beat_s > 0 and now >= self.beat:
                    self.client.send("heartbeat", {}, request_id=self.id)
                    self.beat = now + self.beat_s
                until = min(end, self.beat) if self.beat_s > 0 else end
                reply = self.client.wait(self.id, "generate", max(min(until - now, SLICE_S), 0.001))
                if reply is not None:
                    self.finished = reply.type in ("done", "error")
                    return reply
                if time.monotonic() >= end:
                    return None

    def cancel(self, wait_s: float = CANCEL_WAIT_S, given_up: Callable[[], bool] = lambda: False) -> None:
        """Cancel the request if it still runs and wait up to `wait_s` for the daemon to confirm,
        or until `given_up()` says (asked every SLICE_S)."""
        if self.finished:
            return
        self.finished = True
        if not self.cancel_sent:
            self.cancel_sent = True
            self.client.send("cancel", {}, request_id=self.id)
        deadline = time.monotonic() + wait_s
        try:
            while (left := deadline - time.monotonic()) > 0 and not given_up():
                reply = self.client.wait(self.id, "generate", min(left, SLICE_S))
                if reply is not None and reply.type in ("done", "error"):
                    self.last = reply
                    return
        except ProtocolError:  # a reply the request does not allow: the daemon is done with it anyway
            pass

    def close(self) -> None:
        """Cancel what still runs, then drop the socket."""
        with self.using:
            self._close()

    def stop(self) -> None:
        """Cancel from any thread: at once where no thread reads the request now, else by the
        reader within SLICE_S (its stream then ends with the daemon's `done`, cancelled)."""
        self.stop_asked = True
        if self.using.acquire(blocking=False):
            try:
                self._close()
            finally:
                self.using.release()

    def _close(self) -> None:
        if self.closed:
            return
        self.cancel()
        self.client.close(linger_ms=500)
        self.closed = True


class TargetClient:
    """A blocking client, with a deadline per reply: each request on a socket of its own, so
    threads may share one client, each reading its own streams; `close` (or leaving a `with`
    block) cancels every request still open, from any thread.

    With `heartbeat_s` > 0 each request asks the daemon to drop it if the client falls silent for
    a few intervals, and heartbeats go out while the caller reads the stream (a caller that stops
    reading stops them too).
    """

    def __init__(
        self,
        address: str,
        timeout_s: float = 300.0,
        curve: ClientKeys | None = None,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.address, self.timeout_s, self.curve, self.heartbeat_s = address, timeout_s, curve, heartbeat_s
        self.calls: set[GenerateCall] = set()  # the requests in flight (one per stream, any thread)
        self.calls_lock = threading.Lock()
        self.closes = 0  # close() calls begun: one that begins while a request is being sent misses it

    def __enter__(self) -> TargetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, **fields: object) -> Iterator[Message]:
        """Yield `chunk` replies, then the final `done`; raise the daemon's error reply."""
        if self.heartbeat_s > 0:
            fields.setdefault("heartbeat_s", self.heartbeat_s)
        closes = self.closes
        call = GenerateCall(self.address, fields, self.heartbeat_s, self.curve)
        with self.calls_lock:
            self.calls.add(call)
            missed = self.closes != closes
        if missed:  # a close() took its list of calls while this one was being sent (an audit)
            call.stop()
        try:
            while True:
                reply = self._next(call)
                reply.raise_if_error()
                yield reply
                if reply.type == "done":
                    return
        finally:
            self._end(call)

    def _next(self, call: GenerateCall) -> Message:
        """The next reply within `timeout_s`. A silence of QUIET_S is checked with a ping, which a
        busy daemon answers between decode steps: a daemon killed mid-request is noticed in
        seconds, where the client waited out its whole timeout (an audit)."""
        deadline = time.monotonic() + self.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            reply = call.next(min(left, QUIET_S))
            if reply is not None:
                return reply
            if call.closed:  # by `close`, whose cancel the daemon did not confirm
                raise ConnectionAbortedError("the request was cancelled: its client was closed")
            if time.monotonic() >= deadline:
                break
            reply = self._ping(call)
            if reply is not None:
                return reply
        raise TimeoutError(f"no reply from the target daemon within {self.timeout_s:g} s")

    def _ping(self, call: GenerateCall) -> Message | None:
        """Ping the daemon while the request goes on heartbeating (a ping that blocked them for
        longer than three beats had the daemon drop a live request, a review); the request's own
        reply, if one comes meanwhile. TimeoutError when neither comes within PING_S."""
        pinger = Client(self.address, curve=self.curve, max_message_bytes=CONTROL_MAX_FRAME)
        try:
            sent = pinger.send("ping", {})
            end = time.monotonic() + PING_S
            while time.monotonic() < end:
                reply = call.next(SLICE_S)
                if reply is not None:
                    return reply
                if pinger.wait(sent, "ping", SLICE_S / 4) is not None:
                    return None
        finally:
            pinger.close()
        call.finished = True  # nobody left to cancel with
        raise TimeoutError(f"the target daemon at {self.address} stopped answering pings ({PING_S:g} s)")

    def generate(self, **fields: object) -> Message:
        return list(self.stream(**fields))[-1]

    def close(self) -> None:
        """Cancel every request in flight (a stream abandoned by an exception, or read by another
        thread: it ends with the daemon's `done`, cancelled)."""
        with self.calls_lock:
            self.closes += 1
            calls = list(self.calls)
        for call in calls:
            call.stop()

    def _end(self, call: GenerateCall) -> None:
        call.close()
        with self.calls_lock:
            self.calls.discard(call)
