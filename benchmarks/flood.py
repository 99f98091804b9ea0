"""Hostile load against a real target daemon, with figures: what tests/ checks in short forms.

    python -m benchmarks.flood --threads 1                 # SmolLM2 (--model for another)
    python -m benchmarks.flood --refusals 300 --flood-pings 300 --prompt-tokens 600   # quicker

Three scenarios, each on a fresh target daemon process (`--proposer none`):

- **refusals**: `--refusals` requests refused at admission (over `--max-new-tokens-limit`),
  one at a time, then as many pipelined: each must be answered, the daemon must live, and the
  next request must equal plain greedy decoding (about 1,500 of them used to kill the daemon).
- **flood during a long step**: one unpaced forward over a long prompt, while one client sends
  `--flood-pings` pings and 300 stats requests at once, a probe pings every 50 ms (each must be
  answered within `--ping-bar-ms`), and a client heartbeating every 0.1 s (promised 0.2 s) runs a
  request that must not be cancelled as silent.
- **long prompt**: a `--prompt-tokens` prompt's time to first token with default pacing against
  the same prompt in one forward, in turns (`--rounds`), with a probe's pings answered meanwhile.

Exit 1 when a bound is missed; `--out` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import zmq

from frontend.target_client import TargetClient
from launch.common import resolve_model
from launch.local import daemon, free_address
from launch.net import HelpFormatter
from launch.processes import ends_on_sigterm
from protocol import decode, encode
from protocol.transport import dealer, receive, request
from target_node.model.target import POSITION_FIELDS

LIMIT = 64  # --max-new-tokens-limit of the daemons here: one more is refused


class Prober:
    """Pings a daemon every `every_s` from its own socket until stopped; keeps each round trip."""

    def __init__(self, address: str, every_s: float = 0.05) -> None:
        self.address, self.every_s = address, every_s
        self.rtts: list[float] = []
        self.lost = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Prober:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    def _run(self) -> None:
        sock = dealer(zmq.Context.instance(), self.address)
        try:
            while not self.done.is_set():
                sent = time.monotonic()
                rid = len(self.rtts) + self.lost + 1
                sock.send_multipart(encode("ping", rid, {}))
                if receive(sock, rid, sent + 5.0) is None:
                    self.lost += 1
                else:
                    self.rtts.append(time.monotonic() - sent)
                time.sleep(self.every_s)
        finally:
            sock.close(0)

    def figures(self) -> dict:
        slowest = max(self.rtts, default=0.0)
        return {"pings": len(self.rtts), "lost": self.lost, "slowest_ms": round(slowest * 1000, 1)}


@contextmanager
def target(args: argparse.Namespace, extra: list[str]) -> Iterator[tuple[str, subprocess.Popen]]:
    """A target daemon process on a free address, plain decoding, `extra` flags: (address, process)."""
    flags = ["--model", str(args.model), "--proposer", "none", "--max-new-tokens-limit", str(LIMIT)]
    flags += ["--threads", str(args.threads), *extra]
    address = free_address()
    with daemon("target daemon", "launch.target_daemon", address, flags, args.ready_timeout) as proc:
        yield address, proc


def greedy_ids(address: str, prompt: list[int], n: int) -> list[int]:
    client = TargetClient(address, timeout_s=600, heartbeat_s=0)
    try:
        return client.generate(token_ids=prompt, max_new_tokens=n, stream=False)["token_ids"]
    finally:
        client.close()


def refusals(args: argparse.Namespace, prompt: list[int]) -> dict:
    with target(args, []) as (address, proc):
        plain = greedy_ids(address, prompt, 16)
        sock = dealer(zmq.Context.instance(), address)
        over = {"token_ids": prompt, "max_new_tokens": LIMIT + 1, "stream": False}
        codes: Counter = Counter()
        began = time.monotonic()
        try:
            for rid in range(1, args.refusals + 1):
                sock.send_multipart(encode("generate", rid, over))
                reply = receive(sock, rid, time.monotonic() + 30)
                codes[reply["code"] if reply is not None else "unanswered"] += 1
            for rid in range(args.refusals + 1, 2 * args.refusals + 1):
                sock.send_multipart(encode("generate", rid, over))
            answered = 0
            while answered < args.refusals and sock.poll(30_000):
                codes[decode(sock.recv_multipart())["code"]] += 1
                answered += 1
            codes["unanswered"] += args.refusals - answered
        finally:
            sock.close(0)
        seconds = time.monotonic() - began
        alive = proc.poll() is None
        after = greedy_ids(address, prompt, 16) if alive else []
    result = {"refused": dict(codes), "seconds": round(seconds, 2), "alive": alive, "next_is_plain": after == plain}
    result["ok"] = alive and after == plain and not codes["unanswered"]
    return result


def flood_during_a_step(args: argparse.Namespace, prompt: list[int], small: list[int]) -> dict:
    with target(args, ["--prefill-budget-ms", "0", "--prefill-chunk", "0"]) as (address, proc):
        plain_small = greedy_ids(address, small, 24)
        context = zmq.Context.instance()
        asker, flooder = dealer(context, address), dealer(context, address)
        beater = TargetClient(address, timeout_s=600, heartbeat_s=0.1)
        beaten: list = []

        def beat() -> None:
            try:
                beaten.append(beater.generate(token_ids=small, max_new_tokens=24, heartbeat_s=0.2, stream=False))
            except Exception as exc:  # a refusal or a cancel: reported below
                beaten.append({"finish_reason": f"error: {exc}", "token_ids": []})

        try:
            with Prober(address) as prober:
                began = time.monotonic()
                asker.send_multipart(encode("generate", 1, {"token_ids": prompt, "max_new_tokens": 1, "stream": False}))
                beating = threading.Thread(target=beat, daemon=True)
                beating.start()
                time.sleep(0.2)
                for i in range(args.flood_pings):
                    flooder.send_multipart(encode("ping", i + 1, {}))
                for i in range(300):
                    flooder.send_multipart(encode("stats", 1_000_000 + i, {}))
                reply = receive(asker, 1, time.monotonic() + 600)
                step_s = time.monotonic() - began
                beating.join(600)
            replies = Counter()
            while flooder.poll(1000):
                answer = decode(flooder.recv_multipart())
                replies[answer.type if answer.type != "error" else answer["code"]] += 1
        finally:
            asker.close(0)
            flooder.close(0)
            beater.close()
        alive = proc.poll() is None and request(address, "ping", timeout_s=5) is not None
    beat_ok = bool(beaten) and beaten[0]["finish_reason"] == "length" and beaten[0]["token_ids"] == plain_small
    probe = prober.figures()
    # The long step must have run: an error reply (a prompt past the model's context) came back at
    # once, and the flood then met no long step at all, yet passed (an audit).
    long_step = "no reply" if reply is None else reply.type if reply.type != "error" else f"error: {reply['code']}"
    ok = alive and long_step == "done" and beat_ok and not probe["lost"] and probe["slowest_ms"] <= args.ping_bar_ms
    return {
        "long_step": long_step,
        "long_step_s": round(step_s, 2),
        "probe": probe,
        "flood_replies": dict(replies),
        "heartbeating_client": beaten[0]["finish_reason"] if beaten else "no reply",
        "alive": alive,
        "ok": ok,
    }


def long_prompt(args: argparse.Namespace, prompt: list[int]) -> dict:
    """TTFT with default pacing against one forward, in turns (ABBA), each on a warm daemon."""
    ways = {"paced": [], "one_forward": ["--prefill-budget-ms", "0", "--prefill-chunk", "0"]}
    ttft: dict[str, list[float]] = {way: [] for way in ways}
    probes: dict[str, list[dict]] = {way: [] for way in ways}
    for round_ in range(args.rounds):
        order = list(ways.items()) if round_ % 2 == 0 else list(ways.items())[::-1]  # ABBA: no way always first
        for way, extra in order:
            with target(args, extra) as (address, _):
                greedy_ids(address, prompt[:64], 2)  # warm
                client = TargetClient(address, timeout_s=600, heartbeat_s=0)
                with Prober(address) as prober:
                    began = time.monotonic()
                    for _chunk in client.stream(token_ids=prompt, max_new_tokens=1):
                        break
                    ttft[way].append(time.monotonic() - began)
                client.close()
                probes[way].append(prober.figures())
    best = {way: min(times) for way, times in ttft.items()}
    ratio = best["paced"] / best["one_forward"]
    # Every round's probe: the last round's alone hid pings lost in the others (an audit).
    paced = {
        "pings": sum(p["pings"] for p in probes["paced"]),
        "lost": sum(p["lost"] for p in probes["paced"]),
        "slowest_ms": max(p["slowest_ms"] for p in probes["paced"]),
    }
    return {
        "prompt_tokens": len(prompt),
        "ttft_s": {way: [round(t, 2) for t in times] for way, times in ttft.items()},
        "paced_vs_one_forward": round(ratio, 3),
        "probe_while_paced": paced,
        "ok": ratio <= 1.1 and not paced["lost"],
    }


@ends_on_sigterm
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.flood", description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--model", help="target model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of the target daemon")
    ap.add_argument("--refusals", type=int, default=3000, help="refused requests, one at a time and as many pipelined")
    ap.add_argument("--flood-pings", type=int, default=3000, help="pings one client sends during the long step")
    ap.add_argument("--prompt-tokens", type=int, default=3000, help="the long prompt's tokens")
    ap.add_argument("--rounds", type=int, default=2, help="turns of each way for the long prompt's TTFT")
    ap.add_argument("--ping-bar-ms", type=float, default=250.0, help="the slowest ping answer allowed under the flood")
    ap.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for the daemon to serve")
    ap.add_argument("--only", choices=("refusals", "flood", "long_prompt"), help="run one scenario")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    args.model = resolve_model(args.model)
    config = json.loads((Path(args.model) / "config.json").read_text())
    text = config.get("text_config") or config  # where a multimodal model keeps its decoder's
    vocab = text.get("vocab_size", config.get("vocab_size"))
    context = next((text[name] for name in POSITION_FIELDS if isinstance(text.get(name), int)), None)
    if context is not None and args.prompt_tokens + 1 > context:
        ap.error(f"--prompt-tokens {args.prompt_tokens}: the model holds {context} positions, the prompt and a token")
    rng = random.Random(0)
    prompt = [rng.randrange(vocab // 2, vocab) for _ in range(args.prompt_tokens)]
    small = [rng.randrange(vocab // 2, vocab) for _ in range(12)]
    scenarios = {
        "refusals": lambda: refusals(args, small),
        "flood": lambda: flood_during_a_step(args, prompt, small),
        "long_prompt": lambda: long_prompt(args, prompt),
    }
    result = {}
    for name, run in scenarios.items():
        if args.only in (None, name):
            result[name] = run()
            print(json.dumps({name: result[name]}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if not all(r["ok"] for r in result.values()):
        print("flood: a bound was missed", file=sys.stderr)
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
