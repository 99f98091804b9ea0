"""The draft daemon: one drafter, many target sessions, one ROUTER socket.

Each session is one target stream with its own context K/V ring (the draft-side mirror of
the target's feature ring, kept as the keys/values those features produce). Anything a
peer gets wrong is answered with an error reply naming the problem; the daemon and the
other sessions carry on.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from draft_node.config import drafter_info
from draft_node.kv_cache import DraftKVCache, OutOfOrderError
from draft_node.model import DFlashDrafter
from protocol import FLOAT_DTYPES, ErrorCode, Message, ProtocolError, encode, encode_error
from protocol.messages import fit_problems
from protocol.tensors import wire_dtype_of
from protocol.transport import Server

log = logging.getLogger("draft_daemon")


@dataclass
class Session:
    cache: DraftKVCache
    mask: torch.Tensor  # [1, hidden]: the mask token's embedding, filling block rows 1..
    last_used: float = field(default_factory=time.monotonic)
    steps: int = 0
    rows_in: int = 0


class DraftService:
    """Message in, reply out: the daemon's logic without the socket, so it is easy to test."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        ring_capacity: int = 4096,
        max_sessions: int = 64,
        idle_timeout_s: float = 600.0,
    ) -> None:
        self.drafter = drafter
        self.config = drafter.config
        self.ring_capacity = ring_capacity
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.sessions: dict[str, Session] = {}
        self.wire_dtypes = list(FLOAT_DTYPES)
        self.counters = {"requests": 0, "errors": 0, "proposals": 0, "evicted": 0, "draft_ms": 0.0}

    @property
    def preferred_wire_dtype(self) -> str:
        """The drafter's own dtype: anything wider only costs bytes, anything narrower costs accuracy."""
        return wire_dtype_of(self.drafter.fc.weight)

    def handle(self, request: Message | ProtocolError) -> list:
        """The reply to one request (or to what could not be decoded of one)."""
        self.counters["requests"] += 1
        if isinstance(request, ProtocolError):
            self.counters["errors"] += 1
            return encode_error(request.request_id, request.code, request.message)
        try:
            return getattr(self, f"on_{request.type}", self.on_unexpected)(request)
        except ProtocolError as exc:
            self.counters["errors"] += 1
            return encode_error(request.id, exc.code, exc.message)
        except Exception as exc:  # a bug must cost one reply, not the daemon
            self.counters["errors"] += 1
            log.exception("internal error")
            return encode_error(request.id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    @property
    def info(self) -> dict:
        return drafter_info(self.config, self.drafter.draft_vocab, self.ring_capacity)

    def on_unexpected(self, msg: Message) -> list:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"the draft daemon does not serve '{msg.type}' requests")

    def on_hello(self, msg: Message) -> list:
        problems = fit_problems(self.info, msg["target"])
        if problems:
            raise ProtocolError(ErrorCode.CONFIG_MISMATCH, "drafter does not fit this target: " + "; ".join(problems))
        offered = [d for d in msg["wire_dtypes"] if d in self.wire_dtypes]
        if not offered:
            raise ProtocolError(
                ErrorCode.CONFIG_MISMATCH,
                f"no common wire dtype: target offers {msg['wire_dtypes']}, drafter {self.wire_dtypes}",
            )
        chosen = self.preferred_wire_dtype if self.preferred_wire_dtype in offered else offered[0]
        log.info("hello from %r: wire dtype %s", msg["client"], chosen)
        return encode("hello_ok", msg.id, {"drafter": self.info, "wire_dtype": chosen, "wire_dtypes": self.wire_dtypes})

    def on_open(self, msg: Message) -> list:
        name = msg["session"]
        if name not in self.sessions and len(self.sessions) >= self.max_sessions:
            self.evict_idle(force_oldest=True)
        spec = msg.tensors["mask"][0]
        if tuple(spec.shape) != (1, self.config.hidden_size):
            wanted = [1, self.config.hidden_size]
            raise ProtocolError(ErrorCode.CONFIG_MISMATCH, f"mask row {list(spec.shape)}, drafter wants {wanted}")
        mask = msg.tensor("mask", self.drafter.device, self.drafter.dtype)
        self.sessions[name] = Session(DraftKVCache(self.drafter, self.ring_capacity), mask)
        return encode("ok", msg.id)

    def session(self, msg: Message) -> Session:
        found = self.sessions.get(msg["session"])
        if found is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_SESSION, f"no session {msg['session']!r} (never opened, closed or evicted): open it"
            )
        found.last_used = time.monotonic()
        return found

    def on_reset(self, msg: Message) -> list:
        self.session(msg).cache.reset(msg["position"])
        return encode("ok", msg.id)

    def on_close(self, msg: Message) -> list:
        self.session(msg)
        del self.sessions[msg["session"]]
        return encode("ok", msg.id)

    def on_propose(self, msg: Message) -> list:
        session = self.session(msg)
        cfg = self.config
        features_spec, noise_spec = msg.tensors["features"][0], msg.tensors["noise"][0]
        if features_spec.shape[1] != cfg.feature_width:
            raise ProtocolError(
                ErrorCode.CONFIG_MISMATCH,
                f"feature rows are {features_spec.shape[1]} wide, the drafter wants {cfg.feature_width}",
            )
        if tuple(noise_spec.shape) != (1, cfg.hidden_size):
            raise ProtocolError(
                ErrorCode.CONFIG_MISMATCH,
                f"noise is {list(noise_spec.shape)}: send last_tok's embedding, [1, {cfg.hidden_size}]",
            )
        start, position, rows = msg["start"], msg["position"], msg["rows"] or cfg.block_size - 1
        if rows > cfg.block_size - 1:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"rows {rows} > block_size - 1 = {cfg.block_size - 1}")
        began = time.perf_counter()
        try:
            session.cache.append(start, msg.tensor("features", self.drafter.device, self.drafter.dtype))
        except OutOfOrderError as exc:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"{exc}; reset the session to {start} first") from exc
        last = msg.tensor("noise", self.drafter.device, self.drafter.dtype)
        block = torch.cat([last, session.mask.expand(cfg.block_size - 1, -1)])
        hidden = session.cache.draft(block, position)[1 : 1 + rows]
        if hidden.device.type == "cuda":
            torch.cuda.synchronize(hidden.device)
        draft_ms = (time.perf_counter() - began) * 1000
        session.steps += 1
        session.rows_in += features_spec.shape[0]
        self.counters["proposals"] += 1
        self.counters["draft_ms"] += draft_ms
        return encode("proposal", msg.id, {"draft_ms": draft_ms}, {"hidden": hidden}, wire_dtype=noise_spec.dtype)

    def on_ping(self, msg: Message) -> list:
        return encode("pong", msg.id, {"time": time.time(), "sessions": len(self.sessions)})

    def on_stats(self, msg: Message) -> list:
        stats = dict(self.counters, sessions=len(self.sessions), block_size=self.config.block_size)
        stats["per_session"] = {k: {"steps": s.steps, "rows_in": s.rows_in} for k, s in self.sessions.items()}
        return encode("stats_ok", msg.id, {"stats": stats})

    def evict_idle(self, force_oldest: bool = False) -> None:
        now = time.monotonic()
        stale = [k for k, s in self.sessions.items() if now - s.last_used > self.idle_timeout_s]
        if force_oldest and not stale and self.sessions:
            stale = [min(self.sessions, key=lambda k: self.sessions[k].last_used)]
        for name in stale:
            log.info("evicting idle session %r", name)
            del self.sessions[name]
            self.counters["evicted"] += 1


def serve(service: DraftService, address: str, stop: threading.Event) -> None:
    """The poll loop: small, explicit, and it checks for shutdown at least every 100 ms."""
    server = Server(address)
    log.info("draft daemon serving on %s", address)
    try:
        while not stop.is_set():
            request = server.next(100)
            if request is not None:
                identity, message = request
                server.send(identity, service.handle(message))
            service.evict_idle()
    finally:
        server.close()
        log.info("draft daemon stopped")
