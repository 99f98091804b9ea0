"""The front end under uvicorn: its sockets, bound before anything slow starts, and its ends on
signals, graceful for the answers still running (drain.py) whichever signal it is."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import signal
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from frontend.link import TargetLink
from protocol.transport import BindError

FORCED_END_S = 1.0  # what a forced quit gives the answers still streaming to send their error event


LOGGED_CHARS = 256  # of a request's path (or client address) an access-log line shows


def printable(text: str, limit: int = LOGGED_CHARS) -> str:
    """`text` as a log line may hold it: control and non-ASCII characters escaped (a raw ESC or
    U+0085 from a header forged lines and drove the terminal reading the log), cut to `limit`
    characters (a 15 KB path a line filled the disk at the client's upload rate: an audit)."""
    shown = "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii") for c in text[:limit])
    return shown if len(text) <= limit else f"{shown}...({len(text)} characters)"


class AccessLogFilter(logging.Filter):
    """uvicorn's access lines, with the client's address and the path each `printable`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) == 5:  # client, method, path, version, status
            client, method, path, version, status = record.args
            record.args = (printable(str(client)), method, printable(str(path)), version, status)
        return True


def quiet_access_log() -> None:
    """The access log's filter, once (uvicorn's Config sets its loggers up: call this after)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, AccessLogFilter) for f in access.filters):
        access.addFilter(AccessLogFilter())


class HTTPServer(uvicorn.Server):
    """uvicorn's server, taking SIGHUP (a terminal closed, an ssh cut) as it takes SIGTERM: left
    to its default, a hang-up killed the server at once, streams cut and an all-in-one run's
    temporary CURVE keys left on disk (an audit). A SIGHUP ignored (nohup) stays ignored. It
    knows when its shutdown began (`stopping_since`), for the drain."""

    stopping_since: float | None = None
    signalled: int | None = None  # the signal that stopped it, for the caller to raise (capture_signals)

    def __init__(self, config: uvicorn.Config, link: TargetLink | None = None) -> None:
        """`link`: closed once the connections are done, so that no wait on a hung daemon holds
        the exit (it held it for up to --daemon-timeout: an audit)."""
        super().__init__(config)
        self.link = link

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().shutdown(sockets)
            if self.force_exit:
                await self._forced_end()
        finally:
            if self.link is not None:
                self.link.close()

    async def _forced_end(self) -> None:
        """A forced quit (a second Ctrl-C): uvicorn returns at once, and the end of the event loop
        cut the answers still streaming and the app's lifespan, each logged with a traceback (an
        audit). The drain is due at once (handle_exit), so they end with their error event within
        a reply wait; what has not ended by FORCED_END_S is cancelled here."""
        logging.getLogger("uvicorn.error").info("Forced quit: ending %d running task(s)", len(self.server_state.tasks))
        deadline = time.monotonic() + FORCED_END_S
        while self.server_state.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in self.server_state.tasks:
            task.cancel()
        done = getattr(self.lifespan, "shutdown_event", None)
        if done is None or not done.is_set():  # uvicorn skipped it, unless forced while it ran
            await self.lifespan.shutdown()

    def stop(self) -> None:
        """Shut down as on SIGTERM, for a reason of the caller's (the daemon it serves is gone)."""
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
        self.should_exit = True

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
        super().handle_exit(sig, frame)
        if self.force_exit:  # the drain is due now (see _forced_end)
            self.stopping_since = -math.inf

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Inside uvicorn's own capture, so the handler found is back before uvicorn would raise the
        # signals it caught again. It does not: raised there, inside the event loop, a handler that
        # ends the process (launch.serve's) cut the tasks a forced exit leaves pending, each logged
        # with a traceback (an audit). The last is kept in `signalled`, for the caller to raise
        # once the loop is done. Signals are the main thread's alone.
        with super().capture_signals():
            captured = getattr(self, "_captured_signals", [])
            try:
                with self._hang_ups_as_exits():
                    yield
            finally:
                if captured:
                    self.signalled = captured[-1]
                captured.clear()

    @contextlib.contextmanager
    def _hang_ups_as_exits(self) -> Iterator[None]:
        found = signal.getsignal(signal.SIGHUP)
        if found is signal.SIG_IGN or threading.current_thread() is not threading.main_thread():
            yield
            return
        signal.signal(signal.SIGHUP, self.handle_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGHUP, found)


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """The HTTP sockets, bound before any daemon starts: a port another server listens on was
    found only after both models had loaded (68 s here, minutes on a GPU), and the run ended with
    uvicorn's start-up exit code 3 (an audit). Bound, not listening: connections made while the
    models load are refused, not queued, so a TCP probe does not take the server for ready (a
    review). One socket per address `host` names (`localhost`: 127.0.0.1 and ::1; "": every
    interface), IPv6 ones IPv6 only, as uvicorn binds them; an address this host lacks is skipped
    while another binds (::1 in /etc/hosts without IPv6)."""
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sockets: list[socket.socket] = []
    failed: OSError | None = None
    for family, kind, proto, _, address in dict.fromkeys(found):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
        except OSError as exc:
            sock.close()
            if exc.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                for bound in sockets:
                    bound.close()
                raise BindError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
            failed = exc
            continue
        sockets.append(sock)
    if not sockets:
        raise BindError(f"cannot listen on {host}:{port}: {failed.strerror if failed else 'no address'}")
    return sockets


# Hosts that bind every interface (none of them an address a client dials): the loopback one it can.
WILDCARDS = {
    "": ("127.0.0.1", "every interface"),
    "0.0.0.0": ("127.0.0.1", "every IPv4 interface"),
    "::": ("::1", "every IPv6 interface"),
}


def url(host: str, port: int) -> str:
    """The printed address, one a client on this host can dial: IPv6 in brackets, as a URL needs;
    for a wildcard host the loopback address, and what else serves (`http://0.0.0.0:8000` was
    printed, which no client dials)."""
    dial, where = WILDCARDS.get(host, (host, ""))
    address = f"http://[{dial}]:{port}" if ":" in dial else f"http://{dial}:{port}"
    return f"{address} (listening on {where})" if where else address
