"""Send prompts to a target daemon, stream the answers, print the stats.

Prompts come from --prompt (repeatable) or --prompts-file (one per line, or JSON lines
with a "prompt" key; - reads standard input). They are sent as chat messages unless --raw
is given. While it waits the client sends heartbeats, so the daemon drops a request whose
client died; Ctrl-C cancels the request in flight.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import queue
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from basics.files import write_atomically
from frontend.target_client import TargetClient
from launch.common import at_least, number_in
from launch.net import TARGET_ADDRESS, HelpFormatter, client_security, one_line_errors, peer_address
from launch.processes import ends_on_sigterm
from protocol import ProtocolError, encode
from protocol.keys import ClientKeys
from protocol.messages import MAX_HEARTBEAT_S
from protocol.sampling import SamplingParams
from protocol.stats import RequestStats
from protocol.transport import wait_ready


class DroppedRequest(Exception):
    """A `done` that says `cancelled`, which this client did not ask for."""


READY_S = 5.0  # how long the client pings a daemon that does not answer before it gives up


def prompts_given(args: argparse.Namespace) -> list[str]:
    """--prompt flags, then --prompts-file lines (JSON objects or plain text; "-": stdin): a different
    reading from training.prompts.read_prompts, which takes strict JSONL."""
    prompts = list(args.prompt or [])
    if args.prompts_file:
        text = read_stdin() if args.prompts_file == "-" else Path(args.prompts_file).read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line:
                prompts.append(prompt_of(line, f"{args.prompts_file}:{number}"))
    return prompts


def read_stdin() -> str:
    if sys.stdin is None:
        raise OSError(errno.EBADF, "no standard input", "-")
    if sys.stdin.isatty():
        print("dflash-client: reading prompts from the terminal, one a line; Ctrl-D ends them", file=sys.stderr)
    return sys.stdin.buffer.read().decode("utf-8")  # the locale's decoding let bad bytes through


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
    """Read the prompts (once: a second reading of standard input or a pipe found none, an audit)
    into `args.prompts`, and refuse prompts and values no daemon would take, by the protocol's own
    checks, before anything connects or loads: dflash-local loaded both models first (10-15 s,
    longer with SmolLM2) to say "no prompts", a --heartbeat of 0.001 or an empty --stop were
    refused only by the daemon, and a prompt too long was printed whole first (audits)."""
    try:
        args.prompts = prompts_given(args)
    except OSError as exc:
        parser.error(f"--prompts-file: {exc.strerror}: {exc.filename}")
    except UnicodeDecodeError as exc:
        parser.error(f"--prompts-file: not UTF-8 text ({exc.reason} at byte {exc.start})")
    if not args.prompts:
        parser.error("no prompts: give --prompt TEXT or --prompts-file FILE")
    folder = Path(args.json).parent if args.json else None
    if folder is not None and (Path(args.json).is_dir() or not folder.is_dir()):
        parser.error(f"--json {args.json}: not a file in an existing folder")
    try:
        SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    for number, prompt in enumerate(["x", *args.prompts]):  # the flags, then each prompt
        if args.raw and not prompt:
            parser.error(f"prompt {number} is empty (--raw sends it as it is)")
        try:
            encode("generate", 0, request_fields(prompt, args))
        except ProtocolError as exc:
            parser.error(f"prompt {number}: {exc.message}" if number else exc.message)


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
    if args.heartbeat > 0:
        fields["heartbeat_s"] = args.heartbeat
    return fields


class Printer:
    """Writes to `out` on a thread of its own. A terminal paused with Ctrl-S, or a pipe nobody
    reads, blocks the writes: a client that blocked on them sent no heartbeats, and the daemon
    dropped its request as if it had died (an audit). The caller drains it after each answer (so
    one answer at most waits to be written) and abandons it when the run fails or is stopped:
    waiting for a stalled terminal kept a stopped client and dflash-local's daemons up for good (a
    review). A real file is written through a descriptor of its own, which no exit flush waits on."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.lines, self.abandoned = out, queue.Queue(), False
        self.mid_line = False  # the last text given ends inside a line (an answer cut short)
        self.failed: BaseException | None = None  # a closed pipe, text the terminal cannot show
        try:
            out.flush()
            self.fd: int | None = os.dup(out.fileno())
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: no file behind it
            self.fd = None
        self.thread = threading.Thread(target=self._write_all, name="printer", daemon=True)
        self.thread.start()

    def __call__(self, text: str) -> None:
        self._raise_failure()
        if text:
            self.mid_line = not text.endswith("\n")
        self.lines.put(text)

    def _write_all(self) -> None:
        while (text := self.lines.get()) is not None:
            try:
                if self.failed is None and not self.abandoned:
                    self._write(text)
            except BaseException as exc:  # given to the caller, which raises it
                self.failed = exc
            finally:
                self.lines.task_done()
        self.lines.task_done()

    def _write(self, text: str) -> None:
        if self.fd is None:
            self.out.write(text)
            self.out.flush()
            return
        data = memoryview(text.encode(getattr(self.out, "encoding", None) or "utf-8", errors="replace"))
        while data:
            data = data[os.write(self.fd, data) :]

    def drain(self) -> None:
        """Wait until everything is written (the terminal resumed, the pipe read); Ctrl-C ends the
        wait. Nothing is in flight then, so no heartbeat is missed."""
        self.lines.join()
        self._raise_failure()

    def close(self) -> None:
        self.drain()
        self.lines.put(None)
        if self.fd is not None:
            os.close(self.fd)

    def abandon(self) -> None:
        """Stop writing what is queued, without waiting for a write that blocks (its thread ends
        with the process)."""
        self.abandoned = True
        self.lines.put(None)

    def _raise_failure(self) -> None:
        if self.failed is not None:
            raise self.failed


