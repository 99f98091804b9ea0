"""The front end's line to the target daemon: generate requests (`GenerateCall`, one socket each)
waited on from async code, pings and stats.

Waiting for a reply blocks, so it runs in a worker thread one short slice at a time: between
slices the caller can notice a client that went away, and a long silence is checked with a ping,
which the daemon answers between decode steps even while busy. A daemon that does not answer one
is unreachable.
"""

from __future__ import annotations

import errno
import functools
import threading
import time
from collections.abc import Awaitable, Callable

import anyio
import zmq
from anyio import to_thread

from frontend.target_client import GenerateCall
from protocol import ErrorCode, Message, ProtocolError
from protocol.keys import ClientKeys
from protocol.transport import request

WAIT_SLICE_S = 0.2  # longest a worker thread blocks on one reply
QUIET_S = 0.5  # silence after which the daemon is pinged
# Each request promises the daemon a heartbeat this often, so a front end that dies (or hangs)
# frees its requests' slots within three of them; an HTTP client that stops reading a stream
# for that long loses it too.
HEARTBEAT_S = 2.0


# Generate requests open at once, each with a socket of its own: below the 1,023 sockets a
# ZeroMQ context holds, past which a request met "Too many open files" as a bare 500 (an audit).
# Each costs about three file descriptors (the socket's two, the HTTP connection's), so the
# process's limit of open files bounds them too (open_call_limit).
MAX_OPEN_CALLS = 1000
FILES_PER_CALL = 3
FILES_SPARE = 64  # the model folder, logs, the daemons' pipes, pings
MAX_CONNECTIONS = 65536  # HTTP connections, where the limit of open files sets none


def open_file_limit(raise_soft_limit: bool = False) -> int | None:
    """This process's limit of open files (None: none, or not Unix). `raise_soft_limit` first lifts
    the soft limit to the hard one (a server's start: the common soft limit of 1,024 allows ~320
    requests)."""
    try:
        import resource
    except ImportError:  # not Unix: ZeroMQ's own bound, and the ZMQError catch in generate()
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if raise_soft_limit and soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return None if soft == resource.RLIM_INFINITY else soft


