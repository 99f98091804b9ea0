"""Files written whole or not at all: checkpoints, a training run's state, the answer store's shards
and the feature cache's index (the standard library only, so light modules may use it)."""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("dflash")


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write` the file beside `path`, sync it and rename it over `path`: a reader, a process killed
    meanwhile or a power cut find the old file or the new one, never part of one. The old file's
    permissions carry over. Each writer has a partial file of its own (NAME.PID-THREAD.tmp): two
    processes filling one cache removed each other's, and one failed (an audit). Partial files
    whose writers are gone (killed; read-only, perhaps) are removed first, or they failed every
    later write (a review). A write that fails (a full disk) takes its partial file with it:
    left, they kept the disk full (an audit)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    _remove_partials_of_gone_writers(path, tmp)
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


def _remove_partials_of_gone_writers(path: Path, mine: Path) -> None:
    path.with_name(path.name + ".tmp").unlink(missing_ok=True)  # of a version that named none
    mine.unlink(missing_ok=True)
    for part in left_by_gone_writers(path.parent.glob(f"{glob.escape(path.name)}.*.tmp"), path.name + "."):
        part.unlink(missing_ok=True)


# A partial file or folder untouched this long is no write under way, whatever its name's pid says.
QUIET_S = 600.0


def left_by_gone_writers(parts: Iterable[Path], prefix: str = "", quiet: bool = True) -> list[Path]:
    """Of `parts`, each named PREFIX + its writer's pid (then "-" or "." and more), those whose
    writer is gone: a killed writer's partial file or folder, for its next writer to remove. A
    name without a pid is not ours to judge: left alone. Gone means no such process here *and*
    untouched for QUIET_S: a writer in another container sharing the folder has a pid this one
    cannot see, and its part was removed as it wrote (an audit). `quiet` False: the caller holds a
    lock every writer takes, so no process alive is writing, and the wait is not needed."""
    gone = []
    for part in parts:
        writer = part.name[len(prefix) :].split("-")[0].split(".")[0]
        if writer.isdigit() and not process_alive(int(writer)) and (not quiet or _quiet(part)):
            gone.append(part)
    return gone


def _quiet(part: Path) -> bool:
    """Untouched for QUIET_S: a folder by what is in it too (a file written inside, a model's
    weights, leaves the folder's own time as it was: a review)."""
    try:
        touched = part.lstat().st_mtime
        if part.is_dir():
            with os.scandir(part) as entries:
                touched = max([touched, *(entry.stat(follow_symlinks=False).st_mtime for entry in entries)])
        return time.time() - touched > QUIET_S
    except OSError:
        return False  # removed meanwhile


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs; one this process may not signal (another user's) counts as
    running, its files not ours to judge."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True
    return True


@contextmanager
def locked(folder: Path, work: str = "") -> Iterator[None]:
    """One process at a time in `folder`: concurrent starts wait for one build or conversion, and
    say so where `work` names it (behind a holder stopped with Ctrl-Z, every daemon's start waited
    without a word: an audit)."""
    with _flock(folder / ".lock") as (lock, mine):
        if not mine:
            if work:
                log.warning("waiting for another process's %s in %s", work, folder)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextmanager
def claimed(folder: Path) -> Iterator[bool]:
    """`folder` held by this process alone while the block runs: True, or False where another
    process holds it (the caller refuses). Released however the holder ends, a kill included."""
    with _flock(folder / ".claim") as (_, mine):
        yield mine


@contextmanager
def _flock(path: Path) -> Iterator[tuple[int, bool]]:
    """The lock file at `path` open, and whether this process took it without waiting. Opened for
    reading: flock needs no more, and a lock file another user made, in a folder this one may
    write, raised PermissionError (an audit)."""
    lock = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            mine = True
        except BlockingIOError:
            mine = False
        yield lock, mine
    finally:
        os.close(lock)


def umask() -> int:
    """This process's umask, read where Linux shows it: os.umask reads it only by setting it, and
    another thread's files made meanwhile would get the mask set; here the strictest one."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def as_umask_allows(path: Path, mode: int = 0o666) -> None:
    """`path` readable as the umask allows: safetensors and mkstemp make their files 0600 whatever
    it says, and the other users of a shared cache or checkpoint could not load them (an audit)."""
    os.chmod(path, mode & ~umask())


def mended_mode(path: Path, mode: int = 0o666) -> None:
    """A file of this user's that an older version wrote before `as_umask_allows` (a 0600 model,
    a 0711 kernel library) gets the mode it would be written with now: an upgrade kept locking the
    cache's other users out (an audit). Only such a file: one its owner opened to some (0640) keeps
    its mode (a review), as does another user's, or one on a read-only disk."""
    try:
        info = path.stat()
        if info.st_uid == os.getuid() and info.st_mode & 0o044 == 0 and mode & ~umask() & 0o044:  # none may read
            as_umask_allows(path, mode)
    except OSError:
        pass
