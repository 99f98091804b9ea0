"""Child processes the launchers start: how they are stopped."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path


def _leave(signum: int, frame: object) -> None:
    """SIGTERM: end as Ctrl-C does, through the code that stops the daemons; a second signal then
    must not cut that short (it skipped the SIGKILL of a daemon that would not stop, a review)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(143)


def end_on_sigterm() -> None:
    """Make a SIGTERM (systemd, docker stop, kill) end this process through its `finally` blocks,
    which stop the daemons it started: by default it ended the process alone and left them
    running (dflash-local, then every benchmark that starts daemons: audits). Only where nothing
    else handles SIGTERM, and only from the main thread (where Python runs handlers)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _leave)


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
