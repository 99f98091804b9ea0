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
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from benchmarks.bench_serving import percentile
from launch.local import colocated_env, free_address
from launch.processes import rss_mb, stop
from protocol import decode, encode
from protocol.transport import dealer, receive, request, wait_ready

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


def client(address: str, pool: list[dict], want: dict[int, list[int]], tally: Tally, end: float, seed: int) -> None:
    rng = random.Random(seed)
    context = zmq.Context.instance()
    sock = dealer(context, address)
    replies = Replies(sock, tally)
    next_id = 0
    try:
        while time.monotonic() < end:
            index = rng.randrange(len(pool))
            spec, kind = pool[index], rng.choice(KINDS)
            next_id += 1
            rid = next_id
            stream = kind != "normal" or rng.random() < 0.5
            heartbeat = 0.2 if kind == "silent" else rng.choice([0.0, 1.0])
            fields = ask(spec, stream, heartbeat)
            if kind == "silent":  # long enough that its silence, not its length, ends it
                fields["max_new_tokens"] = 1000
            sock.send_multipart(encode("generate", rid, fields))
            tally.add("sent")
            began = time.monotonic()
            chunks: list[int] = []
            first = None
            if kind in ("die", "cancel", "silent"):
                first = replies.next(rid, time.monotonic() + DEADLINE_S)  # its first chunk
                if first is not None and first.type == "chunk":
                    chunks.extend(first["token_ids"])
                    if kind == "die":  # gone without a word; the next request comes from a new socket
                        sock.close(0)
                        sock = dealer(context, address)
                        replies = Replies(sock, tally)
                        tally.add("died")
                        continue
                    if kind == "cancel":
                        sock.send_multipart(encode("cancel", rid, {}))
                        tally.add("cancelled")
                    else:
                        time.sleep(5 * heartbeat)  # no reading, no beating: past 3 missed beats
                elif first is not None:  # it finished (or failed) before a chunk came
                    chunks = first["token_ids"] if first.type == "done" else chunks
            done = first if first is not None and first.type != "chunk" else None
            if done is None:
                done = replies.done(rid, heartbeat if kind != "silent" else 0.0, began + DEADLINE_S, chunks)
            if done is None:
                tally.add("lost")
                tally.problem(f"request {index} ({kind}) got no done in {DEADLINE_S:.0f} s")
                continue
            if done.type == "error":
                tally.problem(f"request {index} ({kind}) got an error: {done['code']}: {done['message']}")
                tally.add("wrong")
                continue
            tally.add("done")
            if kind == "silent":
                # It never beats: 3 missed beats after its send, plus a step's grace, the daemon must have seen it.
                noticed_by = began + 3 * heartbeat + SILENCE_GRACE_S
                if done["finish_reason"] == "cancelled":
                    tally.add("dropped_silent")
                elif time.monotonic() <= noticed_by:
                    tally.add("silent_finished_first")  # its answer ended before its silence could count
                else:
                    tally.add("wrong")
                    tally.problem(f"request {index}: its client fell silent, yet it ran to {done['finish_reason']}")
            if kind == "normal":
                tally.latency.append(time.monotonic() - began)
                if stream and chunks != done["token_ids"]:
                    tally.add("wrong")
                    tally.problem(f"request {index}: streamed chunks differ from its done")
                elif done["finish_reason"] == "cancelled":
                    tally.add("wrong")
                    tally.problem(f"request {index}: cancelled, though its client kept its promises")
                elif spec["seed"] is None and done["token_ids"] != want[index]:
                    tally.add("wrong")
                    tally.problem(f"request {index}: output differs from the same request alone")
                elif spec["seed"] is None:
                    tally.add("identical")
        replies.next(-1, time.monotonic() + 1.0)  # late duplicates, after the last request
    finally:
        sock.close(0)


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


def spawn(module: str, address: str, args: list[str], log: Path) -> subprocess.Popen:
    out = open(log, "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--bind", address, *args], env=colocated_env(), stdout=out, stderr=out
    )
    if not wait_ready(address, 300, alive=lambda: proc.poll() is None):
        raise SystemExit(f"{module} did not become ready at {address}; see {log}")
    return proc


