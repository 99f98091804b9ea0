"""The draft daemon: one drafter, many target sessions, one ROUTER socket.

Each session is one target stream with its own context K/V ring (the draft-side mirror of
the target's feature ring, kept as the keys/values those features produce). A session
belongs to the peer that opened it (its CURVE public key, or its connection's routing id):
to any other peer it does not exist. Anything a peer gets wrong is answered with an error
reply naming the problem; the daemon and the other sessions carry on.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from draft_node.kept_prefixes import KeptPrefixes
from draft_node.kv_cache import (
    DraftKVCache,
    DraftStep,
    OutOfOrderError,
    drafts_alone_in_one_pass,
    finish_queued,
    timed_pass,
)
from draft_node.model import DFlashDrafter
from draft_node.predraft import PassCost, Predrafts, check_outcomes, outcomes_per_pass, predraft
from draft_node.settings import DraftSettings
from protocol import FLOAT_DTYPES, MAX_HEADER_BYTES, ErrorCode, Message, ProtocolError, encode, encode_error
from protocol.keys import ServerKeys
from protocol.messages import fit_problems
from protocol.tensors import ITEMSIZE, MAX_MAGNITUDE, moderate, wire_dtype_of
from protocol.transport import FRAME_OVERHEAD, Server

log = logging.getLogger("draft_daemon")

MAX_BURST = 64  # requests taken from the socket at once, at most
# ... and the tensor bytes they carry: a burst of targets resending whole rings (after a restart)
# is read a few at a time, not 32 x 22 MiB at once.
MAX_BURST_BYTES = 64 << 20
# Replies held for a connection that stops reading, past which they are dropped (the peer's own
# timeout then takes over). A target's slot has a connection of its own and a propose, a pre-draft
# and a ping or two in flight; at ZeroMQ's default of 1000, a peer that sent 16-outcome pre-drafts
# and read nothing grew the daemon by 1.1 GB in 400 requests (an audit, 1.75 MiB replies).
SEND_QUEUE = 32
# Requests read ahead from one connection (the rest wait in the peer's queue, none dropped): what a
# slot has in flight, a propose, a pre-draft and pings, with room to spare. At ZeroMQ's 1000, one
# connection resending whole rings (22 MiB each) faster than they were drafted could hold 22 GB.
RECEIVE_QUEUE = 16
# How often idle sessions are looked for, at most (by the service's clock), also inside a burst that
# runs on: looked for only between bursts, a daemon kept busy by heavy work held every idle session
# (a ring's keys and values each) for as long as it stayed busy (an audit).
IDLE_CHECK_S = 1.0


@dataclass
class Session:
    owner: str  # the peer that opened it
    cache: DraftKVCache
    mask: torch.Tensor  # [1, hidden]: the mask token's embedding, filling block rows 1..
    last_used: float = field(default_factory=time.monotonic)
    steps: int = 0
    rows_in: int = 0
    predrafts: Predrafts | None = None  # the last `predraft`'s drafts, until the next propose or reset
    predraft_hits: int = 0
    predraft_outcomes_cut: int = 0  # named, but not drafted: no time before the verify ends


class DraftService:
    """Message in, reply out: the daemon's logic without the socket, so it is easy to test."""

    def __init__(
        self, drafter: DFlashDrafter, settings: DraftSettings | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Sessions are shared fairly between peers: one peer holds at most
        `max_sessions_per_peer`, and a full daemon takes a slot from another peer only if that
        peer left that session idle for `reclaim_after` and has itself said nothing for as long
        (a live target pings at least every KEEPALIVE_S), first from peers over their fair share.
        `clock` (seconds) times idleness: a test's own, where a loaded machine's stretched a
        test's 50 ms."""
        self.clock = clock
        self.settings = settings = settings or DraftSettings()
        self.drafter = drafter
        self.config = drafter.config
        self.kept = KeptPrefixes(round(settings.keep_mb * (1 << 20)))  # by (peer, the target's name)
        self.sessions: dict[tuple[str, str], Session] = {}  # (owner, name) -> session
        self.heard: dict[str, float] = {}  # peer holding sessions -> when it last sent anything
        self.wire_dtypes = list(FLOAT_DTYPES)
        # Proposes that arrive together are drafted in one pass only where that was checked to
        # give each session its bits alone, on this device, now.
        self.together = drafts_alone_in_one_pass(drafter)
        log.info(
            "proposes that arrive together: %s",
            "drafted in one pass" if self.together else "drafted one by one (a pass changes bits on this device)",
        )
        # batched: proposals drafted in one pass with at least one other session's
        self.counters = {"requests": 0, "errors": 0, "proposals": 0, "batched": 0, "evicted": 0, "draft_ms": 0.0}
        # predraft_outcomes_cut: outcomes named but not drafted, for want of time before the verify ends
        self.counters.update(predrafts=0, predraft_hits=0, predraft_outcomes_cut=0)
        # superseded: proposes and pre-drafts answered undrafted, a reopen of their session behind them
        self.counters["superseded"] = 0
        self.pass_cost = PassCost()
        # When the request being handled in a burst was read (time.monotonic()): a pre-draft handled
        # after others has only what is left of its budget (None: handled alone).
        self.burst_began: float | None = None
        self.next_idle_check = clock()  # when `evict_idle_on_clock` next looks (IDLE_CHECK_S)

    @property
    def preferred_wire_dtype(self) -> str:
        """The drafter's own dtype: anything wider only costs bytes, anything narrower costs accuracy."""
        return wire_dtype_of(self.drafter.fc.weight)

    @property
    def max_message_bytes(self) -> int:
        """The largest frame a target needs to send: a header, or a propose carrying a full ring
        of fp32 feature rows (what a target resends after a restart). Larger ones are dropped."""
        features = self.settings.ring_capacity * self.config.feature_width * ITEMSIZE["float32"]
        return max(MAX_HEADER_BYTES, features) + FRAME_OVERHEAD

    def handle(self, request: Message | ProtocolError) -> list:
        """The reply to one request (or to what could not be decoded of one)."""
        self.counters["requests"] += 1
        if isinstance(request, ProtocolError):
            self.counters["errors"] += 1
            return encode_error(request.request_id, request.code, request.message)
        self.heard[request.peer] = self.clock()
        try:
            return getattr(self, f"on_{request.type}", self.on_unexpected)(request)
        except ProtocolError as exc:
            self.counters["errors"] += 1
            return encode_error(request.id, exc.code, exc.message)
        except Exception as exc:  # a bug must cost one reply, not the daemon
            self.counters["errors"] += 1
            log.exception("internal error")
            return internal_error(request.id, exc)

    @property
    def info(self) -> dict:
        return self.drafter.describe(self.settings.ring_capacity)

    def on_unexpected(self, msg: Message) -> list:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"the draft daemon does not serve '{msg.type}' requests")

    def on_hello(self, msg: Message) -> list:
        info = self.info
        kind = info.get("format", "dflash")
        if kind not in msg["formats"]:
            raise ProtocolError(
                ErrorCode.CONFIG_MISMATCH,
                f"this drafter is {kind}; the target drives {' and '.join(msg['formats'])} drafters only",
            )
        problems = fit_problems(info, msg["target"])
        if problems:
            raise ProtocolError(ErrorCode.CONFIG_MISMATCH, "drafter does not fit this target: " + "; ".join(problems))
        offered = [d for d in msg["wire_dtypes"] if d in self.wire_dtypes]
        if not offered:
            raise ProtocolError(
                ErrorCode.CONFIG_MISMATCH,
                f"no common wire dtype: target offers {msg['wire_dtypes']}, drafter {self.wire_dtypes}",
            )
        chosen = self.preferred_wire_dtype if self.preferred_wire_dtype in offered else offered[0]
        log.debug("hello from %r: wire dtype %s", msg["client"], chosen)  # names stay out of INFO logs
        return encode("hello_ok", msg.id, {"drafter": info, "wire_dtype": chosen, "wire_dtypes": self.wire_dtypes})

    def on_open(self, msg: Message) -> list:
        spec = msg.tensors["mask"][0]
        if tuple(spec.shape) != (1, self.config.hidden_size):
            wanted = [1, self.config.hidden_size]
            raise ProtocolError(ErrorCode.CONFIG_MISMATCH, f"mask row {list(spec.shape)}, drafter wants {wanted}")
        mask = finite(msg, "mask", self.drafter)
        key = (msg.peer, msg["session"])
        if key not in self.sessions:
            self.make_room(msg.peer)
        self.sessions[key] = Session(
            msg.peer, DraftKVCache(self.drafter, self.settings.ring_capacity), mask, last_used=self.clock()
        )
        return encode("ok", msg.id)

    def make_room(self, peer: str) -> None:
        """Free a slot for a new session of `peer`, or answer busy. Never a session in use: at its
        quota a peer gives up its own longest-idle one (a restarted target's leftovers) if idle
        `reclaim_after`; in a full daemon, that, else a session another peer left idle as long
        while silent as long itself (a live target pings: see KEEPALIVE_S, so such a peer is
        gone), first of the peers holding more than their fair share (max_sessions over the
        peers), oldest first. So no peer, however many identities it has, takes a session of a
        live target; a gone peer's sessions all come free (one at or under its share kept them
        until --idle-timeout, and a live newcomer got `busy`: an audit)."""
        self.evict_idle()
        now = self.clock()
        held = Counter(owner for owner, _ in self.sessions)
        reclaim_after = self.settings.reclaim_after
        own_idle = [key for key, s in self.sessions.items() if key[0] == peer and now - s.last_used > reclaim_after]
        if held[peer] >= self.settings.max_sessions_per_peer:
            if not own_idle:
                raise ProtocolError(
                    ErrorCode.BUSY,
                    f"this peer holds {held[peer]} sessions (limit {self.settings.max_sessions_per_peer}), all in use; "
                    "close one or retry later",
                )
            self.evict(min(own_idle, key=lambda k: self.sessions[k].last_used))
            return
        if len(self.sessions) < self.settings.max_sessions:
            return
        if own_idle:
            self.evict(min(own_idle, key=lambda k: self.sessions[k].last_used))
            return
        share = self.settings.max_sessions // (len(held) + (peer not in held))
        idle = [
            key
            for key, s in self.sessions.items()
            if now - s.last_used > reclaim_after and now - self.heard.get(key[0], 0.0) > reclaim_after
        ]
        if not idle:
            raise ProtocolError(
                ErrorCode.BUSY, f"all {self.settings.max_sessions} sessions belong to live peers; retry later"
            )
        self.evict(min(idle, key=lambda k: (held[k[0]] <= share, self.sessions[k].last_used)))

    def session(self, msg: Message) -> Session:
        # Another peer's session answers exactly as one that does not exist.
        found = self.sessions.get((msg.peer, msg["session"]))
        if found is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_SESSION, f"no session {msg['session']!r} (never opened, closed or evicted): open it"
            )
        found.last_used = self.clock()
        return found

    def on_reset(self, msg: Message) -> list:
        session = self.session(msg)
        session.cache.reset(msg["position"])
        session.predrafts = None
        return encode("ok", msg.id)

    def on_predraft(self, msg: Message) -> list:
        """Draft the named outcomes' next blocks now, while the target verifies (predraft.py)."""
        session = self.session(msg)
        session.predrafts = None  # whatever happens next, the older ones are stale
        spec = msg.tensors["heads"][0]
        if spec.shape[1] != self.config.hidden_size:
            raise ProtocolError(
                ErrorCode.CONFIG_MISMATCH,
                f"heads rows are {spec.shape[1]} wide, the drafter wants {self.config.hidden_size}",
            )
        if msg["position"] != session.cache.length:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                f"predraft at {msg['position']} but the context ends at {session.cache.length}: propose there first",
            )
        heads, known = finite(msg, "heads", self.drafter), msg["known"]
        try:
            check_outcomes(known, heads.shape[0], self.config.block_size)
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"predraft: {exc}") from exc
        reads = session.cache.block_reads
        per_pass = outcomes_per_pass(session.cache)
        budget_ms = self.budget_left(msg["budget_ms"])
        # No budget given (a slot's first pre-draft, before its window was measured; or a target that
        # asks for every outcome): one pass at most, the unit heavy work goes in. Every outcome named,
        # pass after pass, held other targets' steps behind it (16 over a full ring: 4 passes).
        named = len(known) if budget_ms > 0 else min(len(known), per_pass)
        count = self.pass_cost.fitting(named, budget_ms, reads, per_pass)
        self.counters["predraft_outcomes_cut"] += len(known) - count
        session.predraft_outcomes_cut += len(known) - count
        wire_dtype = msg.tensors["heads"][0].dtype
        if count == 0:  # not even one fits before the verify ends: drafting now would delay the next propose
            return encode("predrafts", msg.id, {"draft_ms": 0.0, "outcomes": 0}, {"hidden": heads[:0]}, wire_dtype)
        began = time.perf_counter()
        session.predrafts = drafted = predraft(session.cache, heads[: sum(known[:count])], known[:count], session.mask)
        finish_queued(session.cache.drafter.device)
        draft_ms = (time.perf_counter() - began) * 1000
        self.pass_cost.record(count, draft_ms, count * reads, -(-count // per_pass))
        self.counters["predrafts"] += 1
        self.counters["draft_ms"] += draft_ms
        hidden, gate = drafted.joined()
        tensors = {"hidden": hidden} if gate is None else {"hidden": hidden, "gate": gate}
        return encode("predrafts", msg.id, {"draft_ms": draft_ms, "outcomes": count}, tensors, wire_dtype=wire_dtype)

    def budget_left(self, budget_ms: float) -> float:
        """What is left of a pre-draft's budget after the requests of its burst handled before it
        (several targets' pre-drafts arriving together queue for the one drafter); 0 stays 0 (no
        budget: one pass), and a budget spent becomes the smallest one, which fits no pass."""
        if budget_ms <= 0 or self.burst_began is None:
            return budget_ms
        return max(budget_ms - (time.monotonic() - self.burst_began) * 1000, 1e-9)

    def on_keep(self, msg: Message) -> list:
        """Keep the session's context of positions [0, rows) (as many as it holds from 0) for this peer."""
        cache = self.session(msg).cache
        rows = cache.held_from_start(msg["rows"])
        if rows == 0 or not self.kept.keep(msg.peer, msg["name"], *cache.prefix(rows)):
            rows = 0
        return encode("kept", msg.id, {"rows": rows})

    def on_restore(self, msg: Message) -> list:
        """Start the session's context from a prefix this peer had kept; 0 rows where it holds none."""
        session = self.session(msg)
        cache, session.predrafts = session.cache, None
        found = self.kept.take(msg.peer, msg["name"], msg["rows"])
        if found is None:
            cache.reset(0)
            return encode("kept", msg.id, {"rows": 0})
        cache.load_prefix(*found)
        return encode("kept", msg.id, {"rows": cache.length})

    def on_close(self, msg: Message) -> list:
        self.session(msg)
        del self.sessions[(msg.peer, msg["session"])]
        return encode("ok", msg.id)

    def on_propose(self, msg: Message) -> list:
        return self.draft_together([msg])[0]

    def handle_all(
        self,
        requests: list[Message | ProtocolError],
        send: Callable[[int, list], None] | None = None,
        more: Callable[[int, int], list[Message | ProtocolError]] | None = None,
    ) -> list[list]:
        """Replies to requests that arrived together, each session's in their order. A run of
        proposes for distinct sessions (a batching target's step: one per slot) is drafted in one
        pass where the drafter computes each row alone, so each gets the bits of its propose alone.
        Heavy work waits for the rest (`_heavy`: a pre-draft, speculative, and a propose of more
        rows than a block, a prompt or a ring resent after a restart), one pass of it after each
        round of light ones, and between two rounds `more` (requests held, tensor bytes held)
        takes what arrived since: a step's propose waits for at most one heavy pass of another
        target's, where it waited behind a whole burst of them (an audit: 2.2 s, past a target's --draft-timeout,
        behind one target's eight resends; 0.55 s behind another's 16 pre-drafts). `send`
        (request index, reply) takes each reply as soon as it is made: sent at the burst's end,
        every reply waited for every pass after it, and one target's pre-draft held another
        target's drafted propose 1-1.5 s instead of 0.4 s (an audit). Without `send`, returns the
        replies of `requests` and of those `more` added, in that order; with it, nothing: a burst
        runs on while heavy work keeps arriving, and it held every request and reply it had
        answered until its end (a review: all 120 of 60 rounds). Each request's index (for `send`)
        is its place among `requests` and those `more` added."""
        pending = dict(enumerate(requests))  # not answered yet, by index
        count = len(pending)
        replies: dict[int, list] = {}
        waiting = list(pending)
        head_next = False  # after a round of light requests the queue's head goes: heavy work never starves

        def answer(i: int, reply: list) -> None:
            del pending[i]
            if send is None:
                replies[i] = reply
            else:
                send(i, reply)

        try:
            while waiting:
                # A burst runs on while heavy work keeps arriving: idle sessions still go, on the clock.
                self.evict_idle_on_clock(_session_key(pending[i]) for i in waiting)
                taken = [] if head_next else self._light(pending, waiting)
                head_next = bool(taken)
                taken = taken or self._head_pass(pending, waiting)
                self._answer_round(pending, taken, answer)
                done = set(taken)
                waiting = [i for i in waiting if i not in done]
                if more is not None and waiting:
                    held = sum(tensor_bytes(pending[i]) for i in waiting)
                    for request in more(len(waiting), held):
                        pending[count] = request
                        waiting.append(count)
                        count += 1
        finally:
            self.burst_began = None
        return [replies[i] for i in range(count)] if send is None else []

    def _answer_round(self, pending: dict, taken: list[int], answer: Callable[[int, list], None]) -> None:
        """Answers the `taken` requests in their order: each run of proposes of distinct sessions in
        one pass, the rest one by one."""
        run: list[int] = []
        superseded = _superseded(pending)

        def flush() -> None:
            self.counters["requests"] += len(run)
            for i in run:
                self.heard[pending[i].peer] = self.clock()
            for i, reply in zip(run, self.draft_together([pending[i] for i in run]), strict=True):
                answer(i, reply)
            run.clear()

        for i in taken:
            request = pending[i]
            if i in superseded:
                flush()
                self.counters["requests"] += 1
                self.counters["superseded"] += 1
                answer(i, encode_error(request.id, ErrorCode.OUT_OF_ORDER, SUPERSEDED))
                continue
            if self._batched(request):
                if any(_session_key(pending[j]) == _session_key(request) for j in run):
                    flush()
                run.append(i)
                continue
            flush()
            # A pre-draft has what is left of its budget from when it was read.
            self.burst_began = request.received if isinstance(request, Message) else None
            answer(i, self.handle(request))
        flush()

    def _heavy(self, request: Message | ProtocolError) -> bool:
        """Work that waits for the rest of its burst: a pre-draft, or a propose resending more rows than a block."""
        if not isinstance(request, Message):
            return False
        if request.type == "predraft":
            return True
        return request.type == "propose" and request.tensors["features"][0].shape[0] > self.config.block_size

    def _batched(self, request: Message | ProtocolError) -> bool:
        """A propose, drafted in one pass with those of other sessions beside it."""
        return self.together and isinstance(request, Message) and request.type == "propose"

    def _light(self, requests: dict, waiting: list[int]) -> list[int]:
        """The `waiting` requests that may go ahead of the heavy ones, in order: every light one that
        no heavy request before it holds back (one of its session's; for `keep` and `restore`, whose
        names reach across sessions, and `open`, whose slot a `close` held behind one may free or
        whose eviction may take a session with a request held, any; and an undecodable request,
        whose error must not overtake its connection's reply before it, any, and its peer's later
        requests wait with it: a target's reader waiting for the error dropped a reply that came
        before it)."""
        held: set = set()  # sessions, and peers of an undecodable request held: their later requests wait
        heavy_before = False
        light = []
        for i in waiting:
            request = requests[i]
            key = _session_key(request)
            names = not isinstance(request, Message) or request.type in ("keep", "restore", "open")
            heavy = self._heavy(request)
            if heavy or (key is not None and key in held) or request.peer in held or (names and heavy_before):
                heavy_before |= heavy
                named = key if isinstance(request, Message) else request.peer
                if named is not None:  # the session's later requests wait for this one (its peer's: all)
                    held.add(named)
                continue
            light.append(i)
        return light

    def _head_pass(self, requests: dict, waiting: list[int]) -> list[int]:
        """The oldest `waiting` request, with the proposes of distinct sessions after it that fit
        its pass: answered in order, so every request's turn comes, however many light ones keep
        arriving (light ones first and alone, a target stepping steadily beside a resend kept the
        resend waiting for as long as it stepped)."""
        head = []  # the proposes of distinct sessions that open the queue, one pass of them at most
        for i in waiting:
            request = requests[i]
            if not self._batched(request) or any(_session_key(requests[j]) == _session_key(request) for j in head):
                break
            head.append(i)
        if not head:
            return waiting[:1]
        rows = [requests[i].tensors["features"][0].shape[0] for i in head]
        return [head[j] for j in passes(rows, self.settings.max_pass_rows)[0]]

    def draft_together(self, msgs: list[Message]) -> list[list]:
        """Proposes of distinct sessions in passes of at most `max_pass_rows` feature rows, each
        propose checked alone as its pass comes (a bad one gets its error, the rest are drafted;
        a pass's tensors are read only then); each reports its share of its pass's time."""
        replies: list[list] = [[] for _ in msgs]
        for group in passes([msg.tensors["features"][0].shape[0] for msg in msgs], self.settings.max_pass_rows):
            admitted: list[tuple[int, Session, DraftStep]] = []
            for i in group:
                try:
                    session, step = self.admit_propose(msgs[i])
                    if not self._answer_predrafted(msgs[i], session, step, replies, i):
                        admitted.append((i, session, step))
                except ProtocolError as exc:
                    self.counters["errors"] += 1
                    replies[i] = encode_error(msgs[i].id, exc.code, exc.message)
                except Exception as exc:  # as in `handle`: a bug costs this reply, not the burst
                    self.counters["errors"] += 1
                    log.exception("internal error")
                    replies[i] = internal_error(msgs[i].id, exc)
            if admitted:
                self._draft_pass(msgs, admitted, replies)
        return replies

    def _draft_pass(self, msgs: list[Message], group: list[tuple[int, Session, DraftStep]], replies: list) -> None:
        try:
            drafted, draft_ms = timed_pass([step for _, _, step in group], together=True)
        except Exception as exc:  # a bug must cost these replies, not the daemon
            log.exception("internal error")
            for i, _, _ in group:
                self.counters["errors"] += 1
                replies[i] = internal_error(msgs[i].id, exc)
            return
        # What a pass of n blocks costs, in all (as a pre-draft's is timed), for passes of the steps'
        # own rows: a ring resent after a restart (~120 ms for 4,096 rows) is no measure of drafting,
        # and six of them had cut every other target's pre-drafts to none (an audit).
        if sum(step.features.shape[0] for _, _, step in group) <= len(group) * self.config.block_size:
            reads = sum(step.cache.block_reads for _, _, step in group)
            self.pass_cost.record(len(group), draft_ms * len(group), reads)
        if len(group) > 1:
            self.counters["batched"] += len(group)
        for (i, session, step), (hidden, gate) in zip(group, drafted, strict=True):
            replies[i] = self._proposal(msgs[i], session, step, hidden, gate, draft_ms)

    def _proposal(
        self,
        msg: Message,
        session: Session,
        step: DraftStep,
        hidden: torch.Tensor,
        gate: torch.Tensor | None,
        draft_ms: float,
        predrafted: bool = False,
    ) -> list:
        """A propose's reply, counted: in the wire dtype its noise came in."""
        session.steps += 1
        session.rows_in += step.features.shape[0]
        self.counters["proposals"] += 1
        self.counters["draft_ms"] += draft_ms
        tensors = {"hidden": hidden} if gate is None else {"hidden": hidden, "gate": gate}
        fields = {"draft_ms": draft_ms, "predrafted": True} if predrafted else {"draft_ms": draft_ms}
        return encode("proposal", msg.id, fields, tensors, wire_dtype=msg.tensors["noise"][0].dtype)

    def _answer_predrafted(self, msg: Message, session: Session, step: DraftStep, replies: list, i: int) -> bool:
        """Answer a propose from the session's pre-draft of the outcome it names, if there is one
        for the context its rows continue; its feature rows join the context all the same. Any
        propose ends the session's pre-drafts."""
        found, session.predrafts = session.predrafts, None
        drafted = found.take(msg["predraft"], step.start, msg["position"], step.rows) if found is not None else None
        if drafted is None:
            return False
        step.noise = None  # the context rows only: the block is drafted already
        _, draft_ms = timed_pass([step], together=True)
        session.predraft_hits += 1
        self.counters["predraft_hits"] += 1
        replies[i] = self._proposal(msg, session, step, *drafted, draft_ms, predrafted=True)
        return True

    def admit_propose(self, msg: Message) -> tuple[Session, DraftStep]:
        """A propose's session and step, or the error that refuses it; nothing changes yet."""
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
        start, rows = msg["start"], msg["rows"] or cfg.block_size - 1
        if rows > cfg.block_size - 1:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"rows {rows} > block_size - 1 = {cfg.block_size - 1}")
        features, last = finite(msg, "features", self.drafter), finite(msg, "noise", self.drafter)
        session = self.session(msg)
        try:
            session.cache.check(start)
        except OutOfOrderError as exc:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"{exc}; reset the session to {start} first") from exc
        block = torch.cat([last, session.mask.expand(cfg.block_size - 1, -1)])
        return session, DraftStep(session.cache, start, features, block, rows)

    def on_codebook(self, msg: Message) -> list:
        """Rows of a DFlash2 drafter's selector codebooks, in the drafter's own dtype."""
        if not self.config.dflash2:
            raise ProtocolError(ErrorCode.BAD_FIELD, "this drafter is dflash: it has no codebooks")
        start, rows, vocab = msg["start"], msg["rows"], self.config.vocab_size
        if start + rows > vocab:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"rows [{start}, {start + rows}) pass the codebooks' {vocab}")
        predecessor, successor = (book[start : start + rows] for book in self.drafter.codebooks())
        tensors = {"predecessor": predecessor, "successor": successor}
        return encode("codebook_ok", msg.id, {}, tensors, wire_dtype=self.preferred_wire_dtype)

    def on_ping(self, msg: Message) -> list:
        # The asking peer's own sessions: how many others hold is theirs to know.
        mine = sum(owner == msg.peer for owner, _ in self.sessions)
        return encode("pong", msg.id, {"time": time.time(), "sessions": mine, "pid": os.getpid()})

    def on_stats(self, msg: Message) -> list:
        """The asking peer's own figures only: what other tenants do (their sessions, their
        traffic) is not theirs to see; the daemon-wide counters go to its log at shutdown."""
        mine = {name: s for (owner, name), s in self.sessions.items() if owner == msg.peer}
        stats = {
            "sessions": len(mine),
            "block_size": self.config.block_size,
            "proposals": sum(s.steps for s in mine.values()),
            "per_session": {
                name: {
                    "steps": s.steps,
                    "rows_in": s.rows_in,
                    "predraft_hits": s.predraft_hits,
                    "predraft_outcomes_cut": s.predraft_outcomes_cut,
                }
                for name, s in mine.items()
            },
            "kept_prefixes": self.kept.of(msg.peer),
        }
        return encode("stats_ok", msg.id, {"stats": stats})

    def evict_idle_on_clock(self, busy: Iterable = ()) -> None:
        """`evict_idle`, at most once per IDLE_CHECK_S: cheap enough to call after every request."""
        now = self.clock()
        if now < self.next_idle_check:
            return
        self.next_idle_check = now + IDLE_CHECK_S
        self.evict_idle(busy)

    def evict_idle(self, busy: Iterable = ()) -> None:
        """Sessions idle past `idle_timeout_s` go (not those in `busy`, by (peer, name): a request of
        theirs waits in the burst), and what was heard of peers that hold none."""
        now = self.clock()
        busy = set(busy)
        idle = self.settings.idle_timeout
        for key in [k for k, s in self.sessions.items() if now - s.last_used > idle and k not in busy]:
            self.evict(key)
        if len(self.heard) > len(self.sessions):
            owners = {owner for owner, _ in self.sessions}
            self.heard = {peer: at for peer, at in self.heard.items() if peer in owners}

    def evict(self, key: tuple[str, str]) -> None:
        log.info("evicting a session (%d left)", len(self.sessions) - 1)
        log.debug("evicted session %r", key[1])
        del self.sessions[key]
        self.counters["evicted"] += 1


