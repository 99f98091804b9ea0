"""A soak test: many clients against both daemons for a fixed time, with faults, counting every reply.

    python -m benchmarks.soak --minutes 10 --clients 16          # SmolLM2 and the shipped drafter
    python -m benchmarks.soak --tiny --seconds 30 --clients 6    # a tiny random pair (the CI form)

The target daemon (`--max-batch`, the remote drafter) and the draft daemon run as real
processes. Each client loops until the time is up, picking a request from a fixed pool (prompt
ids, length, greedy or seeded-sampled) and a way to behave:

- **normal**: streamed or not, with heartbeats or without. Its `done` must come. A greedy
  output must equal the same request run alone before the faults began, and streamed chunks
  must add up to the `done`.
- **cancel**: a cancel after the first chunk. A `done` must come, cancelled or finished.
- **die**: the socket is closed after the first chunk, with nothing said (a killed client).
- **silent**: heartbeats are promised, then the client stops reading and beating for longer
  than 3 beats. The daemon must drop the request, and the client's `done` must say cancelled,
  unless the answer ended before 3 beats (and a step) had passed.

Meanwhile:
- a pinger measures the target daemon's answers every 100 ms;
- the draft daemon is stopped (SIGSTOP) for 3 s, then later killed (SIGKILL) and restarted, in turns;
- both daemons' memory is sampled.

The target daemon's prefix cache is on, and small (`--prefix-cache-mb`), so it evicts: requests
repeat, and some prompts extend another's, so hits (whole and partial) come while entries are
evicted under them; the exactness checks above cover those requests too.

A reply for an id already answered is a duplicate; a request with no `done` within its
deadline is lost. The run fails (exit 1) on any wrong, lost or duplicated reply, or on any
ping slower than `--ping-bar-ms`, during the drafter's faults too: a stopped drafter stalls a
step for its `--draft-timeout`, and the target daemon answers pings meanwhile. Pings outside
the faults (from a fault until 2 s after it) are reported apart as well.

Seeded sampled outputs are checked for completion only. Their draws depend on the drafts
verified, which a stopped or restarted drafter changes (the distribution stays exact, the
sample does not).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from benchmarks.bench_serving import percentile
from launch.local import free_address, start_daemon
from launch.net import HelpFormatter
from launch.processes import ends_on_sigterm, rss_mb, stop
from protocol import Message, decode, encode
from protocol.transport import dealer, receive, request

KINDS = ("normal", "normal", "normal", "cancel", "die", "silent")
DEADLINE_S = 120.0  # a request not done by then is lost
FAULT_AFTERMATH_S = 2.0  # pings this long after a fault ends still count as during it
SILENCE_GRACE_S = 1.0  # past 3 missed beats, the longest a step may take before the daemon drops a silent request


class Tally:
    """What every client saw, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(
            ["sent", "done", "identical", "wrong", "lost", "duplicates", "cancelled", "died", "dropped_silent"]
            + ["silent_finished_first"],
            0,
        )
        self.latency: list[float] = []
        self.problems: list[str] = []

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)


def ask(spec: dict, stream: bool, heartbeat_s: float) -> dict:
    fields = {"token_ids": spec["prompt"], "max_new_tokens": spec["max_new"], "stream": stream}
    if spec["seed"] is not None:
        fields["sampling"] = {"temperature": 0.8, "top_k": 40, "seed": spec["seed"]}
    if heartbeat_s:
        fields["heartbeat_s"] = heartbeat_s
    return fields


class Replies:
    """One client socket's replies, by request id: a reply for an id already answered is a
    duplicate, whenever it arrives."""

    def __init__(self, sock: zmq.Socket, tally: Tally) -> None:
        self.sock, self.tally = sock, tally
        self.answered: set[int] = set()

    def next(self, request_id: int, until: float):
        while True:
            left = until - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000))):
                return None
            reply = decode(self.sock.recv_multipart())
            if reply.id == request_id:
                if reply.type in ("done", "error"):
                    self.answered.add(request_id)
                return reply
            if reply.id in self.answered and reply.type == "error" and reply["code"] == "unknown_request":
                continue  # a heartbeat that crossed its request's done: answered, as the protocol says
            if reply.id in self.answered:
                self.tally.add("duplicates")
                self.tally.problem(f"a {reply.type} for request id {reply.id} after its done")

    def done(self, request_id: int, heartbeat_s: float, until: float, chunks: list):
        """Replies to `request_id` until its `done` (or error), beating while waiting; None at `until`."""
        beat = time.monotonic() + heartbeat_s
        while time.monotonic() < until:
            if heartbeat_s and time.monotonic() >= beat:  # by the clock: chunks coming in are no beat
                self.sock.send_multipart(encode("heartbeat", request_id, {}))
                beat = time.monotonic() + heartbeat_s
            reply = self.next(request_id, min(until, beat if heartbeat_s else time.monotonic() + 1.0))
            if reply is None:
                continue
            if reply.type == "chunk":
                chunks.extend(reply["token_ids"])
                continue
            return reply
        return None


