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


def _leave(signum: int, frame: object) -> None:
    """SIGTERM: end as Ctrl-C does, through the code that stops the daemons; a second signal then
    must not cut that short (it skipped the SIGKILL of a daemon that would not stop, a review)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(143)


def ends_on_sigterm(main: Callable[P, R]) -> Callable[P, R]:
    """A script's `main` (one that starts daemons) ends on SIGTERM (systemd, docker stop, kill)
    through its `finally` blocks, which stop them: by default it ended the script alone and left
    them running (dflash-local, then the benchmarks: audits). The handlers it found are back when
    `main` returns or raises, so a signal after the clean-up (threads still winding down) ends the
    process as usual. Scripts only: set by the library's daemon(), it made a test run ignore
    SIGTERM and Ctrl-C for good (a review)."""

    @functools.wraps(main)
    def ending(*args: P.args, **kwargs: P.kwargs) -> R:
        if threading.current_thread() is not threading.main_thread():
            return main(*args, **kwargs)
        before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        if before[0] is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _leave)
        try:
            return main(*args, **kwargs)
        finally:
            signal.signal(signal.SIGTERM, before[0])
            signal.signal(signal.SIGINT, before[1])

    return ending


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
