"""The feature cache: tapped target features for stored answers, rebuilt from their token ids.

Features are bulky (a row of len(taps) x hidden fp16 values per position: 5.8 KB for
SmolLM2 with 5 taps) and belong to one target, one set of taps and the dtype the target ran
in, so they live in the cache folder (`feature_folder`), never in the repository. They are
the rows serving taps: computed on the target's engine in the dtype the daemon serves in (bf16
where the device computes it natively), so the drafter trains on what it will be fed.
Generation writes the features it captured on the way for free; anything else (answers from
another machine, recorded traffic) is filled in by batched prefill on the same engine.

features.f16 holds rows back to back; index.jsonl maps an answer key to its first row and
row count; meta.json names the row width and the target whose rows they are (a folder is named
after the model folder's name alone: another model of that name was refused, not read). Rows are
written before their index line, so a crash leaves at most an unreferenced tail, which the next
open cuts off; rows missing under an index are never padded: the last few entries' (a crash after
their index lines) are dropped, to be filled again, and more (a truncated copy) are refused. The index
is rewritten whole, to a new file renamed over the old one. Several processes may fill one cache (two
generators on two cores): each write holds an exclusive lock on the folder and takes its
offset from the file as it is then, never from a count of its own.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from answers.store import Answer
from basics.files import locked, write_atomically
from target_node.model.target import TargetModel

WINDOW = 512  # answers sorted by length together when filling (see FeatureCache.fill)
MAX_ROWS = 1024  # an answer's rows a cache fill or a live forward computes: training reads no further
KEEP_FREE = 4 * 2**30  # bytes a cache leaves free on its disk at least (see DiskReserve)
KEEP_FREE_SHARE = 0.10  # and this share of the disk, where that is more


class FeatureCacheError(ValueError):
    """A feature cache that does not hold what its opener asks for, or lost rows."""


def half_rows(features: torch.Tensor, whose: str) -> torch.Tensor:
    """`features` as the float16 rows the cache stores and training reads. Rows past float16's range
    (65,504: a large model's outlier channels can reach it) would be inf, and the drafter's loss a
    NaN that says nothing of why: refused here with the peak instead."""
    half = features.to(torch.float16)
    if not torch.isfinite(half).all() and torch.isfinite(features).all():
        peak = features.abs().max().item()
        raise FeatureCacheError(
            f"{whose}: its feature rows reach {peak:.4g}, past float16's range (65504), in which features "
            "are cached and trained on: this target's taps cannot be trained on yet"
        )
    return half


LOST_ENTRIES = 4  # entries whose rows a cache drops at open, where its file ends before them (more: refused)


VOLATILE_CONFIG = ("transformers_version", "_name_or_path", "_model_name_or_path", "torch_dtype", "dtype")
SAMPLE_BYTES = 1 << 20  # of each weights file's start and end, hashed into a model's identity


def model_identity(folder: str | Path) -> str:
    """What tells one target's weights from another's without reading them all: its config (less
    what a save or a transformers version changes) and the first and last MiB of each weights
    file (a fine-tune of the same shape has the config and the sizes of its base)."""
    folder = Path(folder)
    digest = hashlib.sha256()
    config = folder / "config.json"
    if config.is_file():
        try:
            fields = {k: v for k, v in json.loads(config.read_text()).items() if k not in VOLATILE_CONFIG}
            digest.update(json.dumps(fields, sort_keys=True).encode())
        except (json.JSONDecodeError, AttributeError):
            digest.update(config.read_bytes())
    for path in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        size = path.stat().st_size
        with open(path, "rb") as fh:
            digest.update(f"{path.name}:{size};".encode() + fh.read(SAMPLE_BYTES))
            fh.seek(max(0, size - SAMPLE_BYTES))
            digest.update(fh.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


IDENTITY_SCHEME = 2  # meta.json's "identity": how its "model" was computed (none recorded: scheme 1)


def first_identity(folder: str | Path) -> str:
    """`model_identity` as a cache recorded it before 2026-12-06 (scheme 1): the config's bytes and
    the weight files' names and sizes. Such a cache of the same target is taken and restamped; it was
    refused as another target's, its rows to be filled again (an audit)."""
    folder = Path(folder)
    digest = hashlib.sha256()
    config = folder / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        digest.update(f"{path.name}:{path.stat().st_size};".encode())
    return digest.hexdigest()[:16]


def _weights_written_before(folder: str | Path, stamp: Path) -> bool:
    weights = sorted(Path(folder).glob("*.safetensors")) + sorted(Path(folder).glob("*.bin"))
    return all(w.stat().st_mtime <= stamp.stat().st_mtime for w in weights)


class DiskReserve:
    """The room a feature cache leaves on its disk: `keep_free` bytes (by default 4 GiB or a tenth
    of the disk, whichever is more), or half of what was free when it began where that is less.
    Rows cost 5.8 KB a token, so a fast device's fill, or a generator left running for hours,
    outruns the disk (this machine's once had 0.7 GB left, cached rows the most of what filled it,
    and the next CI run on it could not install torch); a disk that starts nearly full still takes
    what fits."""

    def __init__(self, folder: Path, keep_free: int | None = None) -> None:
        self.folder = folder
        usage = shutil.disk_usage(folder)
        wanted = max(KEEP_FREE, int(KEEP_FREE_SHARE * usage.total)) if keep_free is None else keep_free
        self.floor = min(wanted, usage.free // 2)

    def full(self) -> bool:
        return shutil.disk_usage(self.folder).free < self.floor


def feature_folder(cache: str | Path, model: str | Path, layer_ids: tuple[int, ...], dtype: torch.dtype) -> Path:
    """Where one target's features for these taps, computed in `dtype`, live under the cache
    (fp32 features keep the folder name they had before the dtype was part of it)."""
    name = f"{Path(model).name}-taps{'-'.join(map(str, layer_ids))}"
    if dtype != torch.float32:
        name += "-" + str(dtype).removeprefix("torch.")
    return Path(cache) / "features" / name


class FeatureCache:
    def __init__(self, folder: str | Path, width: int, readonly: bool = False, model: str | Path | None = None) -> None:
        """`model`: the target's folder, whose identity the cache records (or checks, where it
        recorded one): rows of another target are refused."""
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.width = width
        self.index_path = self.folder / "index.jsonl"
        self.rows_path = self.folder / "features.f16"
        self.index: dict[str, tuple[int, int]] = {}  # key -> (first row, rows)
        self.rows = 0
        self.index_read = 0  # bytes of index.jsonl read: other writers' entries start there
        with nullcontext() if readonly else self.locked():
            identity = model_identity(model) if model is not None else None  # reads 2 MiB a weights file: once
            meta = self._checked_meta(model, identity)
            self._read_index()
            self._check_rows(bool(meta))
            if readonly:
                return
            with open(self.rows_path, "ab") as fh:
                fh.truncate(self.rows * width * 2)  # an unreferenced tail a crash left
            lines = "".join(json.dumps({"key": k, "offset": o, "rows": r}) + "\n" for k, (o, r) in self.index.items())
            write_atomically(
                self.index_path, lambda tmp: tmp.write_text(lines)
            )  # a kill mid-write leaves the old index whole
            self.index_read = len(lines.encode())
            stamp = {"model": identity, "identity": IDENTITY_SCHEME} if identity is not None else {}
            wanted = {"width": width, **meta, **stamp}  # a stamp of scheme 1 checked, then restamped
            if wanted != meta:  # recorded only once the rows are known to fit it
                write_atomically(self.folder / "meta.json", lambda tmp: tmp.write_text(json.dumps(wanted) + "\n"))

    def _checked_meta(self, folder: str | Path | None, model: str | None) -> dict:
        """The width and target the cache's rows are of (recorded by its first opener), checked:
        `model` is the identity of the target in `folder`."""
        path = self.folder / "meta.json"
        try:
            meta = json.loads(path.read_text()) if path.is_file() else {}
        except json.JSONDecodeError as exc:
            raise FeatureCacheError(f"{path} is not JSON ({exc}): delete it, and the cache is checked afresh") from None
        if meta.get("width", self.width) != self.width:
            raise FeatureCacheError(
                f"{self.folder} holds rows {meta['width']} wide, not {self.width}: another target's or taps' "
                "features; use another --cache or --name"
            )
        recorded = meta.get("model", model)
        if meta.get("identity", 1) == 1 and folder is not None and recorded == first_identity(folder):
            # The first scheme cannot tell a fine-tune from its base: weights written since the
            # stamp are another model's, refused (taken, their identity was stamped for good: a review).
            if _weights_written_before(folder, path):
                recorded = model
        if model is not None and recorded != model:
            raise FeatureCacheError(
                f"{self.folder} holds another target's features (model {meta['model']}, not {model}): "
                "a model folder of the same name; use another --cache"
            )
        return meta

    def _check_rows(self, recorded: bool) -> None:
        """The rows file against its index. The last few entries' rows missing (a crash or a full
        disk after their index lines, a copy cut short) are dropped, to be filled again; more is a
        cache of another width or lost rows, refused, never padded with zeros (a truncated file was
        padded, and its run trained to NaN: an audit). A cache from before meta.json was written
        has its width checked by its size: its rows file must end where its index does at this width
        (a narrower opener cut such a file in half; a crash's tail there is refused too, as the
        width cannot be told from it)."""
        unit = self.width * 2
        held = self.rows_path.stat().st_size // unit if self.rows_path.exists() else 0
        lost = [key for key, (offset, rows) in self.index.items() if offset + rows > held]
        if len(lost) > (LOST_ENTRIES if recorded else 0) or (not recorded and held != self.rows):
            raise FeatureCacheError(
                f"{self.rows_path} holds {held} rows {self.width} wide where its index names {self.rows}: "
                "not this width's cache, or rows were lost; use another --cache, or delete it and fill again"
            )
        for key in lost:
            del self.index[key]
        self.rows = max((offset + rows for offset, rows in self.index.values()), default=0)

    def locked(self) -> AbstractContextManager[None]:
        """Exclusive use of the cache files, across processes."""
        return locked(self.folder)

    def _read_index(self) -> None:
        """What the index says now past what was read, other writers' entries included: under the
        lock, before an add, so that two processes filling one cache neither compute an answer's
        rows twice nor leave the second copy in the rows file, dead, for good (an audit)."""
        try:
            with open(self.index_path, "rb") as fh:
                fh.seek(self.index_read)
                tail = fh.read()
        except FileNotFoundError:
            return
        whole = tail[: tail.rfind(b"\n") + 1]  # a line being written is read next time
        self.index_read += len(whole)
        for line in whole.decode(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn line: the entries after it are still good
            self.index[entry["key"]] = (entry["offset"], entry["rows"])
            self.rows = max(self.rows, entry["offset"] + entry["rows"])

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def add(self, key: str, features: torch.Tensor) -> None:
        if key in self.index:
            return
        if features.ndim != 2 or features.shape[1] != self.width:
            raise ValueError(f"feature rows must be [rows, {self.width}], got {list(features.shape)}")
        data = half_rows(features.detach(), f"answer {key}").cpu().numpy().tobytes()
        with self.locked(), open(self.rows_path, "ab") as fh:
            self._read_index()
            if key in self.index:  # another writer's, meanwhile
                return
            offset = fh.seek(0, 2) // (self.width * 2)  # where the file ends now, whoever wrote last
            # A write that failed part-way (a full disk) left part of a row: cut, or every row
            # written after it sat that many bytes off its index's offset, for good (an audit).
            fh.truncate(offset * self.width * 2)
            fh.write(data)
            fh.flush()
            line = (json.dumps({"key": key, "offset": offset, "rows": features.shape[0]}) + "\n").encode()
            with open(self.index_path, "ab") as index:
                index.write(line)
            self.index_read += len(line)
        self.index[key] = (offset, features.shape[0])
        self.rows = max(self.rows, offset + features.shape[0])

    def array(self) -> np.ndarray:
        """Every row as a read-only memory map [rows, width] fp16."""
        if self.rows == 0:
            return np.zeros((0, self.width), dtype=np.float16)
        return np.memmap(self.rows_path, dtype=np.float16, mode="r", shape=(self.rows, self.width))

    def get(self, key: str) -> torch.Tensor:
        offset, rows = self.index[key]
        return torch.from_numpy(np.array(self.array()[offset : offset + rows], dtype=np.float32))

    @torch.inference_mode()
    def fill(
        self,
        answers: list[Answer],
        target: TargetModel,
        layer_ids: tuple[int, ...],
        *,
        max_rows: int = MAX_ROWS,
        batch_tokens: int = 4096,
        deadline: float | None = None,
        keep_free: int | None = None,
        log: Callable[[str], None] | None = print,
    ) -> int:
        """Compute features for answers that have none, by batched prefill; returns how many were added.

        Answers share one `prefill_features` forward of at most `batch_tokens` rows (padding
        counted), so on the engine their rows are the bits serving taps for the same tokens, in the
        dtype the target runs in (the engine computes every row as if alone; off the engine, as on
        a GPU today, one right-padded forward). Answers go in
        windows of `WINDOW` in the store's order, each sorted by length (similar lengths share a
        forward), so a run stopped at `deadline` (a `time.monotonic()`) has filled a fair sample of the
        store, not only its shortest answers. It stops early too when the disk reaches its
        `DiskReserve`.
        """
        waiting = [a for a in answers if a.key not in self.index]
        windows = (waiting[w : w + WINDOW] for w in range(0, len(waiting), WINDOW))
        todo = [a for window in windows for a in sorted(window, key=lambda a: len(a.tokens))]
        began, done_rows, added = time.monotonic(), 0, 0
        disk = DiskReserve(self.folder, keep_free)

        def rows(answer: Answer) -> int:  # positions whose features training reads: all but the last
            return min(len(answer.tokens) - 1, max_rows)

        i = 0
        while i < len(todo) and (deadline is None or time.monotonic() < deadline) and not disk.full():
            group = _next_group(todo, i, target.prefill_slots, batch_tokens, rows)
            i += len(group)
            with self.locked():
                self._read_index()
            group = [a for a in group if a.key not in self.index]  # not filled by another process meanwhile
            for answer in [a for a in group if rows(a) == 0]:  # nothing after its first token
                self.add(answer.key, torch.empty(0, self.width))
            running = [a for a in group if rows(a) > 0]
            tokens = [answer.tokens[: rows(answer)] for answer in running]
            results = target.prefill_features(tokens, tuple(layer_ids)) if running else []
            for answer, features in zip(running, results, strict=True):
                self.add(answer.key, features)
                done_rows += features.shape[0]
            added += len(group)
            if log and i % 200 < len(group):
                log(f"features: {i}/{len(todo)} answers, {done_rows / max(time.monotonic() - began, 1e-9):.0f} rows/s")
        if log and i < len(todo):
            why = "the disk is nearly full" if disk.full() else "time is up"
            log(f"features: {why} with {len(todo) - i} of {len(todo)} answers left")
        return added


class LiveFeatures:
    """Tap features computed by the target as each training batch needs them, never stored.

    Where the target's forward is cheap against the drafter's step (a GPU: a prefill of a 135M
    target runs at millions of rows a second) this beats a cache: no fill phase, no disk (the
    store's rows would outgrow a device machine's disk), every stored answer trainable, and no
    batch copy of 5.8 KB a row for loader threads to make. On a CPU the prefill costs more than the
    step it feeds, so the cache stays the default there (`launch.train --features`). The rows are
    rounded to fp16 as the cache stores them, so either source trains on the same bits where both
    come from one forward (the engine's)."""

    def __init__(self, target: TargetModel, taps: tuple[int, ...], batch_tokens: int = 4096) -> None:
        self.target, self.taps, self.batch_tokens = target, tuple(taps), batch_tokens
        self.width = len(self.taps) * target.config.hidden_size

    @torch.inference_mode()
    def rows(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Each sequence's feature rows [len, width] fp16, on the target's device: in forwards of at
        most `batch_tokens` rows (padding counted) and the engine's slots."""
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out: list[torch.Tensor | None] = [None] * len(sequences)
        i = 0
        while i < len(order):
            group = _next_group(order, i, self.target.prefill_slots, self.batch_tokens, lambda j: len(sequences[j]))
            i += len(group)
            running = [j for j in group if sequences[j]]
            results = self.target.prefill_features([sequences[j] for j in running], self.taps) if running else []
            for j, features in zip(running, results, strict=True):
                out[j] = half_rows(features, f"sequence {j} of the batch")
            for j in group:
                if out[j] is None:
                    out[j] = torch.empty(0, self.width, dtype=torch.float16)
        return out  # type: ignore[return-value]

    def sample(self, sequences: list[list[int]], rows: int) -> np.ndarray:
        """About `rows` feature rows of the leading sequences, for the trainer's feature scale."""
        taken, total = [], 0
        for start in range(0, len(sequences), 16):
            for features in self.rows(sequences[start : start + 16]):
                taken.append(features.float().cpu().numpy().astype(np.float16))
                total += len(features)
            if total >= rows:
                break
        return np.concatenate(taken) if taken else np.zeros((0, self.width), dtype=np.float16)


def _next_group(todo: list, i: int, slots: int, batch_tokens: int, rows: Callable[[Any], int]) -> list:
    """The answers from todo[i] on that share one forward: within one window (sorted by length, so
    the last one taken is the longest), at most `slots`, their count times the last one's rows
    within `batch_tokens`."""
    group = [todo[i]]
    for j in range(i + 1, len(todo)):
        if not j % WINDOW or len(group) >= slots or (len(group) + 1) * rows(todo[j]) > batch_tokens:
            break
        group.append(todo[j])
    return group