@dataclass
class Turn:
    """One request of a client's loop: what the checks of its `done` need, streamed chunks included."""

    rid: int
    index: int
    spec: dict
    kind: str
    stream: bool
    heartbeat: float
    began: float = 0.0
    chunks: list[int] = field(default_factory=list)


def draw(rng: random.Random, pool: list[dict], rid: int) -> Turn:
    """The next request and its behaviour; the draws keep their order, so a seed replays a run."""
    index = rng.randrange(len(pool))
    kind = rng.choice(KINDS)
    stream = kind != "normal" or rng.random() < 0.5
    heartbeat = 0.2 if kind == "silent" else rng.choice([0.0, 1.0])
    return Turn(rid, index, pool[index], kind, stream, heartbeat)


def send(replies: Replies, turn: Turn) -> None:
    fields = ask(turn.spec, turn.stream, turn.heartbeat)
    if turn.kind == "silent":  # long enough that its silence, not its length, ends it
        fields["max_new_tokens"] = 1000
    replies.sock.send_multipart(encode("generate", turn.rid, fields))
    replies.tally.add("sent")
    turn.began = time.monotonic()


def misbehave(replies: Replies, turn: Turn) -> Message | None:
    """Cancelling and falling silent only mean something once a request runs: both wait for its
    first chunk (a dying client's socket is its caller's, which replaces it). The first reply, or None."""
    first = replies.next(turn.rid, time.monotonic() + DEADLINE_S)
    if first is not None and first.type == "chunk":
        turn.chunks.extend(first["token_ids"])
        if turn.kind == "cancel":
            replies.sock.send_multipart(encode("cancel", turn.rid, {}))
            replies.tally.add("cancelled")
        elif turn.kind == "silent":
            time.sleep(5 * turn.heartbeat)  # no reading, no beating: past 3 missed beats
    elif first is not None and first.type == "done":  # it finished before a chunk came
        turn.chunks = first["token_ids"]
    return first


def judge(turn: Turn, done: Message | None, want: dict[int, list[int]], tally: Tally) -> None:
    """Each kind promises something else of its `done`; None: it never came, and is lost."""
    index, kind = turn.index, turn.kind
    if done is None:
        tally.add("lost")
        tally.problem(f"request {index} ({kind}) got no done in {DEADLINE_S:.0f} s")
        return
    if done.type == "error":
        tally.problem(f"request {index} ({kind}) got an error: {done['code']}: {done['message']}")
        tally.add("wrong")
        return
    tally.add("done")
    if kind == "silent":
        judge_silent(turn, done, tally)
    if kind == "normal":
        judge_normal(turn, done, want, tally)


def judge_silent(turn: Turn, done: Message, tally: Tally) -> None:
    # It never beats: 3 missed beats after its send, plus a step's grace, the daemon must have seen it.
    noticed_by = turn.began + 3 * turn.heartbeat + SILENCE_GRACE_S
    if done["finish_reason"] == "cancelled":
        tally.add("dropped_silent")
    elif time.monotonic() <= noticed_by:
        tally.add("silent_finished_first")  # its answer ended before its silence could count
    else:
        tally.add("wrong")
        tally.problem(f"request {turn.index}: its client fell silent, yet it ran to {done['finish_reason']}")


def judge_normal(turn: Turn, done: Message, want: dict[int, list[int]], tally: Tally) -> None:
    index, greedy = turn.index, turn.spec["seed"] is None
    tally.latency.append(time.monotonic() - turn.began)
    if turn.stream and turn.chunks != done["token_ids"]:
        tally.add("wrong")
        tally.problem(f"request {index}: streamed chunks differ from its done")
    elif done["finish_reason"] == "cancelled":
        tally.add("wrong")
        tally.problem(f"request {index}: cancelled, though its client kept its promises")
    elif greedy and done["token_ids"] != want[index]:
        tally.add("wrong")
        tally.problem(f"request {index}: output differs from the same request alone")
    elif greedy:
        tally.add("identical")


