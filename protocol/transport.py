"""Where bytes meet the socket: both daemons and every client send and receive through here.

REQ/REP lock-step hangs forever on a lost peer, so servers are ROUTER sockets and
clients DEALER sockets that wait with explicit deadlines and rebuild themselves after
a timeout (the "lazy pirate" pattern). A reply is checked against what its request
allows (`SCHEMAS[request].replies`, or `error`), so a confused peer is caught at once.

Links leaving the host use CURVE (ZeroMQ's authenticated encryption): a server given
`ServerKeys` lets in only the client public keys on its allow-list (a ZAP handler on the
server's own context), and a client given `ClientKeys` talks only to the server whose
public key it holds. A server will not bind a non-loopback address without keys unless
plaintext is asked for explicitly. Every socket caps the size of a frame it accepts at
what its protocol can legitimately carry; ZeroMQ drops a peer that sends more, unread.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Container, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from .codec import MAX_FRAME_BYTES, MAX_HEADER_BYTES, Message, decode, encode, encode_error
from .errors import ErrorCode, ProtocolError
from .keys import ClientKeys, ServerKeys
from .messages import SCHEMAS

Frames = list  # [header, tensor frames...] as encode() builds them

log = logging.getLogger("transport")

# What CURVE boxes and ZeroMQ framing add around a frame's payload: a socket's frame limit
# is the largest legitimate payload plus this.
FRAME_OVERHEAD = 64 * 1024
DEFAULT_MAX_FRAME = MAX_FRAME_BYTES + FRAME_OVERHEAD
# Messages between clients and the target daemon carry no tensors: a header at most.
CONTROL_MAX_FRAME = MAX_HEADER_BYTES + FRAME_OVERHEAD
ZAP_DOMAIN = b"dflash"
LOOPBACK_HOSTS = ("localhost", "lo", "::1", "[::1]")
# Replies ZeroMQ holds for one peer that does not read them: its own default, which suits streams
# of small chunks (a server whose replies are megabytes, one per request, passes far fewer).
DEFAULT_SEND_QUEUE = 1000
# Messages ZeroMQ reads ahead from one connection before it stops reading it (the peer then
# waits: nothing is dropped). Its default of 1000 let one connection of a target that sent whole
# rings faster than they were drafted hold 1000 x 22 MiB in the draft daemon (an audit): a
# daemon whose messages are large sets what one connection legitimately has in flight.
DEFAULT_RECEIVE_QUEUE = 1000
# Messages the answering helper holds for next() at most, and of them from one peer: past these
# it answers a message `busy` at once, so a flood costs memory for HELD_MAX messages at most and
# one peer's cannot crowd out the others' (their heartbeats and cancels still get in).
HELD_MAX = 256
HELD_PER_PEER = 64
MAX_ENVELOPED = 1024  # REQ peers remembered until their error reply leaves
REQ_REFUSED = "a REQ socket's empty delimiter frame: connect with a DEALER socket"
REQ_REFUSAL = bytes(encode_error(None, ErrorCode.MALFORMED, REQ_REFUSED)[0])  # its error reply's header
# One poll's longest wait: ZeroMQ takes milliseconds as a C int, which a timeout of 25 days or
# more (or inf, "forever") overflowed in every request (an audit); longer waits poll again.
LONGEST_POLL_S = 3600.0
LATE_READS = 64  # replies already queued that a wait past its deadline still reads (`receive`)
# The helper's intake, in messages a second after its first HELD_MAX: it keeps reading through a
# step (a flood of pings must not make it deaf) but cannot take the step's share of the GIL;
# past this rate ZeroMQ queues, and takes from peers in turn, so a lone ping is read soon.
READ_RATE = 5000.0
# The helper reads only once a step has run this long: a short step leaves requests to the
# caller's own loop (which bounds its intake per step), so a flood of pings cannot slow it.
ANSWER_AFTER_S = 0.05


class InsecureBind(ValueError):
    """A server asked to listen beyond this host in plaintext without saying so explicitly."""


class BindError(OSError):
    """A server cannot listen where it was asked: the address is taken, not this host's, or malformed."""