class AnswersNotSaved(OSError):
    """--json could not be written (a full disk, a read-only folder); the answers went to stdout."""


def save_answers(path: str | None, results: list[dict]) -> OSError | None:
    """Write the answers finished to --json (atomically: a run stopped as it writes leaves the last
    whole file); the error, where it cannot, for the caller to report."""
    if not path or not results:  # a run that answered nothing leaves an earlier file as it was
        return None
    try:
        write_atomically(Path(path), lambda tmp: tmp.write_text(json.dumps(results, indent=2) + "\n"))
    except OSError as exc:
        return exc
    return None


def run(args: argparse.Namespace, keys: ClientKeys | None = None, out: TextIO = sys.stdout) -> list[dict]:
    """Send `args.prompts` (see check_client_args) to the target daemon at `args.address` (over CURVE
    with `keys`). Answers finished are written to `args.json` whatever ends the run (one refused
    prompt or Ctrl-C lost them all: an audit), and the run's own error is what it ends with."""
    if not wait_ready(args.address, min(args.timeout, READY_S), curve=keys):
        raise TimeoutError(
            f"no target daemon answered a ping at {args.address} within {min(args.timeout, READY_S):g} s "
            "(is one running there, with these keys?)"
        )
    client, printer = TargetClient(args.address, args.timeout, keys, args.heartbeat), Printer(out)
    results: list[dict] = []
    try:
        try:
            for prompt in args.prompts:
                results.append(answer(client, printer, prompt, args))
                printer.drain()
        except BaseException:
            printer.abandon()
            if printer.mid_line:  # the error's line starts on a line of its own, not after the cut answer
                print(file=sys.stderr, flush=True)
            raise
        printer.close()
    finally:
        client.close()
        unsaved = save_answers(args.json, results)
        if unsaved is not None and sys.exc_info()[1] is not None:  # the run's own error goes on
            print(f"dflash-client: could not write --json: {unsaved}", file=sys.stderr)
    if unsaved is not None:  # the answers are on stdout: one line, not a traceback (an audit)
        raise AnswersNotSaved(f"could not write --json: {unsaved}")
    return results


def answer(client: TargetClient, printer: Printer, prompt: str, args: argparse.Namespace) -> dict:
    printer(f"\n>>> {prompt}\n")
    for reply in client.stream(**request_fields(prompt, args)):
        if reply.type == "chunk":
            printer(reply["text"])
    if reply["finish_reason"] == "cancelled":  # not by this client: it cancels only on Ctrl-C
        raise DroppedRequest("the target daemon dropped the request (its log says why): the answer is cut short")
    printer(reply["text"] if args.no_stream else "")
    printer(f"\n[{reply['finish_reason']}] {RequestStats.from_dict(reply['stats']).line()}\n")
    return {"prompt": prompt, "text": reply["text"], "finish_reason": reply["finish_reason"], "stats": reply["stats"]}


def add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    parser.add_argument(
        "--prompts-file", help="file of prompts: one per line, or JSON lines with a 'prompt' key; - for standard input"
    )
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


@ends_on_sigterm  # through run's `finally`, which writes --json: a SIGTERM or SIGHUP lost it (an audit)
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dflash-client", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--address", type=peer_address, default=TARGET_ADDRESS, help="target daemon address (default %(default)s)"
    )
    parser.add_argument("--curve-key", help="this client's key pair (NAME.key_secret from dflash-keys)")
    parser.add_argument("--server-key", help="the target daemon's public key (NAME.key): CURVE, needs --curve-key")
    add_client_args(parser)
    args = parser.parse_args(argv)
    keys = client_security(parser, args.curve_key, args.server_key, "--server-key")
    with ends_quietly():
        check_client_args(parser, args)  # Ctrl-C while it reads a terminal's prompts
        with one_line_errors(parser.prog, DroppedRequest, AnswersNotSaved):
            run(args, keys)


@contextmanager
def ends_quietly() -> Iterator[None]:
    """Ctrl-C (the request in flight was cancelled on the way out) ends with 130, and a reader that
    closed the pipe (`| head`) with 141, as the shell's own tools do, not with a traceback."""
    try:
        yield
    except KeyboardInterrupt:
        print("\n[cancelled]", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        raise SystemExit(141) from None


if __name__ == "__main__":
    main()
