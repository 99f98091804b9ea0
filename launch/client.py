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
import time
from collections.abc import Iterator
from pathlib import Path

from launch.net import TARGET_ADDRESS, client_security, one_line_errors
from protocol import Message, ProtocolError
from protocol.keys import ClientKeys
from protocol.transport import CONTROL_MAX_FRAME, Client, wait_ready
from target_node.decoding.stats import stats_line

READY_S = 5.0  # how long the client pings a daemon that does not answer before it gives up


class TargetClient:
    """A target daemon's client: one generate request at a time, with a deadline per reply.

    With `heartbeat_s` > 0 each request asks the daemon to drop it if the client falls silent
    for a few intervals, and the client sends a heartbeat every interval while it waits
    (while its caller reads the stream: a caller that stops reading stops them too).
    A request given up on (an exception, the stream closed early) is cancelled.
    """

    def __init__(
        self,
        address: str = TARGET_ADDRESS,
        timeout_s: float = 300.0,
        curve: ClientKeys | None = None,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.client = Client(address, curve=curve, max_message_bytes=CONTROL_MAX_FRAME)
        self.timeout_s, self.heartbeat_s = timeout_s, heartbeat_s
        self.in_flight: int | None = None
        self.cancelled: int | None = None  # a request cancelled whose `done` has not been seen

    def stream(self, **fields: object) -> Iterator[Message]:
        """Yield `chunk` replies, then the final `done`; raise the daemon's error reply."""
        if self.heartbeat_s > 0:
            fields.setdefault("heartbeat_s", self.heartbeat_s)
        request_id = self.in_flight = self.client.send("generate", fields)
        deadline = time.monotonic() + self.timeout_s  # for the next reply
        beat = time.monotonic() + self.heartbeat_s
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"no reply from the target daemon within {self.timeout_s:.0f} s")
                if self.heartbeat_s > 0 and now >= beat:
                    self.client.send("heartbeat", {}, request_id=request_id)
                    beat = now + self.heartbeat_s
                until = min(deadline, beat) if self.heartbeat_s > 0 else deadline
                reply = self.client.wait(request_id, "generate", max(until - now, 0.001))
                if reply is None:
                    continue
                deadline = time.monotonic() + self.timeout_s
                if reply.type in ("done", "error"):
                    self.in_flight = None  # finished: nothing left to cancel
                reply.raise_if_error()
                yield reply
                if reply.type == "done":
                    return
        finally:
            if self.in_flight == request_id:
                self.cancel(request_id)

    def generate(self, **fields: object) -> Message:
        return list(self.stream(**fields))[-1]

    def cancel(self, request_id: int) -> None:
        self.client.send("cancel", {}, request_id=request_id)
        self.cancelled = request_id
        if self.in_flight == request_id:
            self.in_flight = None

    def close(self) -> None:
        """Cancel what is in flight and wait up to a second for the daemon to confirm (its `done`),
        so the request stops as cancelled rather than when a reply finds the client gone."""
        if self.in_flight is not None:
            self.cancel(self.in_flight)
        if self.cancelled is not None:
            deadline = time.monotonic() + 1.0
            try:
                while (left := deadline - time.monotonic()) > 0:
                    reply = self.client.wait(self.cancelled, "generate", left)
                    if reply is None or reply.type != "chunk":
                        break
            except ProtocolError:
                pass
            self.cancelled = None
        self.client.close(linger_ms=500)


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
    keys = getattr(args, "client_keys", None)
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
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=1.0,
        help="seconds between heartbeats while waiting; the daemon drops a request after 3 missed (0: none)",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="dflash-client", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--address", default=TARGET_ADDRESS, help="target daemon address (default %(default)s)")
    parser.add_argument("--curve-key", help="this client's key pair (NAME.key_secret from dflash-keys)")
    parser.add_argument("--server-key", help="the target daemon's public key (NAME.key): CURVE, needs --curve-key")
    add_client_args(parser)
    args = parser.parse_args(argv)
    args.client_keys = client_security(parser, args.curve_key, args.server_key, "--server-key")
    try:
        with one_line_errors(parser):
            run(args)
    except KeyboardInterrupt:  # the request in flight was cancelled on the way out
        print("\n[cancelled]", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
