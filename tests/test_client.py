"""dflash-client as a user runs it: a terminal that pauses, prompts from a pipe, a run cut short."""

import argparse
import io
import subprocess
import sys
import threading
import time

import pytest
from helpers import serving_in_thread

from frontend.target_client import TargetClient
from launch import client
from protocol import Message, ProtocolError
from target_node.drafting.proposers import NGramProposer
from target_node.model.target import TargetModel
from target_node.serving.daemon import TargetService
from target_node.serving.settings import ServiceSettings


class SlowProposer(NGramProposer):
    """Drafts as an n-gram proposer does, 50 ms a step: a request that runs 0.6 s or more."""

    def propose(self, tokens, max_tokens):
        time.sleep(0.05)
        return super().propose(tokens, max_tokens)


class PausedTerminal(io.StringIO):
    """A terminal paused (Ctrl-S) as the answer's first text reaches it, for `paused_s`."""

    def __init__(self, paused_s: float) -> None:
        super().__init__()
        self.paused_s, self.pause = paused_s, None

    def write(self, text: str) -> int:
        if self.pause is None and text.strip() and not text.startswith("\n>>>"):
            self.pause = threading.Event()
            resume = threading.Timer(self.paused_s, self.pause.set)
            resume.daemon = True  # a test that gave up on it does not wait for it at exit
            resume.start()
        if self.pause is not None:
            assert self.pause.wait(30)
        return super().write(text)


def client_args(tmp_path, address: str, *prompts: str, max_new: int = 100, **flags) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    client.add_client_args(parser)
    argv = ["--raw", "--max-new-tokens", str(max_new), "--heartbeat", "0.05", "--json", str(tmp_path / "out.json")]
    args = parser.parse_args([*argv, *(f for p in prompts for f in ("--prompt", p))])
    vars(args).update(address=address, **flags)
    client.check_client_args(parser, args)
    return args


@pytest.fixture(scope="module")
def served(chat_model_dir, tmp_path_factory):
    target = TargetModel.load(chat_model_dir, dtype="float32", slots=1)
    service = TargetService(target, [SlowProposer()], ServiceSettings(prefix_cache_mb=0, always_draft=True))
    address = f"ipc://{tmp_path_factory.mktemp('client')}/target.sock"
    with serving_in_thread(service.serve, address):
        yield address


def test_a_paused_terminal_holds_the_answer_back_not_the_request(served, tmp_path):
    """The client printed on the thread that sent its heartbeats: a terminal paused for a second
    (Ctrl-S) stopped them, the daemon dropped the request after 3 missed beats, and the client
    printed a cut answer and exited 0 (an audit). The answer now arrives whole once it resumes."""
    args = client_args(tmp_path, served, "Once upon a time", max_new=40)  # 40 steps of 50 ms: 2 s
    out = PausedTerminal(paused_s=1.0)  # 20 heartbeats' worth, while the request runs on
    (result,) = client.run(args, out=out)
    assert result["finish_reason"] in ("length", "eos") and result["text"] in out.getvalue()
    alone = TargetClient(served, timeout_s=60).generate(prompt="Once upon a time", max_new_tokens=40)
    assert result["text"] == alone["text"]


def test_the_answers_finished_are_written_when_a_later_prompt_fails(served, tmp_path):
    """One prompt the daemon refused (too long for the model) ended the run with no --json at all,
    the first prompt's answer included (an audit)."""
    import json

    args = client_args(tmp_path, served, "Hello", "word " * 5000, max_new=10)
    with pytest.raises(ProtocolError, match="context"):
        client.run(args, out=io.StringIO())
    (written,) = json.loads((tmp_path / "out.json").read_text())
    assert written["prompt"] == "Hello" and written["finish_reason"] in ("length", "eos")


