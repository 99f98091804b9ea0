"""The target daemon's datastore (target_node.drafting.datastore), indexed from an answer store:
every stored answer of the served model, built once and kept under the cache by the shards'
fingerprint, so a restart maps it from disk in a moment where reading the store takes a minute.

A daemon does not wait for a build (`datastore_coming`): it serves without the branch while a
process of its own builds the index, and maps it when done. Building the committed store held
every start after a shard changed 58 s, at 4.9 GB (an audit)."""

from __future__ import annotations

import argparse
import atexit
import errno
import fcntl
import hashlib
import json
import logging
import lzma
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from answers.store import STORE, Answer, AnswerStoreError, open_shard, read_shard, shard_lines, shard_paths
from basics.files import left_by_gone_writers
from target_node import CACHE_ROOT
from target_node.drafting.datastore import Datastore

log = logging.getLogger("datastore")

INDEX_FORMAT = "3"  # in every index's fingerprint: a change to what an index holds builds them again
TOKEN_LIMIT = 1 << 31  # ids at or past it are no token id (a store's file is anyone's to write)
KEEP = 3  # a store's indexes kept: a store that grows (recorded traffic) would leave one per restart


@dataclass(frozen=True)
class Index:
    """Where the index of one answer store's answers of one model lives, and what it is built from."""

    where: Path
    shards: tuple[Path, ...]
    model_name: str
    source: str  # the store's folder: indexes are pruned per store

    def load(self) -> Datastore | None:
        """The index, where it is built whole (one that cannot be read is removed)."""
        if not (self.where / "bits").is_file():
            return None
        try:
            store = Datastore.load(self.where)
            store.check()
            return store
        except Exception as exc:  # cut short, garbage, another version's: numpy raises all sorts
            log.warning("datastore: the index %s cannot be read (%s): building it again", self.where, exc)
            shutil.rmtree(self.where, ignore_errors=True)
            return None

    def build(self) -> None:
        """Index the answers, written aside and renamed whole, in a folder only its owner reads: it
        holds users' answers. The folder is made before the store is read: one the index could not
        be written to (read-only, not a folder) failed only once the whole store was indexed, 43 s
        and 3.0 GB for the committed store at every start (an audit). One build at a time in a
        cache: one that finds another under way waits, and keeps what it built where that is this
        index (two daemons starting at once each built it, twice the memory: an audit)."""
        self.where.parent.mkdir(parents=True, exist_ok=True)
        with _one_build(self.where.parent) as alone:
            if self.load() is None:  # else built meanwhile by another process
                self._build(alone)

    def _build(self, alone: bool) -> None:
        aside = self.where.with_name(f"{self.where.name}.{os.getpid()}.tmp")
        shutil.rmtree(aside, ignore_errors=True)  # a dead builder's, whose pid this one has now
        try:
            aside.mkdir(mode=0o700)
            tails = list(answer_tails(self.shards, self.model_name))
            Datastore.build(tails).save(aside)
            (aside / "source").write_text(self.source)
            if self.where.is_dir() and not (self.where / "bits").is_file():  # half removed: never whole
                shutil.rmtree(self.where, ignore_errors=True)
            aside.rename(self.where)
        except BaseException as exc:  # a full disk, a folder not ours, a stop: nothing left behind
            shutil.rmtree(aside, ignore_errors=True)
            if isinstance(exc, OSError) and (self.where / "bits").is_file():  # another process's, whole
                return
            raise
        log.info("datastore: %d answers of %s indexed into %s", len(tails), self.model_name, self.where)
        prune(self.where.parent, self.model_name, KEEP, self.source, alone)

    def command(self) -> list[str]:
        """The command that builds this index in a process of its own: it finds the shards itself
        (their paths on the command line passed the system's limit at about 34,000: a review)."""
        where = [self.source, self.model_name, str(self.where.parent.parent.resolve())]
        return [sys.executable, "-m", "answers.index", "--build", *where]


