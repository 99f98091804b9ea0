"""Child processes the launchers start: how they are stopped."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path


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
