"""dflash-serve's processes: what it starts, how it ends, what it tells a supervisor. Real
processes on a tiny chat model (all in one: the server, a target daemon, a draft daemon)."""

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from helpers import hang_ups_by_default, running

from frontend.server import listening_sockets, url
from launch.local import free_port
from launch.serve import wait_http_ready
from protocol.transport import BindError

ROOT = Path(__file__).resolve().parent.parent.parent


class Lines:
    """A process's output, line by line, read on a thread: `until` never blocks past its deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.seen: list[str] = []
        self.queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.queue.put(line)
        self.queue.put(None)

    def until(self, pattern: str, timeout_s: float = 180.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if found := re.search(pattern, line):
                return found
        raise AssertionError(f"no line matched {pattern!r}; output:\n{''.join(self.seen)}")

    def rest(self) -> str:
        while (line := self.queue.get(timeout=30)) is not None:
            self.seen.append(line)
        return "".join(self.seen)


def all_in_one(model: Path, port: int, *flags: str, env: dict | None = None) -> tuple[subprocess.Popen, Lines]:
    command = [sys.executable, "-m", "launch.serve", "--model", str(model), "--threads", "1", "--port", str(port)]
    proc = subprocess.Popen(
        [*command, *flags],
        cwd=ROOT,
        env=dict(env or os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=hang_ups_by_default,
    )
    return proc, Lines(proc)


def started(lines: Lines) -> tuple[int, int]:
    """(draft daemon pid, target daemon pid), once the server listens."""
    draft = int(lines.until(r"draft daemon ready at .* \(pid (\d+)\)").group(1))
    target = int(lines.until(r"target daemon ready at .* \(pid (\d+)\)").group(1))
    lines.until(r"\[serve\] http://")
    return draft, target


def gone(*pids: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(running(pid) for pid in pids)


def test_a_port_taken_is_refused_before_any_daemon_starts():
    """It was found only after both models had loaded (68 s with SmolLM2, minutes on a GPU), and
    the run ended with uvicorn's exit code 3 and a log line (an audit)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "launch.serve", "--port", str(port), "--model", "/never/looked/at"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 1, run
    assert run.stderr.startswith(f"dflash-serve: error: cannot listen on 127.0.0.1:{port}: ")
    assert "ready at" not in run.stdout


def test_a_target_daemon_that_dies_ends_the_server_and_a_draft_daemon_that_dies_does_not(chat_model_dir):
    """All in one, the server owns its daemons: with the target daemon gone it answered 503 for
    good, logged nothing, and exited 0 when stopped (an audit); a supervisor could not bring the
    stack back. The draft daemon gone, it serves on (the target drafts without it, exactly)."""
    port = free_port()
    run, lines = all_in_one(chat_model_dir, port)
    try:
        draft, target = started(lines)
        os.kill(draft, signal.SIGKILL)
        lines.until(r"the draft daemon exited with code -9: serving on without drafts", timeout_s=30)
        answer = requests.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "Hi", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert run.poll() is None
        os.kill(target, signal.SIGKILL)
        lines.until(r"the target daemon exited with code -9: shutting down", timeout_s=30)
        assert run.wait(60) == 1, lines.rest()
    finally:
        run.kill()
        run.wait()


def test_a_hang_up_stops_the_daemons_and_no_throwaway_key_outlives_their_start(chat_model_dir, tmp_path):
    """SIGHUP (a terminal closed, an ssh cut) killed the server at once: no graceful shutdown,
    and the --curve keys stayed in the temporary folder (an audit). It now stops as on SIGTERM. The
    keys stayed after a SIGKILL too (an audit): they are gone once both daemons hold them."""
    temporary, port = tmp_path / "tmp", free_port()
    temporary.mkdir()
    run, lines = all_in_one(chat_model_dir, port, "--curve", env=dict(os.environ, TMPDIR=str(temporary)))
    try:
        daemons = started(lines)
        assert wait_http_ready(f"http://127.0.0.1:{port}/health", 60)  # uvicorn serves: its graceful path
        assert list(temporary.iterdir()) == [], "a key file outlived the daemons' start"
        answer = requests.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "Hi", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text  # over both links, CURVE, with the files gone
        run.send_signal(signal.SIGHUP)
        assert run.wait(60) == 0, lines.rest()
    finally:
        run.kill()
        run.wait()
    assert "Finished server process" in lines.rest()  # uvicorn's graceful shutdown ran to its end
    assert list(temporary.iterdir()) == []
    assert gone(*daemons), "a daemon outlived the server"