def client(address: str, pool: list[dict], want: dict[int, list[int]], tally: Tally, end: float, seed: int) -> None:
    rng = random.Random(seed)
    context = zmq.Context.instance()
    replies = Replies(dealer(context, address), tally)
    rid = 0
    try:
        while time.monotonic() < end:
            rid += 1
            turn = draw(rng, pool, rid)
            send(replies, turn)
            first = misbehave(replies, turn) if turn.kind in ("die", "cancel", "silent") else None
            if turn.kind == "die" and first is not None and first.type == "chunk":
                # Gone without a word; the next request comes from a new socket.
                replies.sock.close(0)
                replies = Replies(dealer(context, address), tally)
                tally.add("died")
                continue
            done = first if first is not None and first.type != "chunk" else None
            if done is None:
                heartbeat = turn.heartbeat if turn.kind != "silent" else 0.0
                done = replies.done(turn.rid, heartbeat, turn.began + DEADLINE_S, turn.chunks)
            judge(turn, done, want, tally)
        replies.next(-1, time.monotonic() + 1.0)  # late duplicates, after the last request
    finally:
        replies.sock.close(0)


def pinger(address: str, end: float, rtts: list[tuple[float, float]]) -> None:
    sock = dealer(zmq.Context.instance(), address)
    n = 0
    try:
        while time.monotonic() < end:
            n += 1
            sent = time.monotonic()
            sock.send_multipart(encode("ping", n, {}))
            reply = receive(sock, n, sent + 10, "ping")
            rtts.append((sent, time.monotonic() - sent if reply is not None else 10.0))
            time.sleep(max(0.0, 0.1 - (time.monotonic() - sent)))
    finally:
        sock.close(0)


def tiny_pair(folder: Path) -> tuple[Path, Path]:
    """A tiny random Llama (no EOS: requests run to their length) and a random drafter for it."""
    from draft_node.checkpoint import config_for_target, random_drafter, save_drafter
    from target_node.model.tiny import tiny_target

    target = tiny_target("llama", seed=1)
    target.model.config.eos_token_id = None
    target.model.generation_config.eos_token_id = None
    target.model.save_pretrained(folder / "model")
    drafter = save_drafter(random_drafter(config_for_target(target.config, block_size=4, taps=2)), folder / "drafter")
    return folder / "model", Path(drafter)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="the run's length")
    ap.add_argument("--seconds", type=float, help="the run's length in seconds (instead of --minutes)")
    ap.add_argument("--clients", type=int, default=16, help="clients sending at once, each a request after another")
    ap.add_argument("--tiny", action="store_true", help="a tiny random target and drafter (seconds to load)")
    ap.add_argument("--model", help="target model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", help="drafter checkpoint (default: the model's default drafter)")
    ap.add_argument("--max-batch", type=int, default=8, help="the target daemon's --max-batch")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per daemon")
    ap.add_argument("--chaos-every", type=float, default=20.0, help="seconds between drafter faults (0: none)")
    ap.add_argument("--ping-bar-ms", type=float, default=250.0, help="the slowest ping answer allowed under the load")
    ap.add_argument("--seed", type=int, default=0, help="seed of the requests and the clients' schedules")
    ap.add_argument(
        "--prefix-cache-mb", type=int, help="the target daemon's prefix cache (default: 1 tiny, 64 real: it evicts)"
    )
    ap.add_argument(
        "--keep-logs", action="store_true", help="keep the daemons' logs and models when the soak passes too"
    )
    ap.add_argument("--json", default="bench_results/soak.json", help="write the figures here")
    return ap.parse_args(argv)


def models(args: argparse.Namespace, work: Path) -> tuple[Path, Path, int, tuple[int, int]]:
    """The target and drafter, with the vocabulary and answer lengths that suit them: a tiny random
    model has a small vocabulary and answers fast."""
    if args.tiny:
        model, checkpoint = tiny_pair(work)
        return model, checkpoint, 300, (4, 48)
    from launch.common import resolve_model
    from target_node.model.default_model import ensure_default_drafter

    model = resolve_model(args.model)
    return model, Path(args.drafter or ensure_default_drafter(model)), 49152, (8, 64)