@contextmanager
def _one_build(folder: Path) -> Iterator[bool]:
    """`folder` (the indexes') locked while the block runs: a lock on the folder itself, no file among
    the indexes; released however the holder ends. A file system that cannot lock goes without
    (False: another builder may be writing its part there meanwhile)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("datastore: waiting for another process's build in %s", folder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # ENOLCK: a mount without locks
            log.warning("datastore: building without a lock in %s (%s)", folder, exc)
            yield False
            return
        yield True
    finally:
        os.close(fd)


def index_for(choice: str, model_name: str, cache: Path = CACHE_ROOT) -> Index | None:
    """`choice`: `none`; `auto`, the committed answer store (data/answers), where it exists; or an
    answer store's folder (a deployment's recorded traffic, say). Only answers `model_name` wrote
    are indexed (token ids mean nothing to another model); None where there are none."""
    if choice == "none":
        return None
    folder = STORE if choice == "auto" else Path(choice)
    if choice != "auto" and not folder.is_dir():
        raise FileNotFoundError(f"--datastore {choice}: no such answer store folder")
    try:  # a folder this user may not read, a shard removed meanwhile: a traceback stopped the daemon
        shards = tuple(shard for shard in shard_paths(folder) if first_model(shard) == model_name)
        source = str(folder.resolve())
        name = f"{model_name}-{fingerprint(shards, model_name, INDEX_FORMAT, source)}"
    except OSError as exc:
        log.error("datastore: cannot read the answer store %s (%s): serving without it", folder, exc)
        return None
    if not shards:
        log.info("datastore: no answers of %s in %s", model_name, folder)
        return None
    return Index(cache / "datastore" / name, shards, model_name, source)


def datastore_for(
    choice: str, model_name: str, cache: Path = CACHE_ROOT, vocab_size: int | None = None
) -> Datastore | None:
    """The datastore (see index_for), built here and now where it is not yet. Only ids below
    `vocab_size` are proposed (a store of a same-named model with more tokens crashed the forward:
    an audit). A shard or an answer that cannot be read is skipped, an index that cannot be read is
    built again, and one that cannot be built leaves the caller without (each logged): the
    datastore is a shortcut, never a reason not to serve."""
    index = index_for(choice, model_name, cache)
    if index is None:
        return None
    store = index.load()
    if store is None:
        try:
            build_saying_so(index)
        except Exception as exc:  # a full disk, a folder not ours
            log.error("datastore: could not build %s (%s): serving without it", index.where, exc)
            return None
        store = index.load()
    return _serving(store, index, vocab_size)


def build_saying_so(index: Index) -> None:
    """Build `index`, logging that it does (once: later starts map it)."""
    shards, source = len(index.shards), index.source
    log.info("datastore: indexing %d shards of %s's answers in %s (once)", shards, index.model_name, source)
    index.build()


def datastore_coming(
    choice: str, model_name: str, cache: Path = CACHE_ROOT, vocab_size: int | None = None
) -> Future[Datastore | None]:
    """The datastore as datastore_for gives it, mapped now where its index is built, else built by
    a process of its own (at a lower priority), which stops when this process does: the daemon
    serves without the branch meanwhile. The future never fails: a build that does, logs why."""
    coming: Future[Datastore | None] = Future()
    index = index_for(choice, model_name, cache)
    store = index.load() if index is not None else None
    if index is None or store is not None:
        coming.set_result(_serving(store, index, vocab_size) if store is not None else None)
        return coming
    log.info("datastore: building the index of %s's answers in %s while serving without it", model_name, index.source)
    threading.Thread(target=_build_aside, args=(index, vocab_size, coming), daemon=True).start()
    return coming


_stopping = threading.Event()  # this process is ending: a builder it stops has not failed


def _build_aside(index: Index, vocab_size: int | None, coming: Future[Datastore | None]) -> None:
    """Run the builder and map what it built. It runs in the package's own folder (a `training`
    package in the daemon's folder was imported in its place: a review), reads its standard input
    to notice this process end (SIGKILL included: builders outlived their daemons and piled up, a
    review) and ignores Ctrl-C, which is this process's to handle."""
    store = None
    try:
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        builder = subprocess.Popen(index.command(), cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        atexit.register(_stop, builder)
        said = builder.stdout.read().decode(errors="replace").splitlines()  # the index it built, as it ends
        code = builder.wait()
        store = _built_by(said[-1] if said and code == 0 else "", index)
        if store is None and not _stopping.is_set():
            log.error("datastore: the build of %s ended with code %s: serving without it", index.where, code)
        store = _serving(store, index, vocab_size) if store is not None else None
    except Exception as exc:
        log.error("datastore: could not build %s (%s): serving without it", index.where, exc)
        store = None
    finally:  # whatever happened: the daemon asks for it once the build ends
        coming.set_result(store)


def _built_by(said: str, index: Index) -> Datastore | None:
    """The index the builder said it built, or one another process built since of the store as it
    is now. The builder's, where the store changed during the build (a generator's shard flushed
    each minute, a daemon recording into the store it serves): the daemon looked only for the
    newer store's index, found none and served without the datastore for good (an audit). Any
    index of the store serves exactly: its continuations are verified."""
    now = index_for(index.source, index.model_name, index.where.parent.parent)
    store = now.load() if now is not None else None
    if store is None and said and Path(said).parent == index.where.parent:
        store = Index(Path(said), (), index.model_name, index.source).load()
    return store


def _stop(builder: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop the builder as this process ends; its handler removes its part-built index."""
    _stopping.set()
    if builder.poll() is None:
        builder.terminate()
        try:
            builder.wait(grace_s)
        except subprocess.TimeoutExpired:  # deep in one sort: its part is pruned once it is gone
            builder.kill()


def _serving(store: Datastore, index: Index, vocab_size: int | None) -> Datastore:
    store.vocab_size = vocab_size
    log.info(
        "datastore: %d positions of %s's earlier answers, mapped from %s", len(store), index.model_name, index.where
    )
    return store


def answer_tails(shards: Iterable[Path], model_name: str) -> Iterator[np.ndarray]:
    """The answer ids (past the prompt) of `model_name`'s answers, each key once (two generators on
    one seed wrote 2,900 twice, which the datastore counted twice: an audit), a shard at a time (the whole
    store as Python objects took 140 bytes a position). An answer whose ids are not ids (strings,
    nulls, nested, past 2**31) is skipped with a warning: one stopped every daemon's start."""
    bad, seen = 0, set()
    for shard in shards:
        for answer in _readable(shard):
            if answer.model != model_name or answer.key in seen:  # the first copy, as readers keep
                continue
            seen.add(answer.key)
            tail = _tail(answer)
            if tail is None:
                bad += 1
            else:
                yield tail
    if bad:
        log.warning("datastore: skipped %d answers of %s whose token ids are not ids", bad, model_name)


def _tail(answer: Answer) -> np.ndarray | None:
    start = answer.prompt_len
    if type(start) is not int or not isinstance(answer.tokens, list) or not 0 <= start <= len(answer.tokens):
        return None
    try:
        tail = np.asarray(answer.tokens[start:])
    except (ValueError, TypeError, OverflowError):  # ragged, or ints numpy cannot hold
        return None
    if tail.ndim != 1 or (len(tail) and (tail.dtype.kind not in "iu" or tail.min() < 0 or tail.max() >= TOKEN_LIMIT)):
        return None
    return tail.astype(np.int32)


def _readable(shard: Path) -> list[Answer]:
    try:
        return read_shard(shard)
    except AnswerStoreError as exc:
        log.warning("datastore: %s", exc)
        return []


def prune(folder: Path, model_name: str, keep: int, source: str, alone: bool = False) -> list[Path]:
    """Delete all but the `keep` newest whole indexes of `model_name` built from the store at
    `source` (170 MB each for the committed store: an index is built again whenever its store
    gains a shard); another store's are its own to prune (pruning per model deleted them, and their
    daemons built them again), unless that store is gone (`_gone`): a clone's index (500 MB) stayed
    after the clone was deleted, for good (an audit). Indexes of an older format, which no daemon maps again,
    go too, and the parts of builds whose process is gone (`alone`, holding the cache's build lock: at
    once; else once untouched for basics.files.QUIET_S, as a writer in another container has a pid
    this one cannot see). A daemon still serving a deleted index keeps its memory map. Returns what
    it deleted."""
    whole = [d for d in folder.glob(f"{model_name}-*") if _is_index(d, model_name)]
    mine = sorted((d for d in whole if _source(d) == source), key=lambda d: (d / "bits").stat().st_mtime, reverse=True)
    gone = [d for d in whole if (store := _source(d)) is not None and store != source and _gone(store)]
    stale = mine[keep:] + [d for d in whole if _source(d) is None] + gone
    stale += [d for d in folder.glob(f"{model_name}-*.tmp") if _is_index(d.with_suffix(""), model_name, False)]
    stale = [
        d for d in stale if d.suffix != ".tmp" or left_by_gone_writers([d], d.with_suffix("").stem + ".", not alone)
    ]
    for folder_gone in stale:
        shutil.rmtree(folder_gone, ignore_errors=True)
        log.info("datastore: removed the stale index %s", folder_gone)
    return stale


def _gone(store: str) -> bool:
    """Whether the store an index was built from is no more: not there, or no folder. One this user
    cannot see into is not gone (a PermissionError ended the prune: a review); one on a disk not
    mounted now looks gone, and its index is built again once it is back."""
    try:
        return not stat.S_ISDIR(os.stat(store).st_mode)
    except FileNotFoundError:
        return True
    except OSError as exc:
        return exc.errno == errno.ENOTDIR


def _source(index: Path) -> str | None:
    try:
        return (index / "source").read_text()
    except OSError:
        return None


def _is_index(folder: Path, model_name: str, whole: bool = True) -> bool:
    """Whether `folder` is a whole index of `model_name`'s (not of a model whose name merely starts so)."""
    tail = folder.name[len(model_name) + 1 :]
    if not whole:  # NAME.PID
        tail = tail.split(".")[0]
    return len(tail) == 16 and all(c in "0123456789abcdef" for c in tail) and (not whole or (folder / "bits").is_file())


def first_model(shard: Path) -> str:
    """The model that wrote a shard's first answer (a shard is one run's: one model's); "" for a
    shard that cannot be read (one broken file stopped every daemon's start: an audit)."""
    try:
        with open_shard(shard) as fh:
            line = next(shard_lines(fh), "")
        return json.loads(line).get("model", "") if line.strip() else ""
    except (OSError, EOFError, lzma.LZMAError, json.JSONDecodeError, AttributeError, AnswerStoreError) as exc:
        log.warning("datastore: skipping %s, which cannot be read (%s)", shard, exc)
        return ""


def fingerprint(files: Iterable[Path], *extra: str) -> str:
    """A name for the datastore built from these files (by name, size and time) and `extra`."""
    h = hashlib.sha1()
    for f in sorted(files):
        stat = f.stat()
        h.update(f"{f.name}:{stat.st_size}:{int(stat.st_mtime)}".encode())
    for e in extra:
        h.update(e.encode())
    return h.hexdigest()[:16]


def main() -> None:
    """Index an answer store now, where its index is not built yet (the demo's set-up does, once
    per machine and store), or, with --build, the builder process datastore_coming starts."""
    from target_node.model.default_model import DEFAULT_MODEL_DIR

    parser = argparse.ArgumentParser(
        prog="python -m answers.index", description="index an answer store for the target daemon's datastore branch"
    )
    parser.add_argument("--datastore", default="auto", help="auto (the committed data/answers) or a store's folder")
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR.name, help="the served model's folder name")
    parser.add_argument("--build", nargs=3, metavar=("STORE", "MODEL", "CACHE"), help="a daemon's builder")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not args.build:
        try:
            index = index_for(args.datastore, args.model)
        except FileNotFoundError as exc:
            parser.error(str(exc))
        try:
            _built(index)
        except KeyboardInterrupt:  # its part is removed on the way: the shell's code, not a traceback
            raise SystemExit(130) from None
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the build removes its part on a stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon's Ctrl-C: it stops this builder itself
    threading.Thread(target=_end_with_parent, daemon=True).start()
    os.nice(10)  # the daemon's requests come first
    store, model_name, cache = args.build
    index = index_for(store, model_name, Path(cache))
    _built(index)
    if index is not None:  # where its daemon finds it, whatever the store is by then
        print(index.where, flush=True)


