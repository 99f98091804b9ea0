"""The drafter across the wire: a DEALER client the speculative loop uses like the local drafter.

Every request has a deadline. On a timeout or an error reply the client drops its socket
and the loop carries on with its fallback proposer (verification keeps the output exact);
after `retry_s` it probes the daemon again and, once it answers, re-opens the session and
lets the proposer resend whatever features the drafter lacks.

The daemon may come and go in any order: a target started before its drafter serves with
the fallback and picks the drafter up at the first request after it answers. A drafter that
comes back with another configuration (a restart with another checkpoint) is a new drafter:
re-checked, and used from the next request with a bridge rebuilt for it, or, if it no longer
fits this target, left alone (one log line) while the fallback drafts.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import torch

from draft_node.predraft import Predrafts
from protocol import FLOAT_DTYPES, ErrorCode, Message, ProtocolError
from protocol.keys import ClientKeys
from protocol.messages import FORMATS, KEEPALIVE_S, MAX_CODEBOOK_ROWS, fit_problems
from protocol.tensors import MAX_MAGNITUDE, moderate
from protocol.transport import FRAME_OVERHEAD, Client
from target_node.drafting.bridge import DrafterMismatch
from target_node.drafting.proposers import DrafterUnavailable
from target_node.model.target import TargetModel

log = logging.getLogger("remote_drafter")

# A selector codebook's largest value: trained ones sit near 1; a pair score multiplies two of them
# with a gate (up to MAX_MAGNITUDE), which must stay finite in fp32 over any rank.
MAX_CODEBOOK = 1e6
# What a draft daemon can make the target hold unread, per slot: replies of at most REPLY_FRAME
# bytes a frame (codebooks come in pieces that fit, pre-drafts name only the outcomes that fit:
# 16 outcomes x 16 rows x 16,384 wide in fp32 is 16 MiB), REPLY_QUEUE of them read ahead. A slot has a propose, a
# pre-draft and a ping in flight at most; a daemon that pushed 400 unasked 4-MB replies grew the
# target by 1.6 GB, and up to 1000 x 256 MiB was possible (an audit).
REPLY_FRAME = 64 << 20
REPLY_QUEUE = 8


@dataclass
class Reachability:
    """What a target's backends to one draft daemon know of it together. Every probe of a dead
    or stopped daemon stalls a step for the probe's timeout, so one backend's failed probe
    holds the others back until `retry_at` too."""

    retry_at: float = 0.0
    # How many times a backend found the daemon silent. A session opened before the last time is
    # taken as gone with it: each idle slot still attached waited out its own timeout, once a
    # slot, 2 s each, and the metrics called the drafter reachable throughout (an audit).
    silences: int = 0


@dataclass(frozen=True)
class LinkTiming:
    """How long the target waits on its drafter: a reply (`timeout_s`), a probe of a daemon that
    was away (`probe_timeout_s`), between probes (`retry_s`), and how long a session may go
    unheard before a keepalive (`keepalive_s`), and whether a pre-draft asks only for what the
    daemon drafts before the verify ends (`predraft_budget`; off, it drafts every outcome named that
    fits one pass, all of them at a short context, as the drafter in process does)."""

    timeout_s: float = 2.0
    probe_timeout_s: float = 0.25
    retry_s: float = 5.0
    keepalive_s: float = KEEPALIVE_S
    predraft_budget: bool = True


class RemoteDraftBackend:
    def __init__(
        self,
        address: str,
        target: TargetModel,
        *,
        timing: LinkTiming = LinkTiming(),
        wire_dtype: str | None = None,
        name: str | None = None,
        curve: ClientKeys | None = None,
        reach: Reachability | None = None,
    ) -> None:
        """Raises DrafterMismatch if a drafter answers now and was built for another target (an
        operator's mistake to see at once); a drafter that does not answer yet is picked up later."""
        self.address = address
        self.target = target
        self.timeout_s, self.probe_timeout_s, self.retry_s = timing.timeout_s, timing.probe_timeout_s, timing.retry_s
        self.keepalive_s, self.predraft_budget = timing.keepalive_s, timing.predraft_budget
        self.session = name or f"target-{uuid.uuid4().hex[:12]}"
        self.wire_request = wire_dtype
        self.client = Client(
            address, curve=curve, max_message_bytes=REPLY_FRAME + FRAME_OVERHEAD, receive_queue=REPLY_QUEUE
        )
        self.info: dict | None = None  # the drafter's description, once a handshake succeeded
        self.request_info: dict | None = None  # ... as it was when the current request began
        self.unfit: str | None = None  # why the drafter that answered last does not fit (logged once)
        self.wire_dtype = "float32"
        # Shared by the backends of one target (one per slot): after one found the daemon
        # unreachable, none probes it again before `retry_at`.
        self.reach = reach or Reachability()
        self.attached = False  # session open on the daemon we are talking to
        self.pending: tuple[tuple[int, int, int], int, float] | None = None  # a propose sent ahead (send_draft)
        # The last predraft: its id, position, outcomes named (known) and when it went out.
        self.predrafting: tuple[int, int, list[int], float] | None = None
        self.window_began: float | None = None  # when the last predraft went out, until the next propose
        self.window_ms = 0.0  # the time a pre-draft has (`_close_window`); 0 until measured: none (one pass)
        self.last_sent = time.monotonic()
        self.counters = dict.fromkeys(
            ["round_trips", "timeouts", "errors", "bytes_out", "bytes_in", "proposals", "sent_ahead", "changes"]
            + ["predrafts", "predraft_hits", "restores", "restore_misses"],
            0,
        )
        self.hit = False  # whether the last `draft` came from a pre-draft
        self.counters.update(draft_ms=0.0, propose_rtt_ms=0.0, predraft_ms=0.0)
        # One slot's probe of an absent daemon speaks for all: each blocking for `timeout_s` held a
        # target's start 2 s a slot (an audit: "serving" 18 s late at 8 slots, 2 minutes at 64).
        probed = time.monotonic() >= self.reach.retry_at
        if probed:
            self.attach(self.timeout_s, strict=True)
        self.request_info = self.info
        if self.info is None and probed:
            log.warning("no drafter answered at %s yet: drafting with the fallback until it does", address)

    @property
    def attached(self) -> bool:
        """Our session is open on the daemon, and no slot has found the daemon silent since."""
        return self._opened and self._opened_after == self.reach.silences

    @attached.setter
    def attached(self, opened: bool) -> None:
        self._opened, self._opened_after = opened, self.reach.silences

    def _call(self, type_: str, fields: dict, tensors: dict | None = None, timeout_s: float | None = None) -> Message:
        return self._wait(type_, self._send(type_, fields, tensors), timeout_s)

    def _send(self, type_: str, fields: dict, tensors: dict | None = None) -> int:
        try:
            sent = self.client.send(type_, fields, tensors, wire_dtype=self.wire_dtype)
        except ProtocolError as exc:  # a request the wire refuses (too large): no use retrying it now
            self._drop(f"could not send {type_}: {exc.message}")
            raise DrafterUnavailable(exc.message) from exc
        self.counters["bytes_out"] = self.client.bytes_out
        self.last_sent = time.monotonic()
        return sent

    def keepalive(self) -> None:
        """A ping, unanswered (its pong is skipped as stale by the next wait), when this backend has
        sent nothing for `keepalive_s`: a daemon takes no session from a peer it hears from, so a
        slot left idle between requests keeps its session against newcomers."""
        if self.attached and time.monotonic() - self.last_sent > self.keepalive_s:
            # The last keepalive's pong, unread: hours of them filled the queue. A propose sent ahead
            # and a pre-draft in flight keep their replies (a step can run past keepalive_s).
            awaited = {self.pending[1]} if self.pending is not None else set()
            if self.predrafting is not None:
                awaited.add(self.predrafting[0])
            self.client.discard_waiting(keep=awaited)
            self._send("ping", {})

    def _receive(self, type_: str, sent: int, timeout_s: float) -> Message:
        """The reply to request `sent` (an error reply too); a garbled or late one drops the peer
        as unreliable and raises DrafterUnavailable."""
        try:
            reply = self.client.wait(sent, type_, timeout_s)
        except ProtocolError as exc:
            if type_ == "hello" and exc.code is ErrorCode.BAD_VERSION:  # a misfit, not a daemon away
                self.client.close()
                raise DrafterMismatch(f"draft daemon at {self.address} speaks another protocol: {exc.message}") from exc
            self._drop(f"bad reply to {type_}: {exc.message}")
            raise DrafterUnavailable(exc.message) from exc
        if reply is None:
            self.counters["timeouts"] += 1
            # A session's request unanswered speaks for every slot; a probe's short wait on a busy
            # daemon does not (it detached every healthy slot for retry_s: a review).
            silence = self.attached
            self._drop(f"{type_} timed out after {timeout_s:.2f} s")
            if silence:
                self.reach.silences += 1
            raise DrafterUnavailable(f"draft daemon at {self.address} did not answer {type_}")
        self.counters["round_trips"] += 1
        self.counters["bytes_in"] += sum(spec.nbytes for spec, _ in reply.tensors.values())
        if reply.type == "error":
            self.counters["errors"] += 1
        return reply

    def _wait(self, type_: str, sent: int, timeout_s: float | None = None) -> Message:
        reply = self._receive(type_, sent, timeout_s or self.timeout_s)
        if reply.type == "error":
            if type_ == "hello" and reply["code"] == ErrorCode.CONFIG_MISMATCH.value:
                raise DrafterMismatch(f"draft daemon at {self.address}: {reply['message']}")
            # The daemon lost our session (restart, eviction) or our stream: start over.
            self.attached = False
            log.warning("draft daemon refused %s: %s: %s", type_, reply["code"], reply["message"])
            raise DrafterUnavailable(reply["message"])
        return reply

    def _drop(self, why: str) -> None:
        """Lazy pirate: a socket that missed a reply may hold a stale one; build a new one later."""
        log.warning("drafter unavailable (%s); falling back, retrying in %.1f s", why, self.retry_s)
        self._forget()
        self.reach.retry_at = time.monotonic() + self.retry_s

    def _forget(self) -> None:
        """No session, no socket, nothing awaited: as before the first attach."""
        self.client.close()
        self.attached, self.pending, self.predrafting, self.window_began = False, None, None, None

    def _forget_if_stale(self) -> None:
        """A session opened before another slot found the daemon silent is taken as gone with it."""
        if self._opened and not self.attached:
            self._forget()

    def attach(self, timeout_s: float, strict: bool = False) -> None:
        """Handshake and open our session; leaves `attached` False if the daemon does not answer
        or its drafter does not fit (then `info` is None: nothing to draft with)."""
        target = self.target
        offered = [self.wire_request] if self.wire_request else list(FLOAT_DTYPES)
        try:
            reply = self._call(
                "hello",
                {"wire_dtypes": offered, "target": target.info, "client": self.session, "formats": list(FORMATS)},
                timeout_s=timeout_s,
            )
            info = reply["drafter"]
            problems = fit_problems(info, target.info)
            if problems:
                raise DrafterMismatch(f"drafter at {self.address} does not fit this target: " + "; ".join(problems))
            if self.info is not None and info != self.info:
                self.counters["changes"] += 1
                log.warning("the drafter at %s has a new configuration: using it from the next request", self.address)
            self.info, self.unfit = info, None
            # The drafter's own dtype, unless the operator chose: wider only costs bytes.
            self.wire_dtype = self.wire_request or reply["wire_dtype"]
            mask = target.embed([info["mask_token_id"]])
            self._call("open", {"session": self.session}, {"mask": mask}, timeout_s=timeout_s)
            self.attached = True
        except DrafterMismatch as exc:
            if strict:
                raise
            if str(exc) != self.unfit:
                log.error("%s; drafting with the fallback until a drafter that fits answers", exc)
            self.info, self.unfit = None, str(exc)
            self.reach.retry_at = time.monotonic() + self.retry_s
        except DrafterUnavailable:
            self.reach.retry_at = max(self.reach.retry_at, time.monotonic() + self.retry_s)

    def ensure(self) -> None:
        """Attach if we are not, without waiting long: the loop must not stall on a dead daemon.
        A drafter that changed mid-request is not used before the next request: this request's
        features were tapped for the old one."""
        self._forget_if_stale()
        if not self.attached:
            if time.monotonic() < self.reach.retry_at:
                raise DrafterUnavailable("draft daemon unavailable; waiting before the next probe")
            self.attach(self.probe_timeout_s)
            if not self.attached:
                raise DrafterUnavailable(f"draft daemon at {self.address} still unavailable")
        if self.info != self.request_info:
            raise DrafterUnavailable(f"the drafter at {self.address} changed; it drafts from the next request")

    def begin_request(self) -> None:
        """A new request probes a daemon that was down (or unfit) at once, instead of after
        `retry_s`, so a drafter that appeared or came back is used from this request on."""
        self.reach.retry_at = 0.0
        self._forget_if_stale()
        if not self.attached:
            self.attach(self.probe_timeout_s)
        self.request_info = self.info

    def reset(self, position: int) -> None:
        self.ensure()
        self.predrafting = self.window_began = None  # a window between requests is no verify's
        self._call("reset", {"session": self.session, "position": position})

    def keep(self, name: str, rows: int) -> int:
        self.ensure()
        return self._call("keep", {"session": self.session, "name": name, "rows": rows})["rows"]

    def restore(self, name: str, rows: int) -> int:
        """The rows of prefix `name` the daemon put back into this session's context (0: none, send
        them). A count outside [0, rows] is the daemon's error: taken as none, so the rows are sent."""
        self.ensure()
        self.predrafting = self.window_began = None
        self.counters["restores"] += 1  # with the misses: the draft side's hit rate was seen nowhere (an audit)
        try:
            restored = self._call("restore", {"session": self.session, "name": name, "rows": rows})["rows"]
        except DrafterUnavailable:
            self.counters["restore_misses"] += 1
            raise
        if not 0 <= restored <= rows:
            self.counters["errors"] += 1
            log.warning("the draft daemon restored %d rows of a prefix of %d: taken as none", restored, rows)
            restored = 0
        if restored == 0:
            self.counters["restore_misses"] += 1
        return restored

    def predraft(self, position: int, heads: torch.Tensor, known: list[int]) -> None:
        """Have the daemon draft the named outcomes while the target verifies. Its reply, the
        pre-drafts, arrives during the verify; only a step whose outcome was named reads it (any
        other wait skips it), and a pre-draft that failed only makes that step a miss."""
        self.ensure()
        known = self._fitting(known)
        if not known:
            return
        heads = heads[: sum(known)]
        budget_ms = self.window_ms if self.predraft_budget else 0.0
        fields = {"session": self.session, "position": position, "known": known, "budget_ms": budget_ms}
        sent = self._send("predraft", fields, {"heads": heads})
        self.window_began = time.perf_counter()
        self.predrafting = (sent, position, list(known), self.window_began)
        self.counters["predrafts"] += 1

    def _fitting(self, known: list[int]) -> list[int]:
        """The first of the outcomes named whose pre-drafts fit one reply frame (REPLY_FRAME, rows in
        fp32 at most): a block of 128 rows 16,384 wide is 8 MiB an outcome, so 16 of them would be
        a reply the link drops with its connection."""
        row_bytes, block = 4 * self.info["hidden_size"], self.info["block_size"]
        total, fitting = 0, []
        for k in known:
            total += (block - k) * row_bytes
            if total > REPLY_FRAME:
                break
            fitting.append(k)
        return fitting

    def _close_window(self) -> None:
        """The time the daemon had for the last pre-draft, from its send to the next propose's: a
        running measure, so the next pre-draft asks only for outcomes the daemon can draft in it
        (less a tenth, for the reply's way back). A window that held plain steps too (the governor
        paused drafting) counts as at most twice the measure."""
        if self.window_began is None:
            return
        ms = 0.9 * (time.perf_counter() - self.window_began) * 1000
        self.window_ms = ms if not self.window_ms else 0.8 * self.window_ms + 0.2 * min(ms, 2 * self.window_ms)
        self.window_began = None

    def send_draft(
        self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int, predraft: int = -1
    ) -> None:
        """Send this propose now and take its reply in `draft` (same arguments): a batch's requests
        each send theirs first, so the draft daemon works on one while the others' are on the
        wire, and a step waits about one round trip, not one per request."""
        self.ensure()
        self._close_window()
        began = time.perf_counter()
        sent = self._send("propose", *self._propose(start, features, noise, position, rows, predraft))
        self.pending = ((start, position, rows, predraft), sent, began)
        self.counters["sent_ahead"] += 1

    def draft(
        self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int, predraft: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`predraft`: the index of the outcome of the last `predraft` that happened (-1: none); the
        daemon answers from that pre-draft if it holds it (`hit`), with as many rows as it drafted."""
        self.ensure()
        self._close_window()
        pending, self.pending = self.pending, None
        held = self._predrafted(start, position, rows, predraft)
        if held is not None:
            # A hit: the drafts came during the verify. The daemon's context still takes the rows,
            # from this propose (sent ahead, or now); nothing waits for its reply.
            if pending is None or pending[0] != (start, position, rows, predraft):
                self._send("propose", *self._propose(start, features, noise, position, rows, predraft))
            self.hit = True
            self.counters["proposals"] += 1
            self.counters["predraft_hits"] += 1
            return held
        if pending is not None and pending[0] == (start, position, rows, predraft):
            # The deadline runs from the send: a batch's proposes, sent together, time out together.
            _, sent, began = pending
            timeout_s = max(0.001, self.timeout_s - (time.perf_counter() - began))
        else:  # nothing sent ahead (or for another step: its reply is skipped as stale)
            began, timeout_s = time.perf_counter(), self.timeout_s
            sent = self._send("propose", *self._propose(start, features, noise, position, rows, predraft))
        reply = self._wait("propose", sent, timeout_s)
        self.hit = bool(reply["predrafted"]) and predraft >= 0
        hidden = reply.tensor("hidden", self.target.device)  # in the wire dtype: the projection casts once
        got = hidden.shape[0] if self.hit else rows  # a pre-draft holds the rows after its known tokens
        gate = (
            reply.tensor("gate", self.target.device) if self.info.get("selector") and "gate" in reply.tensors else None
        )
        fault = self._misshapen(hidden, gate)
        if fault is None and not (hidden.shape[0] == got and 0 < got <= rows):
            fault = f"{hidden.shape[0]} rows where {rows} were asked for"
        if fault is not None:
            self.counters["errors"] += 1
            raise DrafterUnavailable(f"the drafter's reply: {fault}")
        self.counters["draft_ms"] += reply["draft_ms"]
        self.counters["propose_rtt_ms"] += (time.perf_counter() - began) * 1000
        self.counters["proposals"] += 1
        self.counters["predraft_hits"] += self.hit
        return hidden, gate

    def _predrafted(
        self, start: int, position: int, rows: int, outcome: int
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Outcome `outcome`'s drafts from the last predraft's reply (waited for: it comes before
        this step's propose reply in any case), if they were drafted for this step; None for a
        miss, including a pre-draft the daemon refused or sent misshapen."""
        predrafting, self.predrafting = self.predrafting, None
        if predrafting is None or outcome < 0:
            return None
        sent, base, known, began = predrafting
        # The deadline runs from the send, as a propose sent ahead's does: a batch's pre-drafts to
        # a daemon that hung expire together, where each waiting its own timeout_s stalled a step
        # N x timeout_s at N slots (an audit: 4.03 s at 4 slots of 1 s).
        timeout_s = max(0.001, self.timeout_s - (time.perf_counter() - began))
        reply = self._receive("predraft", sent, timeout_s)
        if reply.type == "error":  # the propose that follows gets its answer (or the same error)
            log.debug("predraft refused: %s: %s", reply["code"], reply["message"])
            return None
        self.counters["predraft_ms"] += reply["draft_ms"]
        hidden = reply.tensor("hidden", self.target.device)
        gate = reply.tensor("gate", self.target.device) if "gate" in reply.tensors else None
        try:
            if (fault := self._misshapen(hidden, gate)) is not None:
                raise ValueError(f"pre-drafted {fault}")
            drafted = Predrafts.from_rows(base, known[: reply["outcomes"]], self.info["block_size"], hidden, gate)
        except ValueError as exc:
            self.counters["errors"] += 1
            log.warning("ignoring the daemon's pre-drafts: %s", exc)
            return None
        return drafted.take(outcome, start, position, rows)

    def _misshapen(self, hidden: torch.Tensor, gate: torch.Tensor | None) -> str | None:
        """Why drafted rows (fresh or pre-drafted) cannot be used, or None: checked on one rule, so
        a reply no path can use fails no batch (a gate of the wrong rank broke the selector's einsum
        for every request in it)."""
        if hidden.shape[1] != self.info["hidden_size"] or not moderate(hidden):
            return f"rows {list(hidden.shape)} misshapen or holding NaN, Inf or values over {MAX_MAGNITUDE:g}"
        selector = self.info.get("selector")
        if gate is not None and (
            not selector or tuple(gate.shape) != (hidden.shape[0], selector["rank"]) or not moderate(gate)
        ):
            return f"gate {list(gate.shape)} misshapen or holding NaN, Inf or values over {MAX_MAGNITUDE:g}"
        return None

    def codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's selector codebooks, in pieces of MAX_CODEBOOK_ROWS rows (50 MB for a
        49,152-token vocabulary at rank 256 in bf16: once per target and drafter)."""
        self.ensure()
        selector = self.info["selector"]
        vocab, pieces = selector["vocab_size"], ([], [])
        # Pieces within the reply frame: 16,384 rows at rank 256 in fp32 are 16 MiB.
        piece_rows = max(1, min(MAX_CODEBOOK_ROWS, REPLY_FRAME // (4 * selector["rank"])))
        for start in range(0, vocab, piece_rows):
            rows = min(piece_rows, vocab - start)
            reply = self._call("codebook", {"start": start, "rows": rows})
            for name, into in zip(("predecessor", "successor"), pieces, strict=True):
                piece = reply.tensor(name, self.target.device).float()
                if tuple(piece.shape) != (rows, selector["rank"]) or not moderate(piece, MAX_CODEBOOK):
                    raise DrafterUnavailable(
                        f"codebook rows {list(piece.shape)}, expected [{rows}, {selector['rank']}] of finite "
                        f"values within {MAX_CODEBOOK:g}"
                    )
                into.append(piece)
        return torch.cat(pieces[0]), torch.cat(pieces[1])

    def _propose(
        self, start: int, features: torch.Tensor, noise: torch.Tensor, position: int, rows: int, predraft: int
    ) -> tuple[dict, dict]:
        # Rows 1.. of the noise block are the mask embedding the daemon holds since `open`.
        fields = {"session": self.session, "start": start, "position": position, "rows": rows, "predraft": predraft}
        return fields, {"features": features, "noise": noise[:1]}

    def close(self) -> None:
        # A stale session too, unless the daemon was found silent just now: one alive frees it now,
        # not at its reclaim; one silent would hold each slot's close for a probe's wait (a review).
        if self.attached or (self._opened and time.monotonic() >= self.reach.retry_at):
            try:
                self._call("close", {"session": self.session}, timeout_s=self.probe_timeout_s)
            except (DrafterUnavailable, ProtocolError):
                pass
        self.client.close()
        self.attached = False