def request_pool(seed: int, vocab: int, lengths: tuple[int, int]) -> list[dict]:
    """Requests that repeat, a few of them long, some extending the one before: the prefix cache
    hits, wholly and partly, while it evicts."""
    rng = random.Random(seed)
    pool = []
    for i in range(24):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 40 if i % 7 else 600))]
        if i % 5 == 4:  # the previous prompt and more: a partial hit in the prefix cache
            prompt = pool[-1]["prompt"] + prompt[:20]
        pool.append(
            {"prompt": prompt, "max_new": rng.randint(*lengths), "seed": rng.randrange(1000) if i % 4 == 3 else None}
        )
    return pool


@dataclass
class Daemons:
    """Both daemon processes; the drafter's is replaced each time the chaos kills it."""

    drafter: subprocess.Popen
    target: subprocess.Popen
    draft_address: str
    target_address: str
    draft_args: list[str]
    draft_log: Path

    def restart_drafter(self) -> None:
        self.drafter.kill()
        self.drafter.wait()
        self.drafter = start_daemon(
            "draft daemon", "launch.draft_daemon", self.draft_address, self.draft_args, 300, log=self.draft_log
        )

    def stop(self) -> None:
        stop(self.target)
        stop(self.drafter)


def start_daemons(args: argparse.Namespace, model: Path, checkpoint: Path, work: Path) -> Daemons:
    prefix_mb = args.prefix_cache_mb if args.prefix_cache_mb is not None else (1 if args.tiny else 64)
    threads = ["--threads", str(args.threads)]
    draft_address, target_address = free_address(), free_address()
    draft_args = ["--checkpoint", str(checkpoint), *threads]
    target_args = ["--model", str(model), "--drafter", draft_address, "--max-batch", str(args.max_batch), *threads]
    # A stopped drafter stalls a step this long, then the fallback drafts: short, so pings keep their bar.
    target_args += ["--draft-timeout", "0.2", "--draft-retry", "1", "--prefix-cache-mb", str(prefix_mb)]
    drafter = start_daemon(
        "draft daemon", "launch.draft_daemon", draft_address, draft_args, 300, log=work / "draft.log"
    )
    try:
        target = start_daemon(
            "target daemon", "launch.target_daemon", target_address, target_args, 300, log=work / "target.log"
        )
    except BaseException:  # a target that would not start leaves no draft daemon behind
        stop(drafter)
        raise
    return Daemons(drafter, target, draft_address, target_address, draft_args, work / "draft.log")


def alone_outputs(address: str, pool: list[dict]) -> dict[int, list[int]]:
    """Each request run alone before any fault: what a greedy one must answer under load too."""
    want = {}
    for i, spec in enumerate(pool):
        sock = dealer(zmq.Context.instance(), address)
        sock.send_multipart(encode("generate", 1, ask(spec, False, 0.0)))
        reply = receive(sock, 1, time.monotonic() + DEADLINE_S, "generate")
        sock.close(0)
        if reply is None or reply.type != "done":
            raise SystemExit(f"request {i} alone failed: {reply}")
        want[i] = reply["token_ids"]
    return want


@dataclass
class Load:
    """What the run saw beside the clients' tally: ping round trips, memory, and the faults, with
    the windows in which a ping counts as during one (from a fault until a while after it)."""

    tally: Tally
    began: float
    rtts: list[tuple[float, float]]
    rss: list[dict] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)


def run_load(args: argparse.Namespace, daemons: Daemons, pool: list[dict], want: dict, seconds: float) -> Load:
    """The clients and the pinger until the time is up, while memory is sampled and the drafter faults."""
    tally, rtts = Tally(), []
    end = time.monotonic() + seconds
    address = daemons.target_address
    # Daemon threads: a soak stopped by a signal stops its daemons and ends, instead of waiting on
    # requests to daemons that are gone (up to 120 s each, a review).
    workers = [threading.Thread(target=pinger, args=(address, end, rtts), daemon=True)]
    workers += [
        threading.Thread(target=client, args=(address, pool, want, tally, end, args.seed * 1000 + c), daemon=True)
        for c in range(args.clients)
    ]
    for w in workers:
        w.start()
    load = Load(tally, time.monotonic(), rtts)
    next_fault = time.monotonic() + args.chaos_every
    while any(w.is_alive() for w in workers):
        now = time.monotonic()
        load.rss.append(
            {
                "t": round(now - load.began, 1),
                "target_mb": round(rss_mb(daemons.target.pid), 1),
                "draft_mb": round(rss_mb(daemons.drafter.pid), 1),
            }
        )
        if args.chaos_every and now >= next_fault and now < end - 5:
            fault(daemons, load, now)
            next_fault = time.monotonic() + args.chaos_every
        time.sleep(1.0)
    return load


