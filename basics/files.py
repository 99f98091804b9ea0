"""Files written whole or not at all: checkpoints, a training run's state, the answer store's shards
and the feature cache's index (the standard library only, so light modules may use it)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write` the file beside `path`, sync it and rename it over `path`: a reader, a process killed
    meanwhile or a power cut find the old file or the new one, never part of one. The old file's
    permissions carry over; a partial file a killed write left (read-only, perhaps) is removed
    first, or it failed every later write (a review). A write that fails (a full disk) takes its
    partial file with it: left, they kept the disk full (an audit)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        write(tmp)
        if path.exists():
            shutil.copymode(path, tmp)
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
