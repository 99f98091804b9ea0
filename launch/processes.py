"""Child processes the launchers start: how they are stopped."""

from __future__ import annotations

import functools
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


ENDING = (signal.SIGTERM, signal.SIGHUP)  # kill, systemd, docker stop; a terminal closed or an ssh cut


def leave(signum: int, frame: object) -> None:
    """SIGTERM or SIGHUP: end as Ctrl-C does, through the code that stops the daemons; a second
    signal then must not cut that short (it skipped the SIGKILL of a daemon that would not stop, a
    review)."""
    for ignored in (*ENDING, signal.SIGINT):
        signal.signal(ignored, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def ends_on_sigterm(main: Callable[P, R]) -> Callable[P, R]:
    """A script's `main` (one that starts daemons) ends on SIGTERM or SIGHUP (see ENDING) through
    its `finally` blocks, which stop them: by default it ended the script alone and left them
    running, with their temporary CURVE keys on disk (dflash-local, then the benchmarks: audits).
    The handlers it found are back when `main` returns or raises, so a signal after the clean-up
    (threads still winding down) ends the process as usual. Scripts only: set by the library's
    daemon(), it made a test run ignore SIGTERM and Ctrl-C for good (a review)."""

    @functools.wraps(main)
    def ending(*args: P.args, **kwargs: P.kwargs) -> R:
        if threading.current_thread() is not threading.main_thread():
            return main(*args, **kwargs)
        before = {signum: signal.getsignal(signum) for signum in (*ENDING, signal.SIGINT)}
        for signum in ENDING:
            if before[signum] is signal.SIG_DFL:
                signal.signal(signum, leave)
        try:
            return main(*args, **kwargs)
        finally:
            for signum, handler in before.items():
                signal.signal(signum, handler)

    return ending


def stop_on_signals() -> threading.Event:
    """SIGTERM, SIGINT and SIGHUP set the returned event, and a daemon's poll loop ends cleanly,
    telling its clients their requests did not finish. SIGHUP killed a daemon outright (a closed
    terminal: its clients waited out their timeouts, its ipc file stayed); one ignored, as under
    nohup, stays ignored."""
    stop, heard = threading.Event(), []

    def handler(signum: int, frame: object) -> None:
        # Once: a second signal's handler runs inside the first's, and stop.set() took the lock
        # that one held, for good (a SIGTERM and a SIGHUP together left a daemon hung, 1 in 6).
        if not heard:
            heard.append(signum)
            stop.set()

    for signum in (*ENDING, signal.SIGINT):
        if signum != signal.SIGHUP or signal.getsignal(signum) is not signal.SIG_IGN:  # a shell's `&` ignores SIGINT
            signal.signal(signum, handler)
    return stop


def ctrl_c_exits_130(main: Callable[P, R]) -> Callable[P, R]:
    """A daemon's `main`: Ctrl-C while the model loads ends with the shell's code for it, not a
    traceback (serving, `stop_on_signals` stops the loop cleanly)."""

    @functools.wraps(main)
    def exiting(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt:
            raise SystemExit(130) from None

    return exiting


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM, so a daemon closes its sockets and sessions; SIGKILL if it has not exited in `grace_s`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rss_mb(pid: int) -> float:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")