def passes(rows: list[int], max_rows: int) -> list[list[int]]:
    """The indices of proposes bringing `rows` feature rows each, in order, cut into passes of at
    most `max_rows` rows (a propose with more is a pass of its own)."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(rows):
        if not groups or total + n > max_rows:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def internal_error(request_id: int, exc: Exception) -> list:
    """The reply to a request a bug failed: it names the bug, and the daemon serves on."""
    return encode_error(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")


SUPERSEDED = "not drafted: a later open of this session replaces its context (the requests before it were given up)"


def _superseded(pending: dict[int, Message | ProtocolError]) -> set[int]:
    """The proposes and pre-drafts among `pending` (by index, in arrival order) after which their
    session's requests, up to an `open` of it, are all such: the open wipes what they would do, and
    a target reopens its session only after it gave up on its requests (a timeout dropped its
    socket; their replies are stale to it). Drafting them was a pass each, a whole ring for a
    resend, on a daemon too loaded to answer in time (an audit)."""
    reopened: set = set()  # sessions whose next requests (in the walk back: the later ones) lead to an open
    found = set()
    for i in reversed(list(pending)):
        request = pending[i]
        key = _session_key(request)
        if key is None:
            continue
        if request.type == "open":
            reopened.add(key)
        elif request.type in ("propose", "predraft") and key in reopened:
            found.add(i)
        else:  # a keep, reset or restore reads or sets what they did: they are drafted
            reopened.discard(key)
    return found


def _session_key(request: Message | ProtocolError) -> tuple[str, str] | None:
    """Whose session a request is about: sessions belong to a peer (None: no session named)."""
    if not isinstance(request, Message) or "session" not in request.fields:
        return None
    return (request.peer, request.fields["session"])


def take_burst(server: Server, first: tuple[bytes, Message | ProtocolError]) -> list:
    """`first` and whatever else has arrived, to be answered together (a batching target sends one
    propose per slot before it waits for any reply): at most MAX_BURST messages, and no more once
    they carry MAX_BURST_BYTES of tensors."""
    return [first, *take_more(server, 1, tensor_bytes(first[1]))]


def take_more(server: Server, held: int, held_bytes: int) -> list:
    """What has arrived, while the requests held (`held`, carrying `held_bytes` of tensors) stay
    within MAX_BURST and MAX_BURST_BYTES."""
    taken = []
    while held < MAX_BURST and held_bytes < MAX_BURST_BYTES and (more := server.next(0)) is not None:
        taken.append(more)
        held, held_bytes = held + 1, held_bytes + tensor_bytes(more[1])
    return taken


def tensor_bytes(request: Message | ProtocolError) -> int:
    return sum(spec.nbytes for spec, _ in request.tensors.values()) if isinstance(request, Message) else 0


def finite(msg: Message, name: str, drafter: DFlashDrafter) -> torch.Tensor:
    """A tensor on the drafter's device and dtype, refused if it holds NaN, Inf or a value past
    MAX_MAGNITUDE: one such row would poison every later draft of its session."""
    tensor = msg.tensor(name, drafter.device, drafter.dtype)
    if not moderate(tensor):
        bad = ~(tensor.abs() <= MAX_MAGNITUDE)
        rows = bad.reshape(tensor.shape[0], -1).any(-1).nonzero().flatten().tolist()
        raise ProtocolError(
            ErrorCode.BAD_TENSOR, f"tensor {name!r} holds NaN, Inf or values over {MAX_MAGNITUDE:g} (rows {rows[:8]})"
        )
    return tensor


def serve(
    service: DraftService,
    address: str,
    stop: threading.Event,
    curve: ServerKeys | None = None,
    insecure_plaintext: bool = False,
) -> None:
    """The poll loop: small, explicit, and it checks for shutdown at least every 100 ms."""
    server = Server(
        address,
        curve=curve,
        insecure_plaintext=insecure_plaintext,
        max_message_bytes=service.max_message_bytes,
        send_queue=SEND_QUEUE,
        receive_queue=RECEIVE_QUEUE,
    )
    log.info("draft daemon serving on %s%s", server.address, " (CURVE)" if curve else "")
    # Kept prefixes belong to a CURVE key; without CURVE a peer is a connection, and a target's
    # slots are connections of their own, so there the target's unguessable names alone scope them.
    service.kept.by_peer = curve is not None
    try:
        while not stop.is_set():
            request = server.next(100)
            if request is not None:
                burst = take_burst(server, request)
                # Each request's sender, by its index in handle_all, until its reply goes.
                peers = {i: identity for i, (identity, _) in enumerate(burst)}
                indices = itertools.count(len(burst))

                def more(held: int, held_bytes: int, to: dict = peers, indices=indices) -> list:
                    if stop.is_set():  # the burst's own requests are answered; nothing more is read
                        return []
                    taken = take_more(server, held, held_bytes)
                    to.update((next(indices), identity) for identity, _ in taken)
                    return [m for _, m in taken]

                service.handle_all(
                    [m for _, m in burst], send=lambda i, reply, to=peers: server.send(to.pop(i), reply), more=more
                )
            service.evict_idle_on_clock()
    finally:
        server.close()
        kept = service.kept
        log.info(
            "draft daemon stopped; served: %s; kept prefixes: %s, %.1f of %.0f MB held",
            _counts(service.counters),
            _counts(kept.counters),
            kept.held / (1 << 20),
            kept.max_bytes / (1 << 20),
        )


def _counts(counters: dict[str, float]) -> str:
    """`requests 38, draft ms 16.3`: a log line's counters, not a dict's repr with 15 digits."""
    shown = (f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in counters.items())
    return ", ".join(shown).replace("_", " ")