def _built(index: Index | None) -> None:
    """Build `index` where it is not built yet; one logged line and exit 1 where the disk refuses
    it (a traceback in the daemon's log, and exit 0 from the command, before: an audit)."""
    if index is None or index.load() is not None:
        return
    try:
        build_saying_so(index)
    except OSError as exc:
        log.error("datastore: could not build %s (%s)", index.where, exc.strerror or exc)
        raise SystemExit(1) from None


END_GRACE_S = 5.0  # what a builder whose daemon ended gives its own SIGTERM before it exits outright


def _end_with_parent() -> None:
    """The daemon holds this builder's standard input open: it ends when the daemon does. Raw
    reads: a thread blocked in `sys.stdin.buffer.read()` holds the buffer's lock, and a builder
    stopped meanwhile died with "Fatal Python error: _enter_buffered_busy" (an audit)."""
    while os.read(0, 4096):
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    # A SIGTERM whose C handler runs just before the main thread blocks in a system call (a shard
    # that is a FIFO, a stalled mount) never reaches its Python handler: that builder outlived its
    # daemon for good (1 run of the test in ~30, under load). Its part is then a dead pid's, which
    # the next build removes.
    time.sleep(END_GRACE_S)
    os._exit(1)


if __name__ == "__main__":
    main()