def standalone(target_address: str, *flags: str, **popen) -> tuple[subprocess.Popen, int]:
    """dflash-serve in front of `target_address`, once it answers; (process, port)."""
    port = free_port()
    command = [sys.executable, "-m", "launch.serve", "--target", target_address, "--port", str(port), *flags]
    run = subprocess.Popen(command, cwd=ROOT, **({"preexec_fn": hang_ups_by_default} | popen))
    if not wait_http_ready(f"http://127.0.0.1:{port}/health", 120, alive=lambda: run.poll() is None):
        run.kill()
        raise AssertionError(f"dflash-serve did not start (exit code {run.wait()})")
    return run, port


@pytest.mark.parametrize("endings", [("SIGHUP", "SIGHUP"), ("SIGTERM", "SIGHUP"), ("SIGTERM", "SIGINT")])
def test_answers_still_streaming_when_the_grace_ends_get_an_error_event_and_done(target_address, endings, tmp_path):
    """uvicorn cut streams still open after its graceful shutdown mid-body: no error event, no
    [DONE], and Python's http.client read the half answer as a whole one (an audit). A second
    signal during the grace does not cut it short (it did for a SIGHUP: a review), and the stop
    asked for is a success (exit 0: 143 left a stopped systemd unit failed). A forced quit (a
    Ctrl-C after the SIGTERM) ends them so too, at once: the event loop's end cut them, with a
    traceback each and one for the app's lifespan (an audit)."""
    log = tmp_path / "serve.log"
    with log.open("w") as written:
        run, port = standalone(target_address, "--shutdown-grace", "1", stderr=written)
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 1800, "temperature": 0, "stream": True}
        with requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, stream=True, timeout=60) as reply:
            events = reply.iter_lines()
            assert next(line for line in events if line).startswith(b"data: {")  # streaming
            run.send_signal(getattr(signal, endings[0]))
            deadline = time.monotonic() + 30  # the second once the shutdown runs: sent together, they merged
            while "Waiting for connections to close" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.02)
            run.send_signal(getattr(signal, endings[1]))
            rest = [line.decode() for line in events if line]
        assert run.wait(60) == 0
    finally:
        run.kill()
        run.wait()
    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down", error
    assert not any('"finish_reason": "length"' in line for line in rest)  # ended by the shutdown, not its length
    said = log.read_text()
    assert "Traceback" not in said and ("Forced quit" in said) == (endings[1] == "SIGINT"), said[-3000:]


def test_a_server_stopped_while_its_daemon_hangs_ends_its_streams_whole_within_the_grace(chat_model_dir, tmp_path):
    """A drained answer's cancel waited --daemon-timeout for a hung daemon's word: past uvicorn's
    cut the stream broke off after its error event (curl: 18), and the waiting thread held the
    server's exit for seconds more (an audit: 10 s for a grace of 5). The wait is now what the
    grace leaves, so a server with a 30 s --daemon-timeout ends in a few seconds, streams whole."""
    from launch.local import daemon

    address = f"ipc://{tmp_path}/hung.sock"
    args = ["--model", str(chat_model_dir), "--proposer", "ngram", "--threads", "1"]
    with daemon("target daemon", "launch.target_daemon", address, args, 120) as target:
        run, port = standalone(address, "--shutdown-grace", "2", "--daemon-timeout", "30")
        try:
            body = {"prompt": "Once upon a time", "max_tokens": 1800, "temperature": 0, "stream": True}
            with requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, stream=True, timeout=60) as reply:
                events = reply.iter_lines()
                assert next(line for line in events if line).startswith(b"data: {")  # streaming
                target.send_signal(signal.SIGSTOP)
                run.send_signal(signal.SIGTERM)
                stopped = time.monotonic()
                rest = [line.decode() for line in events if line]  # a broken body raises here
            code = run.wait(60)
            took = time.monotonic() - stopped
        finally:
            target.send_signal(signal.SIGCONT)
            run.kill()
            run.wait()
    assert code == 0 and took < 15, (code, took)  # the grace and a start's worth, not the daemon timeout
    assert rest[-1] == "data: [DONE]" and "server_shutting_down" in rest[-2], rest[-3:]