def test_a_sigterm_writes_the_answers_finished_before_it(served, tmp_path):
    """SIGTERM or SIGHUP (systemd, `timeout`, a closed terminal) ended the client at once and lost
    the --json of answers it had finished, which Ctrl-C kept (an audit)."""
    import json
    import signal

    out = tmp_path / "out.json"
    argv = [sys.executable, "-m", "launch.client", "--address", served, "--raw", "--max-new-tokens", "80"]
    argv += ["--prompt", "Hello", "--prompt", "Once upon a time", "--json", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the first answer's closing line: "[length] ..." or "[eos] ..."
        if line.startswith("["):
            break
    proc.send_signal(signal.SIGTERM)  # the second runs for seconds: 50 ms a step
    assert proc.wait(60) == 128 + signal.SIGTERM, proc.stderr.read()
    (written,) = json.loads(out.read_text())
    assert written["prompt"] == "Hello" and written["finish_reason"] in ("length", "eos")


def test_a_request_the_daemon_dropped_is_an_error_not_an_answer(tmp_path, monkeypatch, capsys):
    """`done` with finish_reason "cancelled" reaches the client only when the daemon dropped the
    request (its own cancel, on Ctrl-C, is never yielded): it exited 0 with a cut answer. The
    error's line starts a line of its own, not glued to the cut answer's text (an audit)."""

    def dropped(self, **fields):
        yield Message("chunk", 1, {"text": "Once", "token_ids": [5]})
        yield Message("done", 1, {"text": "Once", "token_ids": [5], "finish_reason": "cancelled", "stats": {}})

    monkeypatch.setattr(client, "wait_ready", lambda *a, **k: True)
    monkeypatch.setattr(TargetClient, "stream", dropped)
    with pytest.raises(client.DroppedRequest, match="dropped the request"):
        client.run(client_args(tmp_path, "ipc:///nowhere", "hi"), out=io.StringIO())
    assert capsys.readouterr().err == "\n"


def test_a_closed_pipe_ends_the_client_quietly(tmp_path):
    """`dflash-client ... | head -c 200` ended in a BrokenPipeError traceback (an audit)."""

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    printer = client.Printer(ClosedPipe())
    printer("first")
    with pytest.raises(BrokenPipeError):
        printer.close()
    with pytest.raises(SystemExit) as ended, client.ends_quietly():
        raise BrokenPipeError(32, "Broken pipe")
    assert ended.value.code == 141


@pytest.mark.parametrize("source", ["-", "/dev/stdin"])
def test_prompts_come_from_standard_input_read_once(source):
    """Prompts were read twice, once to check them and once to send them: from standard input the
    second reading found none ("no prompts", after dflash-local had loaded both models: 100 s)."""
    argv = ["--prompts-file", source, "--address", "tcp://127.0.0.1:9", "--timeout", "0.5"]
    done = subprocess.run(
        [sys.executable, "-m", "launch.client", *argv], input="Say hi\n", capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "no target daemon answered a ping" in done.stderr, done.stderr[-2000:]


def test_a_prompts_file_that_is_not_text_is_refused_in_one_line(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"Say hi\n\xff\xfe\n")
    done = subprocess.run(
        [sys.executable, "-m", "launch.client", "--prompts-file", str(tmp_path / "bad.txt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(
        "not UTF-8 text (invalid start byte at byte 7)"
    )


def fake_stream(replies, calls):
    """TargetClient.stream as a daemon would answer `replies` (chunk texts), noting when it is called."""

    def stream(self, **fields):
        calls.append(time.monotonic())
        for text in replies:
            if isinstance(text, BaseException):
                raise text
            yield Message("chunk", 1, {"text": text, "token_ids": [5]})
        done = {"text": "".join(replies), "token_ids": [5] * len(replies), "finish_reason": "length", "stats": {}}
        yield Message("done", 1, done)

    return stream


def test_ctrl_c_ends_the_run_while_the_terminal_is_paused(tmp_path, monkeypatch):
    """Waiting for a stalled terminal to take the output kept a client that was told to stop, and
    dflash-local with its daemons, up for good; a second signal was ignored (a review)."""
    monkeypatch.setattr(client, "wait_ready", lambda *a, **k: True)
    monkeypatch.setattr(TargetClient, "stream", fake_stream(["Once", KeyboardInterrupt()], []))
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        client.run(client_args(tmp_path, "ipc:///nowhere", "hi"), out=PausedTerminal(paused_s=30))
    assert time.monotonic() - began < 10


def test_the_next_prompt_waits_for_the_last_answer_to_be_written(tmp_path, monkeypatch):
    """The next request went out while the last answer still waited for a paused terminal: 20
    answers queued, 418 MB (a review). One answer at most waits now."""
    calls = []
    monkeypatch.setattr(client, "wait_ready", lambda *a, **k: True)
    monkeypatch.setattr(TargetClient, "stream", fake_stream(["Once", " upon"], calls))
    out = PausedTerminal(paused_s=1.0)
    client.run(client_args(tmp_path, "ipc:///nowhere", "one", "two"), out=out)
    assert len(calls) == 2 and calls[1] - calls[0] >= 0.9 and out.getvalue().count("Once upon") == 2


def test_output_the_printer_cannot_write_fails_the_run(tmp_path, monkeypatch):
    """Text the terminal's encoding could not take ended the printer's thread: nothing more was
    shown, and the client exited 0 (a review)."""

    class AsciiTerminal(io.StringIO):
        def write(self, text):
            text.encode("ascii")
            return super().write(text)

    monkeypatch.setattr(client, "wait_ready", lambda *a, **k: True)
    monkeypatch.setattr(TargetClient, "stream", fake_stream(["héllo"], []))
    with pytest.raises(UnicodeEncodeError):
        client.run(client_args(tmp_path, "ipc:///nowhere", "hi"), out=AsciiTerminal())


def test_no_standard_input_is_a_one_line_error():
    import os

    done = subprocess.run(
        [sys.executable, "-m", "launch.client", "--prompts-file", "-"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.close(0),
    )
    assert done.returncode == 2 and "no standard input" in done.stderr.strip().splitlines()[-1], done.stderr


def test_a_close_while_a_request_is_being_sent_cancels_it_too(served, monkeypatch):
    """close() from another thread took its list of calls while a stream's request was on its way
    out, before the stream registered it: that request ran to its end (an audit)."""
    import frontend.target_client as target_client

    sending, close_taken = threading.Event(), threading.Event()

    class SlowToRegister(target_client.GenerateCall):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sending.set()
            close_taken.wait(10)  # the request is out; close() runs now, before it is registered

    monkeypatch.setattr(target_client, "GenerateCall", SlowToRegister)
    shared = TargetClient(served, timeout_s=60)
    ended = []

    def read() -> None:
        ended.append(shared.generate(prompt="Once upon a time", max_new_tokens=200))

    reader = threading.Thread(target=read)
    reader.start()
    assert sending.wait(30)
    shared.close()
    close_taken.set()
    reader.join(60)
    assert ended and ended[0]["finish_reason"] == "cancelled"
    assert shared.generate(prompt="Once", max_new_tokens=2)["finish_reason"] == "length"  # the client serves on