def tiny_pair(folder: Path) -> tuple[Path, Path]:
    """A tiny random Llama (no EOS: requests run to their length) and a random drafter for it."""
    from draft_node.checkpoint import config_for_target, random_drafter, save_drafter
    from target_node.model.tiny import tiny_target

    target = tiny_target("llama", seed=1)
    target.model.config.eos_token_id = None
    target.model.generation_config.eos_token_id = None
    target.model.save_pretrained(folder / "model")
    drafter = save_drafter(
        random_drafter(config_for_target(target.config, block_size=4, num_taps=2)), folder / "drafter"
    )
    return folder / "model", Path(drafter)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, help="the run's length in seconds (instead of --minutes)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="a tiny random target and drafter (seconds to load)")
    ap.add_argument("--model", help="target model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", help="drafter checkpoint (default: the model's default drafter)")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per daemon")
    ap.add_argument("--chaos-every", type=float, default=20.0, help="seconds between drafter faults (0: none)")
    ap.add_argument("--ping-bar-ms", type=float, default=250.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--prefix-cache-mb", type=int, help="the target daemon's prefix cache (default: 1 tiny, 64 real: it evicts)"
    )
    ap.add_argument("--json", default="bench_results/soak.json")
    args = ap.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else 60 * args.minutes
    work = Path(tempfile.mkdtemp(prefix="dflash-soak-"))
    if args.tiny:
        model, checkpoint = tiny_pair(work)
        vocab, lengths = 300, (4, 48)
    else:
        from launch.common import ensure_default_drafter, resolve_model

        model = resolve_model(args.model)
        checkpoint = Path(args.drafter or ensure_default_drafter(model))
        vocab, lengths = 49152, (8, 64)
    rng = random.Random(args.seed)
    pool = []
    for i in range(24):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 40 if i % 7 else 600))]
        if i % 5 == 4:  # the previous prompt and more: a partial hit in the prefix cache
            prompt = pool[-1]["prompt"] + prompt[:20]
        pool.append(
            {"prompt": prompt, "max_new": rng.randint(*lengths), "seed": rng.randrange(1000) if i % 4 == 3 else None}
        )
    prefix_mb = args.prefix_cache_mb if args.prefix_cache_mb is not None else (1 if args.tiny else 64)
    threads = ["--threads", str(args.threads)]
    draft_address, target_address = free_address(), free_address()
    draft_args = ["--checkpoint", str(checkpoint), *threads]
    target_args = ["--model", str(model), "--drafter", draft_address, "--max-batch", str(args.max_batch), *threads]
    # A stopped drafter stalls a step this long, then the fallback drafts: short, so pings keep their bar.
    target_args += ["--draft-timeout", "0.2", "--draft-retry", "1", "--prefix-cache-mb", str(prefix_mb)]
    drafter = spawn("launch.draft_daemon", draft_address, draft_args, work / "draft.log")
    target = spawn("launch.target_daemon", target_address, target_args, work / "target.log")
    report: dict = {"seconds": seconds, "clients": args.clients, "tiny": args.tiny, "logs": str(work)}
    try:
        want = {}
        for i, spec in enumerate(pool):  # each request alone, before any fault
            sock = dealer(zmq.Context.instance(), target_address)
            sock.send_multipart(encode("generate", 1, ask(spec, False, 0.0)))
            reply = receive(sock, 1, time.monotonic() + DEADLINE_S, "generate")
            sock.close(0)
            if reply is None or reply.type != "done":
                raise SystemExit(f"request {i} alone failed: {reply}")
            want[i] = reply["token_ids"]
        tally, rtts, rss = Tally(), [], []
        end = time.monotonic() + seconds
        workers = [threading.Thread(target=pinger, args=(target_address, end, rtts))]
        workers += [
            threading.Thread(target=client, args=(target_address, pool, want, tally, end, args.seed * 1000 + c))
            for c in range(args.clients)
        ]
        for w in workers:
            w.start()
        faults, began, next_fault = [], time.monotonic(), time.monotonic() + args.chaos_every
        windows: list[tuple[float, float]] = []  # from a fault until a while after it is over
        while any(w.is_alive() for w in workers):
            now = time.monotonic()
            rss.append(
                {
                    "t": round(now - began, 1),
                    "target_mb": round(rss_mb(target.pid), 1),
                    "draft_mb": round(rss_mb(drafter.pid), 1),
                }
            )
            if args.chaos_every and now >= next_fault and now < end - 5:
                if len(faults) % 2 == 0:
                    drafter.send_signal(signal.SIGSTOP)
                    time.sleep(3)
                    drafter.send_signal(signal.SIGCONT)
                    faults.append({"t": round(now - began, 1), "fault": "drafter stopped 3 s"})
                    windows.append((now, time.monotonic() + FAULT_AFTERMATH_S))
                else:
                    drafter.kill()
                    drafter.wait()
                    drafter = spawn("launch.draft_daemon", draft_address, draft_args, work / "draft.log")
                    faults.append({"t": round(now - began, 1), "fault": "drafter killed and restarted"})
                    windows.append((now, time.monotonic() + FAULT_AFTERMATH_S))
                next_fault = time.monotonic() + args.chaos_every
            time.sleep(1.0)
        stats = request(target_address, "stats", timeout_s=10)
        report["prefix_cache"] = stats["stats"]["prefix_cache"] if stats is not None else None
        report.update(tally.counts)
        report.update(
            latency_p50_s=round(percentile(tally.latency, 0.5), 3),
            latency_p99_s=round(percentile(tally.latency, 0.99), 3),
            pings=len(rtts),
            ping_p99_ms=round(1000 * percentile([r for _, r in rtts], 0.99), 1),
            ping_max_ms=round(1000 * max((r for _, r in rtts), default=0.0), 1),
            ping_max_ms_outside_faults=round(
                1000 * max((r for t, r in rtts if not any(a <= t <= b for a, b in windows)), default=0.0), 1
            ),
            slow_pings=[
                {"t": round(t - began, 1), "ms": round(1000 * r)} for t, r in rtts if r > args.ping_bar_ms / 1000
            ][:20],
            target_rss_mb={
                "start": rss[0]["target_mb"],
                "max": max(r["target_mb"] for r in rss),
                "end": rss[-1]["target_mb"],
            },
            faults=faults,
            problems=tally.problems[:20],
            rss=rss,
        )
    finally:
        stop(target)
        stop(drafter)
    pings_ok = report["ping_max_ms"] <= args.ping_bar_ms
    ok = not (report["wrong"] or report["lost"] or report["duplicates"]) and pings_ok
    report["ok"] = ok
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


if __name__ == "__main__":
    main()
