"""The front end under uvicorn: its sockets, bound before anything slow starts, and its ends on
signals, graceful for the answers still running (drain.py) whichever signal it is."""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import Iterator

import uvicorn

from protocol.transport import BindError


class HTTPServer(uvicorn.Server):
    """uvicorn's server, taking SIGHUP (a terminal closed, an ssh cut) as it takes SIGTERM: left
    to its default, a hang-up killed the server at once, streams cut and an all-in-one run's
    temporary CURVE keys left on disk (an audit). A SIGHUP ignored (nohup) stays ignored."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Inside uvicorn's own capture, so the handler found is back before uvicorn raises the
        # signals it caught again, once it has shut down.
        with super().capture_signals():
            found = signal.getsignal(signal.SIGHUP)
            if found is signal.SIG_IGN:
                yield
                return
            signal.signal(signal.SIGHUP, self.handle_exit)
            try:
                yield
            finally:
                signal.signal(signal.SIGHUP, found)


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """The HTTP sockets, listening before any daemon starts: a port already taken was found only
    after both models had loaded (68 s here, minutes on a GPU), and the run ended with uvicorn's
    start-up exit code 3 (an audit). Listening, not just bound: two servers bound with
    SO_REUSEADDR both pass until one listens (a review). One socket per address `host` names
    (`localhost`: 127.0.0.1 and ::1), IPv6 ones IPv6 only, as uvicorn binds them itself."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(found):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(2048)  # uvicorn's backlog
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sockets


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
