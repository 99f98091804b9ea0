"""Multi-turn chats with and without the prefix cache, in one run: time to first token by turn.

Two target daemons on one model (the prefix cache on, and `--prefix-cache-mb 0`), each behind its
own dflash-serve, all real processes. N conversations of T turns share a system prompt of about
170 tokens; each turn's prompt is the whole history (the answers included) plus a new question,
sent streaming and greedy, all N at once, to one way and then the other (which goes first
alternates by turn, so drift in the machine's load favours neither). The answers of the two ways
must be identical (checked); the second way's history is the first's. Printed: TTFT p50 / p95 by
turn for each way, tokens/s over the run, the tau each daemon reports, and the prompt tokens the
cache gave. `--path msgpack` sends the same chats with the msgpack client instead of HTTP.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

from benchmarks.bench_http import stream_chat
from benchmarks.bench_serving import percentile
from frontend.target_client import TargetClient
from launch.common import resolve_model
from launch.local import daemon, free_address, free_port
from launch.net import HelpFormatter
from launch.processes import ends_on_sigterm
from launch.serve import front_end
from protocol.transport import request

SYSTEM = (
    "You are a careful assistant for a small engineering team. Answer in plain English, in short "
    "paragraphs, and keep each answer focused on the question asked. When a question is about code, "
    "prefer Python, show a short example, and explain what it does in one or two sentences. When a "
    "question is about a fact you are unsure of, say so instead of guessing. Do not repeat the "
    "question back. Use lists only when the answer is a sequence of steps or a set of options. "
    "Keep units and numbers exact, and round only when asked. If the user asks for a summary, keep "
    "it under five sentences. If the user asks you to compare things, give one line per difference. "
    "Be polite but brief, and never invent references, links or quotations."
)
QUESTIONS = [
    [
        "What is a hash table?",
        "How does it handle collisions?",
        "Show a tiny Python example.",
        "What is its worst-case lookup time?",
        "How do Python dicts keep insertion order?",
        "When would a sorted list beat it?",
        "Summarise what we discussed.",
        "Give one exercise to practise this.",
    ],
    [
        "How do I plan a vegetable garden?",
        "Which vegetables are easiest for beginners?",
        "How often should I water them?",
        "What about pests?",
        "Can I grow them in pots?",
        "How much sun do tomatoes need?",
        "Summarise the plan in five steps.",
        "What should I plant first?",
    ],
    [
        "Explain what a unit test is.",
        "How is it different from an integration test?",
        "Write a pytest test for a function that adds two numbers.",
        "What is a fixture?",
        "How do I test code that reads a file?",
        "What is mocking, and when is it a bad idea?",
        "Summarise the advice.",
        "Name one common testing mistake.",
    ],
]


def ask_http(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)
    try:
        text, usage, began, first = stream_chat(client, model, messages, max_tokens)
    finally:
        client.close()
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return answer(text, usage.completion_tokens, usage.prompt_tokens, cached, began, first)


def ask_msgpack(address: str, messages: list[dict], max_tokens: int) -> dict:
    client = TargetClient(address, timeout_s=900)
    began, first, pieces = time.perf_counter(), None, []
    try:
        for reply in client.stream(messages=messages, max_new_tokens=max_tokens, sampling={"temperature": 0.0}):
            if reply.type == "chunk" and reply["text"]:
                first = first or time.perf_counter()
                pieces.append(reply["text"])
    finally:
        client.close()
    stats = reply["stats"]
    return answer("".join(pieces), stats["new_tokens"], stats["prompt_tokens"], stats["cached_tokens"], began, first)


def answer(text: str, tokens: int, prompt: int, cached: int, began: float, first: float | None) -> dict:
    ttft = (first or time.perf_counter()) - began
    return {"text": text, "tokens": tokens, "prompt_tokens": prompt, "cached_tokens": cached, "ttft_s": ttft}


@contextmanager
def endpoints(ways: dict[str, list[str]], flags: list[str], path: str) -> Iterator[tuple[dict, dict]]:
    """Each way's target daemon (and dflash-serve for HTTP) up: (way -> ask(messages, max_tokens),
    way -> the daemon's address)."""
    asks, addresses = {}, {}
    with ExitStack() as stack:
        for way, extra in ways.items():
            address = free_address()
            stack.enter_context(
                daemon(f"target daemon ({way})", "launch.target_daemon", address, [*flags, *extra], 300)
            )
            addresses[way] = address
            if path == "http":
                front = ["--target", address, "--served-model-name", "bench", "--log-level", "warning"]
                url = stack.enter_context(front_end(free_port(), front))
                asks[way] = lambda m, n, url=url: ask_http(url, "bench", m, n)
            else:
                asks[way] = lambda m, n, address=address: ask_msgpack(address, m, n)
        yield asks, addresses