def fault(daemons: Daemons, load: Load, now: float) -> None:
    """The drafter stopped for 3 s, or killed and restarted, in turns."""
    if len(load.faults) % 2 == 0:
        daemons.drafter.send_signal(signal.SIGSTOP)
        time.sleep(3)
        daemons.drafter.send_signal(signal.SIGCONT)
        what = "drafter stopped 3 s"
    else:
        daemons.restart_drafter()
        what = "drafter killed and restarted"
    load.faults.append({"t": round(now - load.began, 1), "fault": what})
    load.windows.append((now, time.monotonic() + FAULT_AFTERMATH_S))


def figures(load: Load, ping_bar_ms: float) -> dict:
    """The report's latency, ping, memory and fault figures."""
    rtts, rss, tally = load.rtts, load.rss, load.tally
    slow = [{"t": round(t - load.began, 1), "ms": round(1000 * r)} for t, r in rtts if r > ping_bar_ms / 1000]
    return dict(
        latency_p50_s=round(percentile(tally.latency, 0.5), 3),
        latency_p99_s=round(percentile(tally.latency, 0.99), 3),
        pings=len(rtts),
        ping_p99_ms=round(1000 * percentile([r for _, r in rtts], 0.99), 1),
        ping_max_ms=round(1000 * max((r for _, r in rtts), default=0.0), 1),
        ping_max_ms_outside_faults=round(
            1000 * max((r for t, r in rtts if not any(a <= t <= b for a, b in load.windows)), default=0.0), 1
        ),
        slow_pings=slow[:20],
        target_rss_mb={
            "start": rss[0]["target_mb"],
            "max": max(r["target_mb"] for r in rss),
            "end": rss[-1]["target_mb"],
        },
        faults=load.faults,
        problems=tally.problems[:20],
        rss=rss,
    )


def finish(report: dict, args: argparse.Namespace) -> dict:
    """The verdict: written with the report, printed, and the exit status (1) when it failed."""
    pings_ok = report["ping_max_ms"] <= args.ping_bar_ms
    ok = not (report["wrong"] or report["lost"] or report["duplicates"]) and pings_ok
    report["ok"] = ok
    if ok and not args.keep_logs:
        report["logs"] = None  # removed once the report is out
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    summary = {k: v for k, v in report.items() if k not in ("rss", "problems")}
    print(json.dumps(summary, indent=1))
    for problem in report["problems"]:
        print("problem:", problem)
    print(f"{'ok' if ok else 'FAILED'}; wrote {out}")
    if not ok:
        raise SystemExit(1)
    return report


@ends_on_sigterm
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    seconds = args.seconds if args.seconds is not None else 60 * args.minutes
    work = Path(tempfile.mkdtemp(prefix="dflash-soak-"))
    model, checkpoint, vocab, lengths = models(args, work)
    pool = request_pool(args.seed, vocab, lengths)
    daemons = start_daemons(args, model, checkpoint, work)
    report: dict = {"seconds": seconds, "clients": args.clients, "tiny": args.tiny, "logs": str(work)}
    try:
        want = alone_outputs(daemons.target_address, pool)
        load = run_load(args, daemons, pool, want, seconds)
        stats = request(daemons.target_address, "stats", timeout_s=10)
        report["prefix_cache"] = stats["stats"]["prefix_cache"] if stats is not None else None
        report.update(load.tally.counts)
        report.update(figures(load, args.ping_bar_ms))
    finally:
        daemons.stop()
    finish(report, args)  # a failed soak exits here, its logs kept for the reader
    if not args.keep_logs:  # 0.9 MB of models and logs a run, left in /tmp by every test run (an audit)
        shutil.rmtree(work, ignore_errors=True)
    return report


if __name__ == "__main__":
    main()
