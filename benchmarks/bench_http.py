"""The HTTP layer's cost: the same requests through the msgpack client and through dflash-serve.

One target daemon (SmolLM2 by default) and one dflash-serve in front of it, both real
processes. Each prompt is sent, streaming and greedy, alternately straight to the daemon
(`frontend.target_client.TargetClient`) and over HTTP with the official OpenAI client, so both
paths see the same model, the same machine load and the same answers (checked equal).
Printed: the median time to first token (first text received) and decode tok/s (tokens
after the first / time after the first) of each path, and the median of the request-by-
request differences, which is the HTTP layer's cost (the order of the two alternates).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from frontend.target_client import TargetClient
from launch.common import resolve_model
from launch.local import daemon, free_address, free_port
from launch.net import HelpFormatter
from launch.processes import ends_on_sigterm
from launch.serve import front_end

PROMPTS = Path(__file__).resolve().parent.parent / "launch" / "demo_prompts.txt"


def timed_msgpack(client: TargetClient, prompt: str, max_tokens: int) -> dict:
    began, first, chunks = time.perf_counter(), None, []
    fields = {"messages": [{"role": "user", "content": prompt}], "max_new_tokens": max_tokens}
    for reply in client.stream(**fields, sampling={"temperature": 0.0}):
        if reply.type == "chunk" and reply["text"]:
            first = first or time.perf_counter()
            chunks.append(reply["text"])
    end = time.perf_counter()
    return measured("".join(chunks), reply["stats"]["new_tokens"], began, first, end)


def stream_chat(client, model: str, messages: list[dict], max_tokens: int) -> tuple[str, object, float, float | None]:
    """One streamed greedy chat completion (client: openai.OpenAI): its text, its usage, when it
    was sent and when its first text came."""
    began, first, pieces, usage = time.perf_counter(), None, [], None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(pieces), usage, began, first


def timed_http(client, model: str, prompt: str, max_tokens: int) -> dict:  # client: openai.OpenAI
    text, usage, began, first = stream_chat(client, model, [{"role": "user", "content": prompt}], max_tokens)
    end = time.perf_counter()
    return measured(text, usage.completion_tokens if usage is not None else 0, began, first, end)


def measured(text: str, tokens: int, began: float, first: float, end: float) -> dict:
    return {"text": text, "tokens": tokens, "ttft_ms": (first - began) * 1000, "tok_s": (tokens - 1) / (end - first)}


def run(args: argparse.Namespace) -> dict:
    from openai import OpenAI

    prompts = [p for p in PROMPTS.read_text().splitlines() if p.strip()]
    model = resolve_model(args.model)
    address = free_address()
    threads = ["--threads", str(args.threads)]
    rows = {"msgpack": [], "http": []}
    daemon_args = ["--model", str(model), "--proposer", args.proposer, *threads]
    with daemon("target daemon", "launch.target_daemon", address, daemon_args, 300):
        with front_end(
            free_port(), ["--target", address, "--served-model-name", "bench", "--log-level", "warning"]
        ) as url:
            msgpack = TargetClient(address, timeout_s=600)
            http = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
            try:
                timed_msgpack(msgpack, prompts[0], 4)  # warm both paths up
                timed_http(http, "bench", prompts[0], 4)
                for repeat in range(args.repeats):
                    for prompt in prompts:
                        # Alternate which path goes first, so drift in the machine's load favours neither.
                        if repeat % 2:
                            over_http = timed_http(http, "bench", prompt, args.max_new_tokens)
                            direct = timed_msgpack(msgpack, prompt, args.max_new_tokens)
                        else:
                            direct = timed_msgpack(msgpack, prompt, args.max_new_tokens)
                            over_http = timed_http(http, "bench", prompt, args.max_new_tokens)
                        if direct["text"] != over_http["text"] or direct["tokens"] != over_http["tokens"]:
                            raise SystemExit(f"the answers differ for {prompt!r}: the front end altered the text")
                        rows["msgpack"].append(direct)
                        rows["http"].append(over_http)
            finally:
                msgpack.close()
                http.close()
    summary = {
        path: {
            "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
            "tok_s": statistics.median(r["tok_s"] for r in runs),
            "requests": len(runs),
        }
        for path, runs in rows.items()
    }
    pairs = list(zip(rows["msgpack"], rows["http"], strict=True))
    summary["paired_difference"] = {  # HTTP minus msgpack, request by request: the overhead itself
        "ttft_ms": statistics.median(h["ttft_ms"] - m["ttft_ms"] for m, h in pairs),
        "tok_s": statistics.median(h["tok_s"] - m["tok_s"] for m, h in pairs),
    }
    summary["config"] = {
        "model": model.name,
        "proposer": args.proposer,
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts),
        "repeats": args.repeats,
    }
    return summary


def report(summary: dict) -> str:
    direct, http, diff = summary["msgpack"], summary["http"], summary["paired_difference"]
    return "\n".join(
        [
            f"{'path (medians)':<28}{'TTFT ms':>10}{'decode tok/s':>14}",
            f"{'msgpack (TargetClient)':<28}{direct['ttft_ms']:>10.1f}{direct['tok_s']:>14.2f}",
            f"{'HTTP (openai client)':<28}{http['ttft_ms']:>10.1f}{http['tok_s']:>14.2f}",
            f"{'HTTP - msgpack (paired)':<28}{diff['ttft_ms']:>+10.1f}{diff['tok_s']:>+14.2f}",
            f"({direct['requests']} request pairs, {summary['config']})",
        ]
    )


@ends_on_sigterm
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_http",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--model", help="target model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--proposer", default="none", choices=["none", "ngram"], help="the daemon's proposer")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer at most")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts (launch/demo_prompts.txt)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the target daemon")
    parser.add_argument("--json", help="also write the summary to this JSON file")
    args = parser.parse_args(argv)
    summary = run(args)
    print(report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
