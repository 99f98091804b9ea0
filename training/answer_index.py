"""The target daemon's datastore (target_node.drafting.datastore), indexed from an answer store:
every stored answer of the served model, built once and kept under the cache by the shards'
fingerprint, so a restart maps it from disk in a moment where reading the store takes seconds."""

from __future__ import annotations

import hashlib
import json
import logging
import lzma
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from target_node import CACHE_ROOT
from target_node.drafting.datastore import Datastore
from training.answer_store import STORE, AnswerStoreError, open_shard, read_shard, shard_paths

log = logging.getLogger("datastore")


def datastore_for(
    choice: str, model_name: str, cache: Path = CACHE_ROOT, vocab_size: int | None = None
) -> Datastore | None:
    """`choice`: `none`; `auto`, the committed answer store (data/answers), where it exists; or an
    answer store's folder (a deployment's recorded traffic, say). Only answers `model_name` wrote
    are indexed (token ids mean nothing to another model), and only ids below `vocab_size` are
    proposed (a store of a same-named model with more tokens crashed the forward: an audit);
    None where there are none. A shard that cannot be read is skipped, an index that cannot be
    read is built again, and one that cannot be written leaves the daemon without (each logged):
    the datastore is a shortcut, never a reason not to serve."""
    if choice == "none":
        return None
    folder = STORE if choice == "auto" else Path(choice)
    if choice != "auto" and not folder.is_dir():
        raise FileNotFoundError(f"--datastore {choice}: no such answer store folder")
    shards = [shard for shard in shard_paths(folder) if first_model(shard) == model_name]
    if not shards:
        log.info("datastore: no answers of %s in %s", model_name, folder)
        return None
    where = cache / "datastore" / f"{model_name}-{fingerprint(shards, model_name)}"
    store = _load(where)
    if store is None:
        try:
            _build(where, shards, model_name)
        except OSError as exc:  # a full disk, a folder not ours
            log.error("datastore: could not write %s (%s): serving without it", where, exc)
            return None
        store = Datastore.load(where)
    store.vocab_size = vocab_size
    log.info("datastore: %d positions of %s's earlier answers, mapped from %s", len(store), model_name, where)
    return store


def _load(where: Path) -> Datastore | None:
    """The index at `where`, or None where there is none whole (one cut short is removed)."""
    if not (where / "bits").is_file():
        return None
    try:
        store = Datastore.load(where)
        store.check()
        return store
    except (OSError, ValueError, EOFError) as exc:
        log.warning("datastore: the index %s cannot be read (%s): building it again", where, exc)
        shutil.rmtree(where, ignore_errors=True)
        return None


def _build(where: Path, shards: list[Path], model_name: str) -> None:
    answers = [a for shard in shards for a in _readable(shard) if a.model == model_name]
    built = Datastore.build(a.tokens[a.prompt_len :] for a in answers)
    # Written aside and renamed whole: two daemons starting at once each build, one keeps its copy.
    aside = where.with_name(f"{where.name}.{os.getpid()}.tmp")
    try:
        built.save(aside)
        aside.rename(where)
    except OSError:
        shutil.rmtree(aside, ignore_errors=True)  # a build cut short left its part behind for good
        if not (where / "bits").is_file():
            raise
    log.info("datastore: %d answers of %s indexed into %s", len(answers), model_name, where)
    prune(where.parent, model_name, keep=KEEP)


def _readable(shard: Path) -> list:
    try:
        return read_shard(shard)
    except AnswerStoreError as exc:
        log.warning("datastore: %s", exc)
        return []


KEEP = 3  # a model's indexes kept: a store that grows (recorded traffic) would leave one per restart


def prune(folder: Path, model_name: str, keep: int) -> list[Path]:
    """Delete all but the `keep` newest whole indexes of `model_name` under `folder` (170 MB each for
    the committed store): an index is built again whenever its store gains a shard. A daemon still
    serving a deleted one keeps its memory map; one that picks it as it is deleted fails to start and
    builds it again on the next try. Returns what it deleted."""
    whole = [d for d in folder.glob(f"{model_name}-*") if _is_index(d, model_name)]
    whole.sort(key=lambda d: (d / "bits").stat().st_mtime, reverse=True)
    for stale in whole[keep:]:
        shutil.rmtree(stale, ignore_errors=True)
        log.info("datastore: removed the stale index %s", stale)
    return whole[keep:]


def _is_index(folder: Path, model_name: str) -> bool:
    """Whether `folder` is a whole index of `model_name`'s (not of a model whose name merely starts so)."""
    tail = folder.name[len(model_name) + 1 :]
    return len(tail) == 16 and all(c in "0123456789abcdef" for c in tail) and (folder / "bits").is_file()


def first_model(shard: Path) -> str:
    """The model that wrote a shard's first answer (a shard is one run's: one model's); "" for a
    shard that cannot be read (one broken file stopped every daemon's start: an audit)."""
    try:
        with open_shard(shard) as fh:
            line = fh.readline()
        return json.loads(line).get("model", "") if line.strip() else ""
    except (OSError, EOFError, lzma.LZMAError, json.JSONDecodeError, AttributeError) as exc:
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