def test_a_hang_up_ignored_as_nohup_does_stays_ignored(target_address):
    """Under nohup a closed terminal must not stop the server: it did once the server handled
    SIGHUP (a review)."""
    run, port = standalone(target_address, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        run.send_signal(signal.SIGHUP)
        time.sleep(1)
        assert run.poll() is None and requests.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        run.send_signal(signal.SIGTERM)
        assert run.wait(60) == 0
    finally:
        run.kill()
        run.wait()


def test_a_port_is_taken_once_it_listens_and_ipv6_sockets_are_ipv6_only():
    """Bound with SO_REUSEADDR but not listening, a second server passed the check and failed
    only after loading its models (a review); `::` also took IPv4 clients, where uvicorn binds it
    IPv6 only (a review)."""
    first = listening_sockets("127.0.0.1", 0)
    port = first[0].getsockname()[1]
    first[0].listen()  # as uvicorn does once the daemons are up
    try:
        with pytest.raises(BindError, match=f"cannot listen on 127.0.0.1:{port}"):
            listening_sockets("127.0.0.1", port)
    finally:
        first[0].close()
    if not socket.has_ipv6:
        return
    try:
        (v6,) = listening_sockets("::", 0)
    except BindError:  # a host without IPv6
        return
    with v6:
        assert v6.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1


def test_the_watcher_names_no_daemon_the_server_stopped_itself():
    """A server that ended without the watcher (uvicorn's start failed) stops its daemons itself:
    the watcher, still polling, blamed the target daemon for that exit (a review)."""
    from types import SimpleNamespace

    from launch.local import LocalDaemons
    from launch.serve import watch_daemons

    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    daemons = LocalDaemons("tcp://127.0.0.1:1", *sleepers)
    stopped = []
    server, done = SimpleNamespace(stop=lambda: stopped.append(True)), threading.Event()
    watcher = threading.Thread(target=watch_daemons, args=(daemons, server, done, 0.01), daemon=True)
    watcher.start()
    done.set()  # the server ended: it stops its daemons now
    watcher.join(5)
    for sleeper in sleepers:
        sleeper.kill()
        sleeper.wait()
    time.sleep(0.05)
    assert not watcher.is_alive() and not daemons.lost and not stopped
    daemons = LocalDaemons("tcp://127.0.0.1:1", *(subprocess.Popen(["true"]) for _ in range(2)))
    daemons.target.wait()
    watch_daemons(daemons, server, threading.Event(), 0.01)  # the target daemon ended while it served
    assert daemons.lost and stopped


def test_a_drained_stream_sends_its_error_and_done_before_the_cancel_waits_on_the_daemon():
    """The stream's end came after the cancel, which waits for the daemon's confirmation (up to
    --daemon-timeout): past uvicorn's cut, the client got neither the error nor [DONE] (a review)."""
    import asyncio

    from frontend.app import events
    from frontend.drain import Drain
    from frontend.responses import Answer
    from frontend.schemas import ChatCompletionRequest
    from protocol import Message

    sent, waits = [], []

    class Streaming:
        async def next(self, gone=None):
            await asyncio.sleep(0.01)
            return Message("chunk", 1, {"text": "a", "token_ids": [5]})

        async def close(self, wait_s=None):
            sent.append("closed")
            waits.append(wait_s)

    async def stream():
        first = Message("chunk", 1, {"text": "Ot", "token_ids": [1, 2]})
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        began = time.monotonic()
        async for event in events(Streaming(), first, Answer(True, "m"), body, Drain(lambda: began, 1.0)):
            sent.append(event.decode())

    asyncio.run(stream())
    assert sent[-1] == "closed" and sent[-2] == "data: [DONE]\n\n", sent[-3:]
    assert json.loads(sent[-3].removeprefix("data: "))["error"]["code"] == "server_shutting_down"
    assert len(sent) > 10  # it streamed until the drain was due (0.5 s), not less
    assert waits[0] is not None and 0 < waits[0] <= 0.25  # half what is left before uvicorn's cut


@pytest.mark.parametrize(
    "host, printed",
    [
        ("0.0.0.0", "http://127.0.0.1:8000 (listening on every IPv4 interface)"),
        ("::", "http://[::1]:8000 (listening on every IPv6 interface)"),
        ("", "http://127.0.0.1:8000 (listening on every interface)"),
        ("::1", "http://[::1]:8000"),
        ("10.1.2.3", "http://10.1.2.3:8000"),
    ],
)
def test_the_printed_address_is_one_a_client_can_dial(host, printed):
    """`--host 0.0.0.0` printed http://0.0.0.0:8000, which no client dials (a review)."""
    assert url(host, 8000) == printed
