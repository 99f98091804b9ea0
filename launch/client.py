"""Send prompts to a target daemon, stream the answers, print the stats.

Prompts come from --prompt (repeatable) or --prompts-file (one per line, or JSON lines
with a "prompt" key). They are sent as chat messages unless --raw is given. While it waits
the client sends heartbeats, so the daemon drops a request whose client died; Ctrl-C
cancels the request in flight.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from frontend.target_client import TargetClient
from launch.common import at_least, number_in
from launch.net import TARGET_ADDRESS, HelpFormatter, address, client_security, one_line_errors
from protocol.keys import ClientKeys
from protocol.messages import MAX_HEARTBEAT_S
from protocol.sampling import SamplingParams
from protocol.stats import RequestStats
from protocol.transport import wait_ready

READY_S = 5.0  # how long the client pings a daemon that does not answer before it gives up


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        for number, line in enumerate(Path(args.prompts_file).read_text().splitlines(), 1):
            line = line.strip()
            if line:
                prompts.append(prompt_of(line, f"{args.prompts_file}:{number}"))
    return prompts


def prompt_of(line: str, where: str) -> str:
    """A prompts file's line: a JSON object's "prompt", or the line itself where it is no JSON
    object (a plain prompt may well start with a brace)."""
    try:
        record = json.loads(line) if line.startswith("{") else None
    except json.JSONDecodeError:
        record = None
    if not isinstance(record, dict):
        return line
    if not isinstance(record.get("prompt"), str):
        raise SystemExit(f'dflash-client: error: {where}: a JSON line needs a "prompt" string')
    return record["prompt"]


def check_client_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse prompts and sampling values no daemon would take, before anything connects or loads:
    dflash-local loaded both models first (10-15 s, longer with SmolLM2) to say "no prompts" (an audit)."""
    try:
        if not read_prompts(args):
            parser.error("no prompts: give --prompt TEXT or --prompts-file FILE")
    except OSError as exc:
        parser.error(f"--prompts-file: {exc.strerror}: {exc.filename}")
    try:
        SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))


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


def run(args: argparse.Namespace, keys: ClientKeys | None = None, out=sys.stdout) -> list[dict]:
    """Send the prompts `args` names to the target daemon at `args.address` (over CURVE with `keys`)."""
    prompts = read_prompts(args)
    if not prompts:
        raise SystemExit("no prompts: give --prompt TEXT or --prompts-file FILE")
    if not wait_ready(args.address, min(args.timeout, READY_S), curve=keys):
        raise TimeoutError(
            f"no target daemon answered a ping at {args.address} within {min(args.timeout, READY_S):g} s "
            "(is one running there, with these keys?)"
        )
    client = TargetClient(args.address, args.timeout, keys, args.heartbeat)
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
            print(f"\n[{reply['finish_reason']}] {RequestStats.from_dict(stats).line()}", file=out, flush=True)
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
    parser.add_argument("--max-new-tokens", type=at_least(1), default=128, help="tokens to generate at most per prompt")
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    parser.add_argument("--no-stream", action="store_true", help="print each answer when it is complete")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (exactly the target's greedy output)"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    parser.add_argument("--seed", type=int, help="sampling seed, for reproducible sampled answers")
    parser.add_argument(
        "--timeout", type=number_in(0, above=True), default=300.0, help="seconds to wait for each reply"
    )
    parser.add_argument("--json", help="also write answers and stats to this JSON file")
    parser.add_argument(
        "--heartbeat",
        type=number_in(0, MAX_HEARTBEAT_S),
        default=1.0,
        help="seconds between heartbeats while waiting; the daemon drops a request after 3 missed (0: none)",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dflash-client", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--address", type=address, default=TARGET_ADDRESS, help="target daemon address (default %(default)s)"
    )
    parser.add_argument("--curve-key", help="this client's key pair (NAME.key_secret from dflash-keys)")
    parser.add_argument("--server-key", help="the target daemon's public key (NAME.key): CURVE, needs --curve-key")
    add_client_args(parser)
    args = parser.parse_args(argv)
    keys = client_security(parser, args.curve_key, args.server_key, "--server-key")
    check_client_args(parser, args)
    try:
        with one_line_errors(parser.prog):
            run(args, keys)
    except KeyboardInterrupt:  # the request in flight was cancelled on the way out
        print("\n[cancelled]", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