def open_call_limit(raise_soft_limit: bool = False) -> int:
    """How many generate requests may be open at once in this process: MAX_OPEN_CALLS where the
    limit of open files allows it (`raise_soft_limit`: see open_file_limit)."""
    files = open_file_limit(raise_soft_limit)
    if files is None:
        return MAX_OPEN_CALLS
    return max(1, min(MAX_OPEN_CALLS, (files - FILES_SPARE) // FILES_PER_CALL))


def connection_limit(open_calls: int) -> int:
    """How many HTTP connections may be open at once beside `open_calls` requests: what the limit
    of open files leaves (a connection is one file; a request adds its socket's). It was the
    requests' own bound, 1,000, which 1,000 idle sockets filled, locking everyone out (a review)."""
    files = open_file_limit()
    if files is None:
        return MAX_CONNECTIONS
    return max(open_calls, min(MAX_CONNECTIONS, files - FILES_SPARE - (FILES_PER_CALL - 1) * open_calls))


class DaemonUnreachable(RuntimeError):
    """The target daemon did not answer a ping in time."""


class DaemonMisspoke(RuntimeError):
    """The target daemon answered with a reply this side cannot read: another protocol version
    (its `bad_version` error comes in its own envelope), or a field this version does not know."""


class TooManyOpen(RuntimeError):
    """As many generate requests are open as the link holds sockets for."""


class ClientGone(RuntimeError):
    """The HTTP client disconnected before its answer was ready."""


class TargetLink:
    """Where the target daemon is and how long it may stay silent before it counts as gone."""

    def __init__(
        self,
        address: str,
        daemon_timeout_s: float = 5.0,
        max_waiting: int = 512,
        curve: ClientKeys | None = None,
        max_open: int | None = None,
    ) -> None:
        """`max_open`: generate requests open at once, past which generate() refuses (default:
        open_call_limit())."""
        self.address = address
        self.open = 0  # generate calls whose socket is open
        self.max_open = open_call_limit() if max_open is None else max_open
        self.curve = curve  # CURVE keys for the daemon link, where the daemon requires them
        self.daemon_timeout_s = daemon_timeout_s
        # Worker threads that may block on replies at once; a stream past the limit waits its turn.
        self.limiter = anyio.CapacityLimiter(max_waiting)
        self.model: str | None = None  # the daemon's model name, once it said
        # Generate sockets take in every reply at once, however slowly their HTTP client reads:
        # the daemon's ROUTER drops messages for a peer whose queue is full, so none may fill.
        self.context = zmq.Context()
        self.context.setsockopt(zmq.RCVHWM, 0)
        self.heard = 0.0  # time.monotonic() of the daemon's last reply of any kind
        self.probed = 0.0  # when the last ping ended
        self.probing = anyio.Lock()
        # /stats and /metrics share one stats call at a time (see stats()).
        self.asking_stats = anyio.Lock()
        self.stats_calls = 0  # stats calls begun
        self.stats_ended = 0  # of them, ended (answered or not)
        self.last_stats: tuple[int, dict | None] = (0, None)  # the latest call's number and figures
        # Set as the server stops: worker threads still waiting on the daemon give up (an
        # abandoned ping to a hung daemon held the server's exit for up to --daemon-timeout).
        self.closing = threading.Event()

    def close(self) -> None:
        """The server stops: waits on the daemon end within a slice (see `closing`)."""
        self.closing.set()

    def call_sync(self, type_: str) -> Message | None:
        """One `ping` or `stats` on a fresh socket; None when the daemon does not answer in time,
        or once the link closes."""
        try:
            timeout_s, closing = self.daemon_timeout_s, self.closing.is_set
            reply = request(self.address, type_, timeout_s=timeout_s, curve=self.curve, given_up=closing)
        except ProtocolError as exc:
            raise DaemonMisspoke(str(exc)) from exc
        except zmq.ZMQError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            raise TooManyOpen(f"no socket for a {type_} ({exc}); retry later") from exc  # it was a bare 500
        if reply is None or reply.type == "error":
            return None
        self.heard = time.monotonic()
        return reply

    async def alive(self) -> bool:
        """Whether the daemon answered anything lately, else whether it answers a ping.

        Streams that wait together share one ping: a busy daemon is streaming to someone and
        needs none, a silent one gets one at a time, and its answer serves every waiter.
        """
        async with self.probing:
            if time.monotonic() - self.heard < QUIET_S:
                return True
            if time.monotonic() - self.probed < QUIET_S:
                return False  # a ping just went unanswered
            # Abandoned where the asker stops waiting (a client that left, a server that drains):
            # the ping ends on its own within daemon_timeout_s.
            ping = to_thread.run_sync(self.call_sync, "ping", limiter=self.limiter, abandon_on_cancel=True)
            answered = await ping is not None
            self.probed = time.monotonic()
            return answered

    async def stats(self) -> dict | None:
        """The daemon's stats, as fresh as a call begun after this one arrived; None when it does
        not answer.

        Callers that wait together share one call: a flood of /stats or /metrics (open under
        --api-key) costs the daemon one stats call at a time, where each used to make its own and
        took the daemon's room for held messages from generate requests.
        """
        arrived, ended = self.stats_calls, self.stats_ended
        async with self.asking_stats:
            number, figures = self.last_stats
            if number > arrived:  # begun after this caller arrived: fresh enough
                return figures
            if figures is None and self.stats_ended > ended:
                # The call under way as this caller arrived went unanswered while it waited: the
                # daemon is silent now, and a call of its own doubled the wait (a review).
                return None
            self.stats_calls += 1
            number = self.stats_calls
            try:
                reply = await to_thread.run_sync(self.call_sync, "stats", limiter=self.limiter)
            finally:
                self.stats_ended += 1
            figures = None if reply is None else reply["stats"]
            self.last_stats = (number, figures)
            return figures

    async def model_name(self) -> str | None:
        """The daemon's model (its folder's name), asked once; None while the daemon does not answer."""
        if self.model is None:
            stats = await self.stats()
            if stats is not None:
                self.model = stats.get("model") or "dflash-split"
        return self.model

    def generate(self, fields: dict) -> LinkCall:
        """Send a generate request (ProtocolError if its fields break the protocol's limits,
        TooManyOpen past `max_open` requests open at once)."""
        if self.open >= self.max_open:
            raise TooManyOpen(f"{self.open} requests are open at once, this server's most; retry later")
        try:
            return LinkCall(self, fields)
        except zmq.ZMQError as exc:  # out of file descriptors or sockets all the same
            raise TooManyOpen(f"no socket for another request ({exc}); retry later") from exc


class LinkCall:
    """One generate request of an HTTP client: the shared `GenerateCall`, waited on in worker
    threads one slice at a time, so the caller notices a client that left or a daemon gone silent."""

    def __init__(self, link: TargetLink, fields: dict) -> None:
        self.link = link
        fields = {"heartbeat_s": HEARTBEAT_S, **fields}
        self.call = GenerateCall(link.address, fields, HEARTBEAT_S, link.curve, link.context)
        self.id = self.call.id
        link.open += 1
        self.counted = True  # in link.open, until closed

    async def next(self, gone: Callable[[], Awaitable[bool]] | None = None) -> Message:
        """The next `chunk`, `done` or `error` reply.

        Raises ClientGone when `gone()` says the HTTP client left, DaemonUnreachable when the
        daemon stays silent and does not answer a ping either, DaemonMisspoke for a reply this
        side cannot read.
        """
        quiet_since = time.monotonic()
        while True:
            try:
                reply = await to_thread.run_sync(self.call.next, WAIT_SLICE_S, limiter=self.link.limiter)
            except ProtocolError as exc:
                raise DaemonMisspoke(str(exc)) from exc
            if reply is not None:
                # A daemon that says it holds no such request is stopping or restarted: whether it
                # is up is then a ping's to say (/health said 200 for QUIET_S after it stopped).
                forgotten = reply.type == "error" and reply.fields.get("code") == ErrorCode.UNKNOWN_REQUEST.value
                self.link.heard = 0.0 if forgotten else time.monotonic()
                if forgotten:  # nor does an earlier ping's silence say it: the next asker pings anew
                    self.link.probed = 0.0
                return reply
            if gone is not None and await gone():
                raise ClientGone("the client disconnected")
            if time.monotonic() - quiet_since >= QUIET_S:
                if not await self._alive(gone):
                    self.call.finished = True  # nobody left to cancel with
                    raise DaemonUnreachable(
                        f"the target daemon at {self.link.address} did not answer within "
                        f"{self.link.daemon_timeout_s:g} s"
                    )
                quiet_since = time.monotonic()

    async def _alive(self, gone: Callable[[], Awaitable[bool]] | None) -> bool:
        """The link's `alive`, asking `gone` every WAIT_SLICE_S meanwhile: a ping to a hung daemon
        waits up to --daemon-timeout, and a drain waiting that long missed uvicorn's cut (a review)."""
        if gone is None:
            return await self.link.alive()
        answer: list[bool | Exception] = []
        left = False
        async with anyio.create_task_group() as probing:

            async def probe() -> None:
                try:
                    answer.append(await self.link.alive())
                except Exception as exc:  # raised as itself below: a task group would wrap it (a review)
                    answer.append(exc)
                probing.cancel_scope.cancel()

            probing.start_soon(probe)
            while not left:
                await anyio.sleep(WAIT_SLICE_S)
                left = await gone()
            probing.cancel_scope.cancel()
        if left:
            raise ClientGone("the client disconnected")
        if isinstance(answer[0], Exception):
            raise answer[0]
        return answer[0]

    async def close(self, wait_s: float | None = None) -> None:
        """Cancel the request if it is still running, wait for the daemon to confirm (up to
        --daemon-timeout, or `wait_s` where less), drop the socket.

        Shielded: it runs when the HTTP client has gone and the request's task is being cancelled.
        """
        wait_s = self.link.daemon_timeout_s if wait_s is None else min(wait_s, self.link.daemon_timeout_s)
        with anyio.CancelScope(shield=True):
            try:
                if not self.call.finished:
                    cancel = functools.partial(self.call.cancel, wait_s, self.link.closing.is_set)
                    await to_thread.run_sync(cancel, limiter=self.link.limiter)
                self.call.client.close()
            finally:
                if self.counted:  # closing twice is harmless
                    self.counted = False
                    self.link.open -= 1