def is_loopback(host: str) -> bool:
    """Whether only this host reaches `host` (a ZeroMQ interface name like `lo` included). An
    address is read as the socket layer reads it (`127.1` and `2130706433` are 127.0.0.1); any
    other name is not local: ZeroMQ resolves names, and `127.x.example.com` may be anywhere (a
    name starting "127." passed as loopback, and was served in plaintext: an audit)."""
    if host in LOOPBACK_HOSTS:
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host or not all(part.isascii() and part.isdigit() for part in host.split(".")):
        return False
    try:
        return socket.inet_aton(host)[0] == 127
    except OSError:
        return False


def is_local(address: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address: only this host can connect."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    return scheme == "tcp" and is_loopback(rest.rsplit(":", 1)[0])


def try_bind(address: str, curve: ServerKeys | None = None, insecure_plaintext: bool = False) -> None:
    """Bind `address` and let it go: BindError or InsecureBind now, before a daemon spends minutes
    loading a model only to find its address taken (an audit)."""
    Server(address, curve=curve, insecure_plaintext=insecure_plaintext).close()


def check_bind(address: str, curve: ServerKeys | None, insecure_plaintext: bool) -> bool:
    """Refuse plaintext on an address other hosts can reach, unless `insecure_plaintext`.

    Returns True when such a plaintext bind goes ahead (the caller warns about it).
    """
    if curve is not None or is_local(address):
        return False
    if not insecure_plaintext:
        raise InsecureBind(
            f"{address} can be reached from other hosts, and no CURVE keys were given: pass --curve-key and "
            "--curve-allow (make keys with dflash-keys), or --insecure-plaintext to serve it unencrypted "
            "and unauthenticated"
        )
    return True


def _allow_ipv6(sock: zmq.Socket, address: str) -> None:
    """ZeroMQ sockets speak IPv4 only unless told otherwise, and then fail on `tcp://[::1]:PORT`
    with "No such device": a bracketed host is an IPv6 address, so such a socket is told."""
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)


def router(
    context: zmq.Context,
    address: str,
    max_message_bytes: int = DEFAULT_MAX_FRAME,
    curve: ServerKeys | None = None,
    send_queue: int = DEFAULT_SEND_QUEUE,
    receive_queue: int = DEFAULT_RECEIVE_QUEUE,
) -> zmq.Socket:
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, send_queue)
    sock.setsockopt(zmq.RCVHWM, receive_queue)
    _allow_ipv6(sock, address)
    # ZeroMQ drops oversized frames itself (and the peer that sent them), before they cost us memory.
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    # Sending to a peer that is gone, or whose queue is full because it stopped reading, fails
    # instead of vanishing silently: the target daemon cancels that peer's work.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # A client that rebuilt its socket (lazy pirate) keeps its routing id, and its queue. It stays
    # on under CURVE too: routing ids are 128 random bits a daemon never shows another peer, so
    # no peer can present another's to take over its replies.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if curve is not None:
        sock.curve_secretkey, sock.curve_publickey = curve.secret, curve.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN
    try:
        _ipc_free(address)
        sock.bind(address)
    except (zmq.ZMQError, BindError) as exc:
        sock.close(0)
        raise BindError(f"cannot listen on {address}: {exc}") from exc
    return sock


def _ipc_free(address: str) -> None:
    """BindError where another process listens on an ipc path: ZeroMQ binds over it, the old
    listener lives on unreachable and the new one takes its clients (an audit). A socket file nobody
    listens on (a daemon that died) is fine to bind over; any other file is not: ZeroMQ unlinks
    whatever the path names, and `--bind ipc://notes.txt` deleted the user's notes (an audit)."""
    if not address.startswith("ipc://"):
        return
    try:
        found = os.lstat(path := address[len("ipc://") :])
    except FileNotFoundError:
        return
    except OSError as exc:
        raise BindError(exc.strerror or str(exc)) from exc
    if not stat.S_ISSOCK(found.st_mode):
        kind = "a folder" if stat.S_ISDIR(found.st_mode) else "a link" if stat.S_ISLNK(found.st_mode) else "a file"
        raise BindError(f"{path} is {kind}, not a socket: binding would replace it")
    for attempt in range(3):  # a listener closed a moment ago (ZeroMQ closes asynchronously) stops accepting
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.5)  # a frozen listener with a full backlog: busy, not a hang
            try:
                probe.connect(path)
            except TimeoutError:
                pass
            except OSError:
                return
        time.sleep(0.05 * (attempt + 1))
    raise BindError("something listens there")


