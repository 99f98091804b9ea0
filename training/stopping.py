"""A training run that a signal stops ends between two steps, its state saved."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOPPING = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)  # kill, torchrun, systemd; a closed terminal; Ctrl-C


class Stopped(Exception):
    """The run stopped at a signal between two steps, its state saved: the command ends with the
    signal's exit code (128 + its number) and this one line."""

    def __init__(self, signum: int, step: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after step {step}; its state is saved (--resume goes on from it)")
        self.signum, self.step = signum, step


@contextmanager
def signals_between_steps() -> Iterator[list[int]]:
    """While the steps run, SIGTERM, SIGHUP or Ctrl-C is noted in the list yielded, for the loop to
    stop after the step under way and save: a run ended at once saved nothing, and every step
    since the last --save-every was lost (an audit); cut inside a step, half an optimizer step
    would be saved. A second Ctrl-C ends the run at once. A signal ignored (nohup's SIGHUP) stays
    ignored; off the main thread, where no handler can be set, nothing changes."""
    heard: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield heard
        return

    def note(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and signal.SIGINT in heard:
            raise KeyboardInterrupt
        heard.append(signum)

    before = {signum: signal.getsignal(signum) for signum in STOPPING}
    for signum, handler in before.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, note)
    try:
        yield heard
    finally:
        for signum, handler in before.items():
            if handler is not None:  # None: set outside Python, which cannot be put back
                signal.signal(signum, handler)