def run(args: argparse.Namespace) -> dict:
    model = resolve_model(args.model)
    flags = ["--model", str(model), "--proposer", args.proposer, "--threads", str(args.threads)]
    ways = {"cached": [], "uncached": ["--prefix-cache-mb", "0"]}
    chats = [[{"role": "system", "content": SYSTEM}] for _ in range(args.conversations)]
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.conversations)]
    by_way: dict[str, list[list[dict]]] = {way: [] for way in ways}  # per turn, per conversation
    seconds = dict.fromkeys(ways, 0.0)
    with endpoints(ways, flags, args.path) as (asks, addresses):
        for turn in range(args.turns):
            for chat, asked in zip(chats, questions, strict=True):
                chat.append({"role": "user", "content": asked[turn % len(asked)]})
            answers = {}
            for way in list(ways) if turn % 2 == 0 else list(ways)[::-1]:
                began = time.perf_counter()
                with ThreadPoolExecutor(len(chats)) as pool:
                    answers[way] = list(pool.map(lambda c, ask=asks[way]: ask(list(c), args.max_new_tokens), chats))
                seconds[way] += time.perf_counter() - began
                by_way[way].append(answers[way])
            if [a["text"] for a in answers["cached"]] != [a["text"] for a in answers["uncached"]]:
                raise SystemExit(f"turn {turn + 1}: the answers with and without the prefix cache differ")
            for chat, reply in zip(chats, answers["cached"], strict=True):
                chat.append({"role": "assistant", "content": reply["text"]})
            medians = {w: statistics.median(a["ttft_s"] for a in answers[w]) for w in ways}
            print(f"turn {turn + 1}: TTFT p50 " + ", ".join(f"{w} {v:.2f} s" for w, v in medians.items()), flush=True)
        replies = {way: request(address, "stats", timeout_s=30) for way, address in addresses.items()}
        tau = {way: reply["stats"]["tau"] if reply is not None else None for way, reply in replies.items()}
    return summarise(by_way, seconds, tau, args, model.name)


def summarise(by_way: dict, seconds: dict, tau: dict, args: argparse.Namespace, model: str) -> dict:
    turns = []
    for t in range(args.turns):
        row = {"turn": t + 1, "prompt_tokens": statistics.median(a["prompt_tokens"] for a in by_way["cached"][t])}
        for way, per_turn in by_way.items():
            ttfts = [a["ttft_s"] for a in per_turn[t]]
            row[way] = {
                "ttft_p50_s": round(statistics.median(ttfts), 3),
                "ttft_p95_s": round(percentile(ttfts, 0.95), 3),
            }
        row["cached_tokens_p50"] = statistics.median(a["cached_tokens"] for a in by_way["cached"][t])
        turns.append(row)
    late = [r for r in turns if r["turn"] >= 4]
    summary = {
        "turns": turns,
        "tokens_per_s": {
            w: round(sum(a["tokens"] for t in per for a in t) / seconds[w], 2) for w, per in by_way.items()
        },
        "tau": tau,
        "config": {
            "model": model,
            "proposer": args.proposer,
            "path": args.path,
            "threads": args.threads,
            "conversations": args.conversations,
            "turns": args.turns,
            "max_new_tokens": args.max_new_tokens,
        },
        "outputs_identical": True,
    }
    if late:
        p50 = {w: statistics.median(a["ttft_s"] for r in range(3, args.turns) for a in by_way[w][r]) for w in by_way}
        summary["from_turn_4"] = {
            "ttft_p50_s": {w: round(v, 3) for w, v in p50.items()},
            "speedup": round(p50["uncached"] / p50["cached"], 2),
        }
    return summary


def report(summary: dict) -> str:
    lines = [f"{'turn':>4} {'prompt':>7} {'reused':>7} {'cached p50 / p95 s':>20} {'uncached p50 / p95 s':>22}"]
    for r in summary["turns"]:
        c, u = r["cached"], r["uncached"]
        cached = f"{c['ttft_p50_s']:.2f} / {c['ttft_p95_s']:.2f}"
        uncached = f"{u['ttft_p50_s']:.2f} / {u['ttft_p95_s']:.2f}"
        lines.append(
            f"{r['turn']:>4} {r['prompt_tokens']:>7.0f} {r['cached_tokens_p50']:>7.0f} {cached:>20} {uncached:>22}"
        )
    if "from_turn_4" in summary:
        late = summary["from_turn_4"]
        lines.append(f"from turn 4: TTFT p50 {late['ttft_p50_s']}: {late['speedup']}x with the cache")
    lines.append(f"tokens/s {summary['tokens_per_s']}, tau {summary['tau']}, outputs identical; {summary['config']}")
    return "\n".join(lines)


@ends_on_sigterm
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_chat",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--model", help="target model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--proposer", default="local", choices=["local", "ngram", "none"], help="who drafts, in each target daemon"
    )
    parser.add_argument(
        "--path",
        default="http",
        choices=["http", "msgpack"],
        help="through dflash-serve's OpenAI API, or the msgpack client",
    )
    parser.add_argument("--conversations", type=int, default=2, help="chats sent at once")
    parser.add_argument("--turns", type=int, default=8, help="user turns per chat, each answered before the next")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens per answer at most")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each target daemon")
    parser.add_argument("--json", help="also write the summary to this JSON file")
    args = parser.parse_args(argv)
    summary = run(args)
    print(report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
