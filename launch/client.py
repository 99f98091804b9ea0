"""Send prompts to a target daemon, stream the answers, print the stats.

Prompts come from --prompt (repeatable) or --prompts-file (one per line, or JSON lines
with a "prompt" key). They are sent as chat messages unless --raw is given.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from launch.common import TARGET_ADDRESS
from protocol import Message
from protocol.transport import Client
from target_node.stats import stats_line


class TargetClient:
    """A target daemon's client: one generate request at a time, with a deadline per reply."""

    def __init__(self, address: str = TARGET_ADDRESS, timeout_s: float = 300.0) -> None:
        self.client = Client(address)
        self.timeout_s = timeout_s

    def stream(self, **fields: object) -> Iterator[Message]:
        """Yield `chunk` replies, then the final `done`; raise the daemon's error reply."""
        request_id = self.client.send("generate", fields)
        while True:
            reply = self.client.wait(request_id, "generate", self.timeout_s)
            if reply is None:
                raise TimeoutError(f"no reply from the target daemon within {self.timeout_s:.0f} s")
            reply.raise_if_error()
            yield reply
            if reply.type == "done":
                return

    def generate(self, **fields: object) -> Message:
        return list(self.stream(**fields))[-1]

    def cancel(self, request_id: int) -> None:
        self.client.send("cancel", {}, request_id=request_id)

    def close(self) -> None:
        self.client.close()


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        for line in Path(args.prompts_file).read_text().splitlines():
            line = line.strip()
            if line:
                prompts.append(json.loads(line)["prompt"] if line.startswith("{") else line)
    return prompts


def request_fields(prompt: str, args: argparse.Namespace) -> dict:
    fields = {"max_new_tokens": args.max_new_tokens, "stop": args.stop or [], "stream": not args.no_stream}
    if args.raw:
        fields["prompt"] = prompt
    else:
        fields["messages"] = [{"role": "user", "content": prompt}]
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    if args.seed is not None:
        sampling["seed"] = args.seed
    fields["sampling"] = sampling
    return fields


def run(args: argparse.Namespace, out=sys.stdout) -> list[dict]:
    prompts = read_prompts(args)
    if not prompts:
        raise SystemExit("no prompts: give --prompt TEXT or --prompts-file FILE")
    client = TargetClient(args.address, args.timeout)
    results = []
    try:
        for prompt in prompts:
            print(f"\n>>> {prompt}", file=out)
            for reply in client.stream(**request_fields(prompt, args)):
                if reply.type == "chunk":
                    print(reply["text"], end="", file=out, flush=True)
            if args.no_stream:
                print(reply["text"], end="", file=out)
            stats = reply["stats"]
            print(f"\n[{reply['finish_reason']}] {stats_line(stats)}", file=out, flush=True)
            results.append(
                {"prompt": prompt, "text": reply["text"], "finish_reason": reply["finish_reason"], "stats": stats}
            )
    finally:
        client.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


def add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", help="file of prompts: one per line, or JSON lines with a 'prompt' key")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    parser.add_argument("--no-stream", action="store_true", help="print each answer when it is complete")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (exactly the target's greedy output)"
    )
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, help="sampling seed, for reproducible sampled answers")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each reply")
    parser.add_argument("--json", help="also write answers and stats to this JSON file")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="dflash-client", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--address", default=TARGET_ADDRESS, help="target daemon address (default %(default)s)")
    add_client_args(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
