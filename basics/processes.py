"""Child processes that end with the process that started them, however it ends."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
try:  # looked up here, not between fork and exec
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def a_torchrun_rank_ends_with_its_launcher() -> None:
    """Under torchrun (WORLD_SIZE > 1), this process gets SIGTERM when its launcher dies, killed or
    not: a torchrun killed left its ranks training and rewriting state.pt and --out, for good (an
    audit). Called first thing: a launcher gone before this call is not seen (a review)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        dies_with(os.getppid())()


def dies_with(parent: int) -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGTERM when `parent` (the process that starts it: pass
    os.getpid()) ends, even by SIGKILL or a crash, whose daemons were left serving, 2.3 GB and their
    ports held (an audit). Linux's prctl; elsewhere it does nothing. The thread that starts the
    child must outlive it. Called in a child already running (`dies_with(os.getppid())()`), it
    arms the child itself: a torchrun rank."""

    def arm() -> None:
        if _prctl is None:
            return
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent ended before the prctl took
            os.kill(os.getpid(), signal.SIGTERM)

    return arm
