"""The target daemon: clients send generate requests, get streamed chunks and a final record.

One thread does everything, a step at a time. Each step it takes in a bounded number of
messages (a flood from one peer costs others at most that many messages' work), admits queued
requests into free slots of the engine's cache (up to `--max-batch`), and runs one batched
forward for every admitted request: a chunk of a new prompt beside the others' decode and
verify rows (decoding.sequence.step). A request streams its tokens as they are committed and
leaves on EOS, stop, budget, cancel or a vanished client, freeing its slot for the next. Its
output is the same whatever it was batched with: the engine computes each row as if alone.
Queues are per client and served round-robin, so one busy client cannot starve the others. A
client that is gone (a reply cannot be delivered) or silent past its promised heartbeats loses
its requests. While a step computes, the server's helper thread answers pings and takes the
other messages in for the next step, so the daemon is never deaf for a step's length.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from protocol import ErrorCode, Message, ProtocolError, encode, encode_error
from protocol.keys import ServerKeys
from protocol.messages import HEARTBEAT_MISSES
from protocol.stats import ServedStats
from protocol.transport import CONTROL_MAX_FRAME, Server
from target_node.decoding.governor import Governor
from target_node.decoding.options import DecodeOptions
from target_node.decoding.pace import PrefillPace
from target_node.decoding.sequence import Result, Sequence, step
from target_node.drafting.datastore import Datastore
from target_node.drafting.proposers import NoProposer, Proposer
from target_node.model.target import ContextLengthError, TargetModel
from target_node.serving.metrics import RequestClock, ServedMetrics, drafter_state
from target_node.serving.prefix_cache import PrefixCache
from target_node.serving.requests import answer_budget, decode_options, prompt_ids
from target_node.serving.settings import ServiceSettings

log = logging.getLogger("target_daemon")

# Messages read ahead from one client connection before ZeroMQ stops reading it (the client then
# waits; nothing is dropped): at its default of 1000 a connection could hold 1 GiB of 1 MiB
# requests. A client's requests, cancels and heartbeats fit many times over.
RECEIVE_QUEUE = 64
# Seconds of admission work (tokenizing, refusing) a step may take: see admit().
ADMIT_BUDGET_S = 0.25


SHUTDOWN_LINGER_MS = 500  # what a stopping daemon gives its last replies to leave
CLOSE_DRAFTERS_S = 2.0  # and its drafter sessions' closing, together


@dataclass
class Job:
    identity: bytes
    request: Message
    cancel: threading.Event = field(default_factory=threading.Event)
    received: float = field(default_factory=time.monotonic)
    lost: bool = False  # its client is gone: cancelled, and nobody to answer
    dropped: bool = False  # cancelled because its client went away or silent (abandon)
    held: int = 0  # bytes its request holds while queued, about (see compact)


def size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def compact(msg: Message) -> int:
    """Hold a queued request's token ids as 4-byte arrays, not lists of Python ints (~36 bytes
    each: a queue of 65,536-id prompts cost 2.9 MB a request), and return about what it holds."""
    fields = msg.fields
    for key in ("token_ids", "hints"):
        fields[key] = array("i", fields[key])  # ids are < 2**31 (the schema's bound)
    # Every object the request keeps, measured: a chat's 1,024 empty messages with odd roles were
    # counted as 50 KiB where they held 398 KiB (an audit), so the queue's byte limit let through 8x
    # more; and a guessed 1 KiB for the message's own dicts fell 700 bytes short on another machine.
    return sys.getsizeof(msg) + held_bytes(vars(msg))  # its fields, and its type, id, peer, tensors


def held_bytes(value: object) -> int:
    """The bytes `value` and what it contains hold (dicts, lists and tuples followed; what two
    of them share counted twice, but not dict keys: msgpack interns them)."""
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        return size + sum(held_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return size + sum(held_bytes(v) for v in value)
    return size


@dataclass
class Active:
    """A request in a slot: its decoding, and what its reply needs."""

    job: Job
    sequence: Sequence
    prompt: list[int]
    clock: RequestClock
    queued_s: float  # from arrival to admission
    drafter_before: dict  # its proposer's counters when it started: the request's own are the difference
    prompt_stored: bool = False  # its prompt's rows are in the prefix cache (once the prompt is in)


class TargetService:
    def __init__(
        self,
        target: TargetModel,
        proposers: Proposer | list[Proposer],
        settings: ServiceSettings | None = None,
        on_finished: Callable[[Message, list[int], Result], None] | None = None,
        datastore: Datastore | Future[Datastore | None] | None = None,
    ) -> None:
        """`proposers`: one per slot (requests run side by side, up to as many as the target has
        slots); one proposer serves one request at a time. `settings`: the limits and pacing (see
        settings.py). `on_finished(request, prompt ids, result)` sees every request served to its
        end (e.g. a recorder). `datastore`: the target's earlier answers, whose continuations every
        greedy tree verifies too (settings.datastore says where the launcher finds them); a future
        of one while its index is built, requests meanwhile served without it."""
        self.settings = settings = settings or ServiceSettings()
        self.on_finished = on_finished
        self.datastore = datastore
        self.target = target
        self.adaptive = not settings.always_draft
        # One governor for all: each request decides with its own fork of it, which it gives back
        # at its end, so the next starts from what the last learned; verify costs measured here.
        self.governor = Governor(max_nodes=max(settings.tree_nodes, 1))
        self.proposers = list(proposers) if isinstance(proposers, list) else [proposers]
        if self.adaptive and self.proposers[0].name != NoProposer.name:  # a plain daemon's governor decides nothing
            # A step's width: one request's tree, up to every slot's; past 32 rows measured sparsely
            # (between them interpolated): each width densely to --tree-nodes 1000 took minutes.
            # There a step's cost grows linearly on a CPU (flat on a GPU): powers of two and the
            # widest interpolate it within a few percent, at half the start-up of twice as many.
            widest = (self.governor.max_nodes + 1) * target.slots
            wide = [w for w in (32, 64, 128, 256, 512, 1024) if w < widest] + [widest]
            dense = range(1, min(self.governor.max_nodes + 2, 33))
            self.governor.costs.measure(
                target, sorted({*dense, *range(2, min(target.slots, 32) + 1), *wide}), repeats=2
            )
        self.free = list(range(min(target.slots, len(self.proposers))))  # slots no request holds
        self.active: dict[int, Active] = {}  # slot -> the request in it
        # The line of clients waiting, each with its jobs in order (see next_job for who goes first).
        self.queues: OrderedDict[bytes, deque[Job]] = OrderedDict()
        self.admissions = 0
        self.last_served: dict[bytes, int] = {}  # client -> the admission that last gave it a slot
        self.server: Server | None = None
        self.served = 0
        self.metrics = ServedMetrics()  # what was served, for the `stats` reply
        budget_s, chunk = settings.prefill_budget_ms / 1000, settings.prefill_chunk
        self.pace = PrefillPace(budget_s, chunk or 1 << 20) if budget_s > 0 else None
        self.heard: dict[bytes, float] = {}  # client -> when it last sent anything (clients with work)
        self.reached: dict[bytes, float] = {}  # client -> when a reply to it last went out (streaming)
        self.counters = {"cancelled": 0, "abandoned": 0}  # abandoned: its client went away or silent
        self.waiting = 0  # requests queued, as of the last pump (what a pong says)
        self.held: set[tuple[bytes, int]] = set()  # (client, request id) running or queued as a step began
        # The engine's rows are the same bits in any forward: only there can a later request reuse them.
        cache_bytes = round(settings.prefix_cache_mb * (1 << 20))
        self.prefix_cache = PrefixCache(cache_bytes) if cache_bytes > 0 and target.engine is not None else None

    @property
    def proposer(self) -> Proposer:
        """The proposer kind every slot has (each slot its own instance)."""
        return self.proposers[0]

    @property
    def max_batch(self) -> int:
        return len(self.free) + len(self.active)

    # --- socket side -------------------------------------------------------

    def send(self, identity: bytes, frames: list) -> None:
        if not self.server.send(identity, frames):
            self.abandon(identity, "a reply could not be delivered")
        elif identity in self.heard:  # a client with work here: it takes what it is sent
            self.reached[identity] = time.monotonic()

    def pump(self, timeout_ms: int = 0) -> None:
        """Take in what waits on the socket, at most `max_messages_per_step` messages (ZeroMQ
        takes them from peers in turn): queue requests, apply cancels, answer pings; then drop
        the work of clients that went silent."""
        for _ in range(self.settings.max_messages_per_step):
            request = self.server.next(timeout_ms)
            if request is None:
                break
            timeout_ms = 0
            identity, msg = request
            self.heard[identity] = time.monotonic()
            if isinstance(msg, ProtocolError):
                self.send(identity, encode_error(msg.request_id, msg.code, msg.message))
                continue
            if msg.type == "generate":
                self.enqueue(identity, msg)
            elif msg.type == "cancel":
                self.cancel(identity, msg.id)
            elif msg.type == "ping":
                self.send(identity, self.pong(identity, msg))
            elif msg.type == "heartbeat":  # being heard from is all it says, of a request held here
                if not self.holds(identity, msg.id):
                    self.send(identity, unknown_request(msg.id))
            elif msg.type == "stats":
                self.send(identity, encode("stats_ok", msg.id, {"stats": self.report()}))
            else:
                self.send(
                    identity,
                    encode_error(msg.id, ErrorCode.UNKNOWN_TYPE, f"the target daemon does not serve '{msg.type}'"),
                )
        # Messages the helper took during the last step (pings and heartbeats it answered, those it
        # holds for the next steps) count from their arrival.
        for identity, at in self.server.heard().items():
            self.heard[identity] = max(at, self.heard.get(identity, at))
        for identity in self.server.undelivered():  # replies sent during the last step
            self.abandon(identity, "a reply could not be delivered")
        self.reap()
        self.waiting = self.pending()

    def pong(self, identity: bytes, msg: Message) -> list:
        """Also answered by the server's helper thread during a step: it reads only `waiting`,
        which changes between steps."""
        return encode("pong", msg.id, {"time": time.time(), "sessions": self.waiting, "pid": os.getpid()})

    def requests_held(self) -> set[tuple[bytes, int]]:
        """(client, request id) of every request running or waiting here."""
        held = {(a.job.identity, a.job.request.id) for a in self.active.values()}
        return held | {(who, job.request.id) for who, queue in self.queues.items() for job in queue}

    def holds(self, identity: bytes, request_id: int) -> bool:
        """Whether this client's request runs or waits here."""
        return (identity, request_id) in self.requests_held()

    def heartbeat(self, identity: bytes, msg: Message) -> list | None:
        """A heartbeat during a step, on the server's helper thread: a notice for a request that ran
        or waited as the step began (`held`) or arrived during it; else an error, so a client whose
        request this daemon never held (it restarted meanwhile) learns so instead of waiting forever."""
        if (identity, msg.id) in self.held or self.server.holds(identity, msg.id):
            return None
        return unknown_request(msg.id)

    def enqueue(self, identity: bytes, msg: Message) -> None:
        queue = self.queues.get(identity, deque())
        if self.holds(identity, msg.id):
            why = f"request id {msg.id} is already queued or running for this client: ids must be unique"
            self.send(identity, encode_error(msg.id, ErrorCode.BAD_FIELD, why))
            return
        held = compact(msg)
        if len(queue) >= self.settings.max_queued_per_client:
            why = f"this client has {len(queue)} requests queued (limit {self.settings.max_queued_per_client})"
        elif self.pending() >= self.settings.max_queued:
            why = f"{self.pending()} requests are queued (limit {self.settings.max_queued})"
        elif (queued := self.queued_bytes()) + held > self.settings.max_queued_bytes:
            limit = size(self.settings.max_queued_bytes)
            why = f"queued requests hold {size(queued)}, this one {size(held)} (limit {limit})"
        else:
            self.queues[identity] = queue
            # Its clock starts at its arrival: one that came during a step (held by the server's
            # helper) waited for that step too; timed from here, a 1.2 s first token read 0.12 s.
            queue.append(Job(identity, msg, held=held, received=msg.received))
            return
        self.metrics.refuse(ErrorCode.BUSY.value)
        self.send(identity, encode_error(msg.id, ErrorCode.BUSY, why + "; retry later"))

    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def queued_bytes(self) -> int:
        return sum(job.held for q in self.queues.values() for job in q)

    def report(self) -> dict:
        """The `stats` reply: what was served since start, the queue now, and the drafter's state."""
        return ServedStats(
            model=self.target.name,  # the folder it was loaded from
            served=self.served,
            queued=self.pending(),
            running=len(self.active),
            max_batch=self.max_batch,
            proposer=self.proposer.name,
            drafter=drafter_state(self.proposers),
            prefill=self.pace.to_dict() if self.pace is not None else {"chunk": self.settings.prefill_chunk},
            prefix_cache=self.prefix_cache.to_dict() if self.prefix_cache is not None else None,
            **self.counters,
            **self.metrics.to_dict(),
        ).to_dict()

    def cancel(self, identity: bytes, request_id: int) -> None:
        """Stop a running or queued request; a cancel for one that is not here (done already) is ignored."""
        for active in self.active.values():
            job = active.job
            if job.identity == identity and job.request.id == request_id:
                if not job.cancel.is_set():
                    self.counters["cancelled"] += 1
                    job.cancel.set()
                return
        queue = self.queues.get(identity) or deque()
        for job in list(queue):
            if job.request.id == request_id:
                queue.remove(job)
                if not queue:  # else every client that queued, cancelled and left kept an entry (an audit)
                    del self.queues[identity]
                self.counters["cancelled"] += 1
                self.metrics.finish("cancelled")
                self.send(identity, cancelled(request_id))

    def abandon(self, identity: bytes, why: str, listening: bool = False) -> None:
        """The client is gone (or broke its heartbeat promise): stop its running requests and drop
        its queued ones, the queued answered `cancelled` in case anyone is still listening. A
        client that only fell silent (`listening`) may come back: its running requests end with
        `done`/`cancelled` too; one whose reply could not be delivered gets nothing more."""
        queued = list(self.queues.pop(identity, ()))
        for job in queued:
            self.metrics.finish("cancelled")
            self.server.send(identity, cancelled(job.request.id))
        jobs = list(queued)
        for active in self.active.values():
            job = active.job
            if job.identity == identity and not job.dropped:
                job.dropped, job.lost = True, job.lost or not listening
                job.cancel.set()
                jobs.append(job)
        if jobs:
            self.counters["abandoned"] += len(jobs)
            log.warning("client %s: %s; dropped its %d request(s)", identity.hex()[:16], why, len(jobs))

    def reap(self) -> None:
        """Abandon clients silent for HEARTBEAT_MISSES of the heartbeat interval they asked for
        (at most `max_silence`: a client's promise does not outlast the operator's bound), or,
        having promised none, for `max_silence`."""
        now = time.monotonic()
        jobs = [job for queue in self.queues.values() for job in queue]
        jobs += [active.job for active in self.active.values()]
        limit = self.settings.max_silence
        for job in jobs:
            interval = job.request["heartbeat_s"]
            heard = self.heard.get(job.identity, now)
            promised = min(HEARTBEAT_MISSES * interval, limit or math.inf)
            if interval > 0 and now - heard > promised:
                why = f"silent for {now - heard:.1f} s (promised a heartbeat every {interval:g} s"
                why += ")" if promised == HEARTBEAT_MISSES * interval else f"; --max-silence {limit:g} s)"
                self.abandon(job.identity, why, listening=True)
                continue
            # Without heartbeats promised, a client that takes its streamed replies is there too:
            # ZeroMQ refuses a reply once a client stops reading (its queue fills), or is gone.
            silent = now - max(heard, self.reached.get(job.identity, 0.0))
            if interval == 0 and 0 < limit < silent:
                why = f"silent for {silent:.1f} s, with no heartbeats promised (--max-silence {limit:g} s)"
                self.abandon(job.identity, why, listening=True)
        with_work = {job.identity for job in jobs}
        self.heard = {identity: self.heard[identity] for identity in with_work & set(self.heard)}
        self.reached = {identity: self.reached[identity] for identity in with_work & set(self.reached)}
        # Who was served when matters only while a client has work here: the rest is forgotten.
        self.last_served = {identity: n for identity, n in self.last_served.items() if identity in with_work}

    def next_job(self) -> Job | None:
        """Round-robin: of the clients waiting, the one with the fewest requests in slots gets its
        next job, and among equals the one served longest ago (never served: first, in line order).
        So a client that arrived while another's job runs goes before that client's next one, and one
        client's many requests share the free slots with everyone else's."""
        for identity in [i for i, queue in self.queues.items() if not queue]:
            del self.queues[identity]
        if not self.queues:
            return None
        running = Counter(active.job.identity for active in self.active.values())
        identity = min(self.queues, key=lambda i: (running[i], self.last_served.get(i, -1)))
        queue = self.queues[identity]
        job = queue.popleft()
        self.admissions += 1
        self.last_served[identity] = self.admissions
        return job

    def serve(
        self, address: str, stop: threading.Event, curve: ServerKeys | None = None, insecure_plaintext: bool = False
    ) -> None:
        self.server = Server(
            address,
            curve=curve,
            insecure_plaintext=insecure_plaintext,
            max_message_bytes=CONTROL_MAX_FRAME,
            receive_queue=RECEIVE_QUEUE,
        )
        log.info(
            "target daemon serving on %s%s, %s",
            self.server.address,
            " (CURVE)" if curve else "",
            "one request at a time" if self.max_batch == 1 else f"up to {self.max_batch} requests at once",
        )
        try:
            while not stop.is_set():
                self.pump(0 if self.active or self.pending() else 100)  # admission may have left some for now
                for proposer in self.proposers:  # a remote drafter's sessions stay this live target's
                    if proposer.backend is not None:
                        proposer.backend.keepalive()
                self.recorder_call("tick")  # a recorder writes out what it holds now and then
                if not (self.active or self.queues):
                    continue
                # Pings are answered during the step too: a prefill or a wide verify is never deaf.
                self.held = self.requests_held()
                with self.server.answering({"ping": self.pong, "heartbeat": self.heartbeat}):
                    self.admit()
                    if self.active:
                        self.advance()
        finally:
            try:
                self.end_unfinished()
            finally:
                self.server.close(linger_ms=SHUTDOWN_LINGER_MS)
                self.close_drafters()
                self.recorder_call("close")
                log.info("target daemon stopped")

    def recorder_call(self, name: str) -> None:
        """The recorder's `tick` (write out what it holds, now and then) or `close`, where it has
        them: what fails there (a full disk) is logged, and the daemon serves or stops all the same."""
        call = getattr(self.on_finished, name, None)
        if call is not None:
            try:
                call()
            except Exception:
                log.exception("could not write the recorded requests out")

    def close_drafters(self) -> None:
        """Close every slot's drafter session, all at once (each waits a moment for the daemon's
        word): a stopped target left them to the draft daemon's reclaim, and one restarted at
        --max-batch 32 within 30 s found its table full and served without drafts (an audit)."""
        backends = [proposer.backend for proposer in self.proposers if proposer.backend is not None]

        def close(backend) -> None:
            try:
                backend.close()
            except Exception:  # stopping all the same
                log.warning("could not close a drafter session", exc_info=True)

        closing = [threading.Thread(target=close, args=(backend,), daemon=True) for backend in backends]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join(CLOSE_DRAFTERS_S)

    def end_unfinished(self) -> None:
        """On the way out, every request running or queued is told it was not finished, as a
        restarted daemon tells its heartbeats: clients waited for a reply until their own
        timeout (300 s for dflash-client), the HTTP front end answers 503 at once (an audit)."""
        jobs = [a.job for a in self.active.values()] + [job for queue in self.queues.values() for job in queue]
        unfinished = [(job.identity, job.request.id) for job in jobs if not job.lost]
        # Requests that arrived during the last step and wait in the server, unread (the review
        # of the fix above): their senders were as sure of an answer.
        unfinished += [
            (who, msg.id) for who, msg in self.server.take_held() if isinstance(msg, Message) and msg.type == "generate"
        ]
        for identity, request_id in unfinished:
            why = "the target daemon is shutting down; not finished"
            try:
                self.server.send(identity, encode_error(request_id, ErrorCode.UNKNOWN_REQUEST, why))
            except Exception:  # never in place of what ended the loop
                log.warning("could not tell request %s the daemon is stopping", request_id, exc_info=True)

    # --- model side --------------------------------------------------------

    def decode_options(self, msg: Message, max_new_tokens: int) -> DecodeOptions:
        """A generate request's options, under this daemon's limits, settings and datastore."""
        lookup = self.settings.looks_up(self.proposer)
        datastore = self.built_datastore() if lookup else None
        return decode_options(msg, max_new_tokens, self.settings, self.adaptive, lookup, datastore)

    def built_datastore(self) -> Datastore | None:
        if isinstance(self.datastore, Future):
            if not self.datastore.done():
                return None
            self.datastore = self.datastore.result()
        return self.datastore

    def admit(self) -> None:
        """Queued requests into free slots, round-robin over clients; a request that cannot start
        (a bad field, too long for the model) is answered with its error and takes no slot.

        At most ADMIT_BUDGET_S of it a step (one request at least): tokenizing a 512K-character
        prompt takes up to a second, and a queue of them refused in one go stalled every running
        request for a minute (an audit); the rest wait for the next step."""
        began = time.monotonic()
        while self.free and time.monotonic() - began < ADMIT_BUDGET_S:
            job = self.next_job()
            if job is None:
                return
            msg, identity = job.request, job.identity
            slot = self.free[0]
            try:
                prompt = prompt_ids(self.target, msg)
                # The model's bound before this daemon's own limit: a request over both is told the
                # one it can act on (what OpenAI clients know as context_length_exceeded).
                options = self.decode_options(msg, answer_budget(self.target, self.settings, msg, len(prompt)))
                clock = RequestClock(job.received)
                proposer = self.proposers[slot]

                def on_commit(tokens: list[int], text: str, msg=msg, identity=identity, clock=clock) -> None:
                    clock.commit()
                    if msg["stream"]:
                        self.send(identity, encode("chunk", msg.id, {"text": text, "token_ids": tokens}))

                sequence = Sequence(
                    self.target,
                    prompt,
                    proposer,
                    options,
                    slot=slot,
                    on_commit=on_commit,
                    governor=self.governor.fork(),  # its own copy; what it learned is given back in `finish`
                )
                cache = self.prefix_cache
                hit = cache.lookup(prompt, proposer.taps, proposer.reach) if cache is not None else None
                if hit is not None:
                    sequence.reuse(hit.length, hit.kv, hit.features, hit.name, hit.features_from)
            except ProtocolError as exc:
                self.metrics.refuse(exc.code.value)
                self.send(identity, encode_error(msg.id, exc.code, exc.message))
                continue
            except ContextLengthError as exc:
                self.metrics.refuse(ErrorCode.CONTEXT_LENGTH.value)
                self.send(identity, encode_error(msg.id, ErrorCode.CONTEXT_LENGTH, str(exc)))
                continue
            except Exception as exc:  # one bad request must not take the daemon down
                self.fail(job, exc)
                continue
            counters = dict(proposer.backend.counters) if proposer.backend is not None else {}
            self.free.pop(0)
            queued_s = time.monotonic() - job.received
            self.metrics.admit(queued_s)
            self.active[slot] = Active(job, sequence, prompt, clock, queued_s, counters)

    def advance(self) -> None:
        """One batched forward for every active request, then the replies of those that finished."""
        for active in self.active.values():
            if active.job.cancel.is_set() and not active.sequence.done:
                active.sequence.cancel()
        running = [a for a in self.active.values() if not a.sequence.done]
        if running:
            try:
                step(self.target, [a.sequence for a in running], self.pace, waiting=self.pending() > 0)
            except Exception as exc:  # a failure inside a step: its requests end with the error
                for active in running:
                    self.fail(active.job, exc)
                    self.release(active)
                return
            for active in [a for a in running if a.sequence.failed is not None]:  # its own results raised
                self.fail(active.job, active.sequence.failed)
                self.release(active)
        if self.prefix_cache is not None:  # a prompt just in: a request arriving now may start from it
            for active in running:
                if not active.prompt_stored and not active.sequence.prefilling and active.sequence.failed is None:
                    active.prompt_stored = True
                    self.keep_prefix(active, drafter_too=False)
        for active in [a for a in self.active.values() if a.sequence.done]:
            try:
                self.finish(active)
            except Exception as exc:  # one request's end must not take the daemon down
                self.release(active)
                self.fail(active.job, exc)

    def finish(self, active: Active) -> None:
        job, msg = active.job, active.job.request
        result = active.sequence.result()
        if active.sequence.governor is not None:
            self.governor.absorb(active.sequence.governor)
        if self.prefix_cache is not None and result.finish_reason != "cancelled":
            self.keep_prefix(active, drafter_too=True)
        self.release(active)
        reply, refused = (None, None) if job.lost else self.done_reply(active, result)
        self.metrics.finish(result.finish_reason, result.stats, active.clock, refused=refused)
        self.served += 1
        if reply is None:
            return
        self.send(job.identity, reply)
        if self.on_finished is not None and result.finish_reason != "cancelled" and refused is None:
            try:  # after the reply: what fails here is the recorder's, never the request's (it had two replies)
                self.on_finished(msg, active.prompt, result)
            except Exception:
                log.exception("could not record request %s", msg.id)

    def keep_prefix(self, active: Active, drafter_too: bool) -> None:
        """The request's committed rows into the prefix cache (and, `drafter_too`, the drafter's
        context of them, where it keeps one). A shortcut for later requests: where it fails, this
        request and the daemon go on without it."""
        proposer = active.sequence.proposer
        try:
            tokens, rows, features, features_from = active.sequence.committed()
            name = self.prefix_cache.store(tokens, rows, features, proposer.taps, features_from)
            # A drafter keeps contexts from position 0, which a hit whose features start later never restores.
            if drafter_too and name is not None and proposer.taps and not features_from:
                proposer.keep(name, len(tokens))
        except Exception:
            log.exception("the prefix cache could not keep request %s's rows", active.job.request.id)

    def done_reply(self, active: Active, result: Result) -> tuple[bytes, str | None]:
        """The request's `done`, or `too_large` (and its code, for the metrics) where the wire refuses it."""
        msg = active.job.request
        done = {"text": result.text, "token_ids": result.tokens, "finish_reason": result.finish_reason}
        try:
            return encode("done", msg.id, {**done, "stats": self.stats(active, result)}), None
        except ProtocolError as exc:  # a raised --max-new-tokens-limit and long tokens: over what a reply holds
            streamed = " (its chunks carried all of it)" if msg["stream"] else ""
            reply = encode_error(
                msg.id,
                ErrorCode.TOO_LARGE,
                f"the answer, {len(result.tokens)} tokens and {len(result.text)} characters, is over what one "
                f"`done` reply carries{streamed}: ask for fewer max_new_tokens ({exc.message})",
            )
            return reply, ErrorCode.TOO_LARGE.value

    def release(self, active: Active) -> None:
        slot = active.sequence.slot
        if self.active.pop(slot, None) is not None:
            self.free.append(slot)
            self.free.sort()

    def fail(self, job: Job, exc: Exception) -> None:
        log.exception("request %s failed", job.request.id, exc_info=exc)
        self.metrics.refuse(ErrorCode.INTERNAL.value)
        if not job.lost:
            self.send(job.identity, encode_error(job.request.id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))

    def stats(self, active: Active, result: Result) -> dict:
        stats = result.stats.report()
        stats.proposer = self.proposer.name
        stats.queued_s = round(active.queued_s, 4)
        stats.batch = self.max_batch - len(self.free) + 1  # requests running when it ended, itself included
        backend = self.proposers[active.sequence.slot].backend
        if backend is not None:  # this request's own drafter figures, not the slot's since start
            before = active.drafter_before
            stats.drafter = {k: round(v - before.get(k, 0), 3) for k, v in backend.counters.items()}
        return stats.to_dict()


def unknown_request(request_id: int) -> list:
    """The answer to a heartbeat for a request this daemon does not hold: it ended (the client will
    have its `done`), or it never reached this process (a daemon restarted on the same address)."""
    why = f"request {request_id} is not running or queued here (ended, or sent before this daemon started)"
    return encode_error(request_id, ErrorCode.UNKNOWN_REQUEST, why)


def cancelled(request_id: int) -> list:
    """The `done` of a request stopped before it ran."""
    return encode("done", request_id, {"text": "", "token_ids": [], "finish_reason": "cancelled", "stats": {}})
