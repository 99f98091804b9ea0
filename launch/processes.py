"""Child processes the launchers start: how they are stopped."""

from __future__ import annotations

import signal
import subprocess


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