def dealer(
    context: zmq.Context,
    address: str,
    max_message_bytes: int = DEFAULT_MAX_FRAME,
    curve: ClientKeys | None = None,
    routing_id: bytes | None = None,
    receive_queue: int = DEFAULT_RECEIVE_QUEUE,
) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.RCVHWM, receive_queue)
    _allow_ipv6(sock, address)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if curve is not None:
        sock.curve_secretkey, sock.curve_publickey = curve.secret, curve.public
        sock.curve_serverkey = curve.server
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

    Replies to older requests (answered after we gave up on them) are dropped. Past the deadline,
    the replies already here are still read (at most LATE_READS): a wait that began late (its
    deadline counted from the send, across a long verify) found its reply queued behind a stale
    one, read that, and gave up on a healthy daemon (a review).
    """
    late = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            late += 1
            if late > LATE_READS or not sock.poll(0):
                return None
        elif not sock.poll(max(1, int(min(left, LONGEST_POLL_S) * 1000))):
            if time.monotonic() < deadline:  # a wait longer than one poll takes
                continue
            return None
        reply = decode(sock.recv_multipart(copy=False))
        if reply.id == request_id:
            return check_reply(request_type, reply) if request_type else reply


class Client:
    """A DEALER endpoint: numbered requests, replies waited for with deadlines.

    Its routing id is fixed for its lifetime, so a server knows it again after the socket
    is rebuilt: its queued requests and its sessions stay its own.
    """

    def __init__(
        self,
        address: str,
        context: zmq.Context | None = None,
        *,
        curve: ClientKeys | None = None,
        max_message_bytes: int = DEFAULT_MAX_FRAME,
        receive_queue: int = DEFAULT_RECEIVE_QUEUE,
    ) -> None:
        """`max_message_bytes` and `receive_queue` bound what a server can make this client hold
        unread: a frame's size, and how many replies ZeroMQ reads ahead (past them the server's
        replies wait in its own queue)."""
        self.address = address
        self.context = context or zmq.Context.instance()
        self.curve, self.max_message_bytes, self.receive_queue = curve, max_message_bytes, receive_queue
        self.routing_id = b"c-" + uuid.uuid4().hex.encode()
        self.sock: zmq.Socket | None = None
        self.kept: dict[int, Message] = {}  # replies discard_waiting set aside for their waits
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
            self.sock = dealer(
                self.context, self.address, self.max_message_bytes, self.curve, self.routing_id, self.receive_queue
            )
        if request_id is None:
            self.next_id += 1
            request_id = self.next_id
        frames = encode(type_, request_id, fields, tensors, wire_dtype=wire_dtype)
        self.bytes_out += sum(len(memoryview(f)) for f in frames)
        self.sock.send_multipart(frames, copy=False)
        return request_id

    def wait(self, request_id: int, request_type: str, timeout_s: float) -> Message | None:
        """The next reply to `request_id` within `timeout_s`, checked against `request_type`; None on timeout."""
        if request_id in self.kept:
            reply = self.kept.pop(request_id)
            return check_reply(request_type, reply) if request_type else reply
        if self.sock is None:
            return None
        return receive(self.sock, request_id, time.monotonic() + timeout_s, request_type)

    def discard_waiting(self, keep: Container[int] = (), most: int = 64) -> int:
        """Drop up to `most` replies already here that answer none of the requests `keep` names:
        replies nobody waits for (a keepalive's pongs) would otherwise fill the read-ahead queue,
        and the reply someone does wait for would find no room. Replies to `keep`'s requests are
        set aside for their wait. Returns how many were dropped."""
        self.kept = {i: reply for i, reply in self.kept.items() if i in keep}
        dropped = 0
        while self.sock is not None and dropped < most and self.sock.poll(0):
            try:
                reply = decode(self.sock.recv_multipart(copy=False))
            except ProtocolError:  # garbled: its wait would have dropped it too
                reply = None
            if reply is not None and reply.id in keep:
                self.kept[reply.id] = reply
            else:
                dropped += 1
        return dropped

    def call(
        self,
        type_: str,
        fields: Mapping[str, Any] | None = None,
        tensors: Mapping[str, Any] | None = None,
        timeout_s: float = 1.0,
        wire_dtype: str = "float32",
    ) -> Message | None:
        return self.wait(self.send(type_, fields, tensors, wire_dtype), type_, timeout_s)

    def close(self, linger_ms: int = 0) -> None:
        """Also the lazy pirate's move: a socket that missed a reply may hold a stale one, so
        it is dropped after a timeout and the next send builds a new one. `linger_ms` gives
        messages still queued (a last cancel) that long to leave."""
        if self.sock is not None:
            self.sock.close(linger_ms)
        self.sock = None
        self.kept = {}


class _AllowList:
    """The ZAP handler's question, answered from the server's allow-list."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


# Connection events worth a log line: why a peer got nothing, or why its messages vanished.
_EVENTS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: (logging.WARNING, "a peer was refused: its CURVE key is not on the allow-list"),
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: (
        logging.WARNING,
        "a peer failed the handshake (plaintext against CURVE, a wrong server key, or not ZeroMQ)",
    ),
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: (logging.WARNING, "a peer failed the handshake"),
}
# A closed connection is the normal end of every ping and every client run, so it is logged at INFO
# only where it may be the one word of an oversize frame: its peer's last message unanswered, or
# none read at all (three such lines on every demo run read as faults, a session's review). ZeroMQ
# tells a frame over the limit from a peer leaving in no way, so one sent after an answered message
# is a DEBUG line too, which says so (a review).
_LEFT = (logging.DEBUG, "a peer left (or, after its last answer, sent a frame too big for this socket)")
_CUT = (
    logging.INFO,
    "a connection closed with its peer's last message unanswered or unread: the peer left, or sent a frame "
    "over this socket's limit (dropped unread)",
)
_LOG_EVERY_S = 10.0  # a peer retrying a failed handshake every 100 ms must not flood the log


