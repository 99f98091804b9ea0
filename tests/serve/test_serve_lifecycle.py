"""dflash-serve's processes: what it starts, how it ends, what it tells a supervisor. Real
processes on a tiny chat model (all in one: the server, a target daemon, a draft daemon)."""

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

import requests
from helpers import running

from launch.local import free_port

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
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),  # a run under nohup ignores it
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


def test_a_hang_up_stops_the_daemons_and_removes_the_throwaway_keys(chat_model_dir, tmp_path):
    """SIGHUP (a terminal closed, an ssh cut) killed the server at once: no graceful shutdown,
    and the --curve keys stayed in the temporary folder (an audit). It now ends as SIGTERM does,
    exit 128 + signal as dflash-local's."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    run, lines = all_in_one(chat_model_dir, free_port(), "--curve", env=dict(os.environ, TMPDIR=str(temporary)))
    try:
        daemons = started(lines)
        assert [p.name for p in temporary.iterdir()], "the keys are in the temporary folder while it runs"
        run.send_signal(signal.SIGHUP)
        assert run.wait(60) == 128 + signal.SIGHUP, lines.rest()
    finally:
        run.kill()
        run.wait()
    assert gone(*daemons), "a daemon outlived the server"
    assert list(temporary.iterdir()) == []


def test_answers_still_streaming_when_the_grace_ends_get_an_error_event_and_done(target_address):
    """uvicorn cut streams still open after its graceful shutdown mid-body: no error event, no
    [DONE], and Python's http.client read the half answer as a whole one (an audit)."""
    import json

    from launch.serve import wait_http_ready

    port = free_port()
    command = [sys.executable, "-m", "launch.serve", "--target", target_address, "--port", str(port)]
    run = subprocess.Popen([*command, "--shutdown-grace", "1"], cwd=ROOT)
    try:
        assert wait_http_ready(f"http://127.0.0.1:{port}/health", 120, alive=lambda: run.poll() is None)
        body = {"prompt": "Once upon a time", "max_tokens": 1800, "temperature": 0, "stream": True}
        with requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, stream=True, timeout=60) as reply:
            events = reply.iter_lines()
            assert next(line for line in events if line).startswith(b"data: {")  # streaming
            run.send_signal(signal.SIGTERM)
            rest = [line.decode() for line in events if line]
        assert run.wait(60) == 128 + signal.SIGTERM
    finally:
        run.kill()
        run.wait()
    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down", error
    assert not any('"finish_reason": "length"' in line for line in rest)  # ended by the shutdown, not its length