class Server:
    """A ROUTER endpoint: requests in, decoded (or the reason they could not be), replies out.

    Each decoded message's `peer` names its sender: with CURVE the client's public key (z85,
    vouched for by the ZAP handler), without it the connection's routing id.
    """

    def __init__(
        self,
        address: str,
        context: zmq.Context | None = None,
        *,
        curve: ServerKeys | None = None,
        insecure_plaintext: bool = False,
        max_message_bytes: int = DEFAULT_MAX_FRAME,
        send_queue: int = DEFAULT_SEND_QUEUE,
        receive_queue: int = DEFAULT_RECEIVE_QUEUE,
    ) -> None:
        plaintext_abroad = check_bind(address, curve, insecure_plaintext)
        self.address, self.curve = address, curve
        self.max_frame_bytes = max(0, max_message_bytes - FRAME_OVERHEAD)
        self.auth: ThreadAuthenticator | None = None
        # A context of its own (unless given one): closing it terms it, which is what makes a
        # linger wait (the shared instance is never termed at exit, and a stopping daemon's last
        # replies were dropped, a review).
        self.own_context = curve is not None or context is None
        if curve is not None:
            # A ZAP handler serves a whole context: a private one keeps this allow-list to this socket.
            self.context = zmq.Context()
            self.auth = ThreadAuthenticator(self.context, log=logging.getLogger("transport.zap"))
            self.auth.start()
            self.auth.configure_curve_callback(ZAP_DOMAIN.decode(), _AllowList(curve.allowed))
        else:
            self.context = context or zmq.Context()
        self.sock = router(self.context, address, max_message_bytes, curve, send_queue, receive_queue)
        if address.endswith(":*") or address == "ipc://*":  # the port (or path) ZeroMQ chose, for the log to name
            self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ipc_file = _ipc_file(self.address)
        self.monitor = self.sock.get_monitor_socket(int(sum(_EVENTS)) | zmq.EVENT_DISCONNECTED)
        self.logged: dict[str, tuple[float, int]] = {}  # a line -> (last logged, suppressed since)
        # Each connection (its file descriptor) -> its peer and whether that peer waits for a reply:
        # a closed connection's log line (see _CUT). Entries end with their connections.
        self.connections: dict[int, tuple[bytes, bool]] = {}
        self.connection_of: dict[bytes, int] = {}
        if plaintext_abroad:
            log.warning("serving %s in plaintext: anyone who can reach it can use it and read its traffic", address)
        # The answering helper (see answering): it holds the socket only while the caller computes.
        self.helper: threading.Thread | None = None
        self.lending = False  # the helper holds the socket now
        self.lent, self.returned = threading.Event(), threading.Event()
        self.helper_failed: BaseException | None = None
        self.answers: Mapping[str, Callable[[bytes, Message], Frames | None]] = {}
        self.held: deque[tuple[bytes, Message | ProtocolError]] = deque()  # taken in by the helper
        self.held_from: Counter[bytes] = Counter()  # of them, by peer
        # When the helper last took a message from each peer (see heard()): a client's word counts
        # from its arrival, not from when a step's backlog let the caller read it.
        self.heard_at: dict[bytes, float] = {}
        self.outbox: deque[tuple[bytes, Frames]] = deque()  # replies sent while the helper holds the socket
        self.undelivered_ids: deque[bytes] = deque()  # peers a reply sent meanwhile did not reach
        # Peers whose last message came in a REQ socket's envelope: their error reply goes out in one
        # too, or REQ drops it and its user waits for ever (an audit). At most MAX_ENVELOPED.
        self.enveloped: OrderedDict[bytes, None] = OrderedDict()

    def next(self, timeout_ms: int = 0) -> tuple[bytes, Message | ProtocolError] | None:
        """One request, waiting up to timeout_ms: (peer identity, the message or its decode error)."""
        if self.lending:
            raise RuntimeError("next() while the answering helper holds the socket")
        self._log_events()
        if self.held:
            identity, message = self.held.popleft()
            self.held_from[identity] -= 1
            if not self.held_from[identity]:
                del self.held_from[identity]
            return identity, message
        if not self.sock.poll(timeout_ms):
            return None
        return self._take()

    def holds(self, identity: bytes, request_id: int) -> bool:
        """Whether a message from `identity` with this id waits for next(): on the helper thread, a
        request that arrived during the step, which the caller does not know yet."""
        return any(peer == identity and getattr(msg, "id", None) == request_id for peer, msg in self.held)

    def take_held(self) -> list[tuple[bytes, Message | ProtocolError]]:
        """What the helper took in that next() has not returned yet, handed over and forgotten:
        on the way out the caller answers the requests among it, whose senders would otherwise
        wait for a reply that never comes."""
        held = list(self.held)
        self.held.clear()
        self.held_from.clear()
        return held

    def heard(self) -> dict[bytes, float]:
        """When each peer the helper took a message from (answered, held or refused) since the
        last call was last heard, in time.monotonic(): what next() returns later was heard then."""
        heard, self.heard_at = self.heard_at, {}
        return heard

    def _take(self) -> tuple[bytes, Message | ProtocolError]:
        identity, *frames = self.sock.recv_multipart(copy=False)
        received = time.monotonic()
        # A closed connection's descriptor may be this message's: its close, told first, is read first.
        self._log_events()
        self._waits(identity.bytes, True, _source_fd(identity))
        if len(frames) > 1 and len(frames[0]) == 0 and self._readable(frames[1:]):  # a REQ socket's envelope
            self.enveloped[identity.bytes] = None
            while len(self.enveloped) > MAX_ENVELOPED:
                self.enveloped.popitem(last=False)
            refused = ProtocolError(ErrorCode.MALFORMED, REQ_REFUSED)
            refused.peer = self._peer(identity, frames)
            return identity.bytes, refused
        try:
            message = decode(frames, max_frame_bytes=self.max_frame_bytes)
        except ProtocolError as exc:
            exc.peer = self._peer(identity, frames)
            return identity.bytes, exc
        message.peer, message.received = self._peer(identity, frames), received
        return identity.bytes, message

    def _readable(self, frames: list[zmq.Frame]) -> bool:
        """Whether `frames` are a message: after an empty frame, what a REQ socket sends. An empty
        frame before anything else is a malformed message like any other, answered without the
        envelope (a DEALER fuzzing the daemon got its error with one, a test)."""
        try:
            decode(frames, max_frame_bytes=self.max_frame_bytes)
        except ProtocolError:
            return False
        return True

    def _peer(self, identity: zmq.Frame, frames: list[zmq.Frame]) -> str:
        if self.curve is not None:
            return frames[0].get("User-Id")
        return identity.bytes.hex()

    def send(self, identity: bytes, frames: Frames) -> bool:
        """Queue a reply; False (and nothing sent) when the peer is gone or has stopped reading.

        While the helper holds the socket the reply goes out through it, True is returned, and a
        failed delivery is reported by undelivered() instead."""
        if self.lending:
            self.outbox.append((identity, frames))
            self._wake()
            return True
        return self._deliver(identity, frames)

    def _wake(self) -> None:
        """Tell the helper to look at the outbox (or that the lend ended). A full pipe means
        wakes are already waiting for it: one is as good as many."""
        try:
            self.wake_out.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass

    def undelivered(self) -> list[bytes]:
        """The peers that replies sent during answering() did not reach (each reported once)."""
        gone = []
        while self.undelivered_ids:
            gone.append(self.undelivered_ids.popleft())
        return gone

    @contextmanager
    def answering(self, answers: Mapping[str, Callable[[bytes, Message], Frames | None]]) -> Iterator[None]:
        """Lend the socket to a helper thread while the caller computes (a daemon's step), so the
        request types in `answers` (a ping) are answered within ANSWER_AFTER_S, not after the step.

        The caller's work must release the GIL (torch and the kernels do). Other requests are
        held for next() in arrival order (past HELD_MAX, or HELD_PER_PEER from one peer, they are
        answered `busy`); replies sent meanwhile go out through the helper at once.
        `answers[type](identity, message)` runs on the helper thread: it may read only what the
        caller does not change meanwhile; it returns the reply, or None for a notice (heartbeat)."""
        if self.helper is None:
            self.wake_in = self.context.socket(zmq.PAIR)
            # A name of its own for each helper: ZeroMQ frees an inproc name some time after its
            # close, and a helper started again at once after one failed could not bind it (a review).
            wake = f"inproc://server-wake-{id(self):x}-{uuid.uuid4().hex}"
            self.wake_in.bind(wake)
            self.wake_out = self.context.socket(zmq.PAIR)
            self.wake_out.connect(wake)
            self.helper = threading.Thread(target=self._help, name="answering", daemon=True)
            self.helper.start()
        self.answers = answers
        self.returned.clear()
        self.lending = True
        self.lent.set()
        try:
            yield
        finally:
            self.lending = False
            self._wake()
            self.returned.wait()
            if self.helper_failed is not None:  # the next lend starts a helper of its own
                failed, self.helper_failed, self.helper = self.helper_failed, None, None
                self.wake_in.close(linger=0)
                self.wake_out.close(linger=0)
                raise RuntimeError(f"the thread answering during a step failed: {failed!r}") from failed

    def _help(self) -> None:
        """The helper thread: holds the socket while lent, parked otherwise; ends with close(), or
        with an error, which the lend's end raises: the socket's owner waited for it for good."""
        poller = zmq.Poller()
        poller.register(self.wake_in, zmq.POLLIN)
        while True:
            self.lent.wait()
            if self.helper is None:  # closed
                return
            try:
                self._lend(poller)
            except BaseException as exc:
                self.helper_failed = exc
                return
            finally:
                self.lent.clear()
                self.returned.set()

    def _lend(self, poller: zmq.Poller) -> None:
        """One lend: answer and hold what arrives, at the intake's rate, until the owner wants the socket back."""
        taken = 0
        reading_from = time.monotonic() + ANSWER_AFTER_S
        while True:
            while self.wake_in.poll(0):  # every wake, this lend's and any a past lend left
                self.wake_in.recv()
            self._flush()
            if not self.lending:
                break
            since = time.monotonic() - reading_from
            allowed = HELD_MAX + READ_RATE * since - taken  # what the intake allows now
            if since < 0:
                wait_ms = -since * 1000
            elif allowed < 1:
                wait_ms = (1 - allowed) * 1000 / READ_RATE
            else:
                wait_ms = 100
                poller.register(self.sock, zmq.POLLIN)
            events = dict(poller.poll(max(1, int(wait_ms))))
            if since >= 0 and allowed >= 1:
                poller.unregister(self.sock)
            if self.sock in events:
                # Each message is read and checked here (tens of ms for a 64K-id prompt): the
                # lend is asked after each one, so the step's end waits for one message at most.
                for _ in range(int(allowed)):
                    if not self.lending or not self.sock.poll(0):
                        break
                    taken += 1
                    self._answer_or_hold(*self._take())
        self._flush()  # a reply queued between the last flush and the lend's end

    def _answer_or_hold(self, identity: bytes, message: Message | ProtocolError) -> None:
        """On the helper thread: answer a message of `answers`, hold another for next(), or,
        past what may be held, answer it busy."""
        self.heard_at[identity] = time.monotonic()
        if isinstance(message, Message) and message.type in self.answers:
            reply = self.answers[message.type](identity, message)
        elif len(self.held) < HELD_MAX and self.held_from[identity] < HELD_PER_PEER:
            self.held.append((identity, message))
            self.held_from[identity] += 1
            return
        elif isinstance(message, ProtocolError):
            reply = encode_error(message.request_id, message.code, message.message)
        else:
            why = (
                f"{len(self.held)} messages wait for the step under way, {self.held_from[identity]} of them "
                f"this peer's (limits {HELD_MAX}, {HELD_PER_PEER} a peer); retry later"
            )
            reply = encode_error(message.id, ErrorCode.BUSY, why)
        if reply is not None and not self._deliver(identity, reply):
            self.undelivered_ids.append(identity)

    def _flush(self) -> None:
        while self.outbox:
            identity, frames = self.outbox.popleft()
            if not self._deliver(identity, frames):
                self.undelivered_ids.append(identity)

    def _deliver(self, identity: bytes, frames: Frames) -> bool:
        # Only the refusal goes in the envelope: a peer's other replies (a DEALER that sent one such
        # message and then a ping) went out with the delimiter, and its client missed them (a review).
        if identity in self.enveloped and bytes(frames[0]) == REQ_REFUSAL:
            del self.enveloped[identity]
            frames = [b"", *frames]
        try:
            self.sock.send_multipart([identity, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        self._waits(identity, False)
        return True

    def _waits(self, identity: bytes, waiting: bool, connection: int | None = None) -> None:
        """Whether the peer `identity` waits for a reply now (a message in: yes; a reply out: no)."""
        connection = self.connection_of.get(identity, -1) if connection is None else connection
        if connection < 0:
            return
        before, _ = self.connections.get(connection, (identity, False))
        if before != identity:  # a descriptor reused before its close was read: at most one entry each
            self.connection_of.pop(before, None)
        self.connection_of[identity] = connection
        self.connections[connection] = (identity, waiting)

    def _closed(self, connection: int) -> tuple[int, str]:
        """A closed connection's log line; its entries end (see _CUT)."""
        identity, waiting = self.connections.pop(connection, (b"", True))
        if self.connection_of.get(identity) == connection:
            del self.connection_of[identity]
        return _CUT if waiting else _LEFT

    def _log_events(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                level, text = self._closed(event["value"])
            else:
                level, text = _EVENTS.get(event["event"], (logging.DEBUG, f"socket event {event['event']}"))
            last, suppressed = self.logged.get(text, (0.0, 0))
            now = time.monotonic()
            if now - last < _LOG_EVERY_S:
                self.logged[text] = (last, suppressed + 1)
                continue
            more = f" (and {suppressed} more like it in the last {now - last:.0f} s)" if suppressed else ""
            log.log(level, "%s: %s%s", self.address, text, more)
            self.logged[text] = (now, 0)

    def close(self, linger_ms: int = 0) -> None:
        """`linger_ms`: how long replies still queued get to leave (a stopping daemon's last words)."""
        if self.helper is not None:
            helper, self.helper = self.helper, None
            self.lent.set()  # it wakes, sees it is closed, and ends
            helper.join()
            self.wake_in.close(0)
            self.wake_out.close(0)
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(linger_ms)
        if self.auth is not None:
            self.auth.stop()
        if self.own_context:
            self.context.term()
        _remove_ipc_file(self.ipc_file)


def _source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection `frame` came in on, or -1: an inproc message has none, and
    ZeroMQ refuses the question (EINVAL), which failed every message an inproc server read (a review)."""
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return -1


def _ipc_file(address: str) -> tuple[str, int, int] | None:
    """(path, device, inode) of the socket file an ipc:// server just bound, or None."""
    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://") :]
    try:
        found = os.stat(path)
    except OSError:
        return None
    return path, found.st_dev, found.st_ino


def _remove_ipc_file(bound: tuple[str, int, int] | None) -> None:
    """ZeroMQ leaves an ipc socket's file behind, and stopped daemons piled them up (an audit).
    Only the file this server bound goes: a daemon that bound the path since keeps its own (one
    that binds it between the check and the unlink, microseconds, loses it: left, a review)."""
    if bound is None:
        return
    path, device, inode = bound
    try:
        found = os.stat(path)
        if (found.st_dev, found.st_ino) == (device, inode) and stat.S_ISSOCK(found.st_mode):
            os.unlink(path)
    except OSError:
        pass


GIVE_UP_SLICE_S = 0.2  # how often a request's wait asks whether it is given up


def request(
    address: str,
    type_: str,
    fields: dict | None = None,
    timeout_s: float = 1.0,
    curve: ClientKeys | None = None,
    given_up: Callable[[], bool] | None = None,
) -> Message | None:
    """One request on a fresh socket: for probes and readiness checks. `given_up`, asked every
    GIVE_UP_SLICE_S, ends the wait early with None (a server that stops: see frontend.link)."""
    client = Client(address, curve=curve)
    try:
        sent = client.send(type_, fields or {})
        if given_up is None:
            return client.wait(sent, type_, timeout_s)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and not given_up():
            if (reply := client.wait(sent, type_, min(left, GIVE_UP_SLICE_S))) is not None:
                return reply
        return None
    finally:
        client.close()


def wait_ready(
    address: str,
    timeout_s: float,
    alive: Callable[[], bool] = lambda: True,
    curve: ClientKeys | None = None,
    pid: int | None = None,
) -> bool:
    """Ping a daemon until it answers: a readiness check, not a sleep. `alive` aborts early. With
    `pid`, only that process's answer counts: a launcher's daemon that could not bind, another run's
    answering at the address, made the two runs cross (a client answered by the other's model)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            return False
        reply = request(address, "ping", timeout_s=0.5, curve=curve)
        if reply is not None and reply.type == "pong" and (pid is None or reply.fields["pid"] == pid):
            return True
        if reply is not None:  # another's: this one is still loading, or gone (`alive` says)
            time.sleep(0.1)
    return False
