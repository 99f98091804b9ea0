"""The answer store: the target's own answers as token ids, compressed, kept in the repository.

Answers are what generation costs (the target decodes every token); features are not kept
here at all: they are recomputed from the ids by batched prefill (features.py), far cheaper.
So the store is small enough to commit, and it grows across machines and sessions:

- `data/answers/*.jsonl.xz`: shards of JSON lines, one answer each. A generation run writes
  its own shard, named by its start time and a random tag, rewriting it atomically as it goes (a crash
  loses at most the last few answers) and starting a new one past `shard_records`. A new shard's
  name sorts after every shard already in the folder (two started in one second included), so a
  reopened store reads its answers in the order they were written.
- xz with its whole shard in one window, not gzip's 32 KB: a follow-up turn's ids repeat its
  conversation's earlier turns, and xz stores them once (the store: 0.59x gzip's bytes). It is most of
  what a device machine's 64 MiB per call carries. Shards written as `.jsonl.gz` before
  2026-12-05, or by another machine since, are read as well.
- Every answer has a `key` (a hash of the conversation it answers), so resuming skips what
  is done, and two machines' shards merge by keeping the first copy of a key.
- The held-out split is a function of the job an answer belongs to, so an answer never
  changes side as the store grows, and a conversation never straddles the split.
"""

from __future__ import annotations

import calendar
import gzip
import json
import lzma
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO

from basics.files import write_atomically

STORE = Path(__file__).resolve().parent.parent / "data" / "answers"
HELD_OUT_BUCKETS = 32  # one job in 32 is held out
SUFFIX = ".jsonl.xz"  # what the store writes
STAMP = "%Y%m%d-%H%M%S"  # a shard's start, UTC: names sort as shards were started
OLD_SUFFIX = ".jsonl.gz"  # what it wrote before 2026-12-05: still read


@dataclass
class Answer:
    key: str  # hash of the conversation answered
    job: str  # the job it belongs to: split and resume follow it
    stage: str  # what the turn was (questions, text, code, answer, followup, traffic, ...)
    messages: list[list[str]]  # the conversation, [role, content] pairs, ending with the user turn
    tokens: list[int]  # prompt ids + answer ids
    prompt_len: int
    finish: str = ""  # eos | length
    then: str = ""  # the user's next message, when the conversation continues
    model: str = ""
    made_by: str = ""  # the writer's TargetModel.numerics: dtype, path, device ("" before 2026-12-06)

    @property
    def answer_tokens(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def held_out(self) -> bool:
        return zlib.crc32(self.job.encode()) % HELD_OUT_BUCKETS == 0


RECENT_KEYS = 1 << 16  # the keys an append-only store checks a new answer against (about 7 MB)


@dataclass
class AnswerStore:
    """`remember` False: an append-only writer (a daemon's `--record`), which reads no shard back
    and holds only the open shard's answers and the last RECENT_KEYS keys. Remembering, a
    recording daemon held every answer it ever served, and a restarted one every answer in the
    folder: 10.5 KiB a request, for good (an audit). A key it has forgotten may be written twice;
    a reader keeps the first copy."""

    folder: Path = STORE
    shard_records: int = 4000
    answers: list[Answer] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    remember: bool = True
    # Remembering, whether the answers themselves are held too, or only their keys and totals: what
    # generation needs, which only adds (it held 5 GB for 300,000 answers it never read again).
    hold: bool = True
    # What writes a shard (path, its answers): a recording daemon's writes on a thread of its own.
    write: Callable[[Path, list[Answer]], None] | None = None

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        self._shard: Path | None = None
        self._shard_answers: list[Answer] = []
        self._flushed_at = time.monotonic()
        self._last_name = ""
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._count = self._tokens = 0  # what is remembered
        for path in shard_paths(self.folder):
            if stamped(shard_stem(path)):  # a shard named otherwise sorts where it sorts
                self._last_name = shard_stem(path)
            if self.remember:
                for answer in read_shard(path):
                    self._keep(answer)

    def _keep(self, answer: Answer) -> bool:
        if not self.remember:
            if answer.key in self._recent:
                return False
            self._recent[answer.key] = None
            if len(self._recent) > RECENT_KEYS:
                self._recent.popitem(last=False)
            return True
        if answer.key in self.keys:
            return False
        self.keys.add(answer.key)
        self._count += 1
        self._tokens += answer.answer_tokens
        if self.hold:
            self.answers.append(answer)
        return True

    def __len__(self) -> int:
        return self._count

    @property
    def answer_tokens(self) -> int:
        return self._tokens

    def stored(self) -> Iterator[Answer]:
        """Every stored answer, first copies only: those held, or read from the shards again (a
        second read: half a minute for the committed store, once at a generation's start)."""
        if self.hold:
            yield from self.answers
            return
        seen: set[str] = set()
        for path in shard_paths(self.folder):
            for answer in read_shard(path):
                if answer.key not in seen:
                    seen.add(answer.key)
                    yield answer

    def split(self) -> tuple[list[Answer], list[Answer]]:
        """(train, held out)."""
        train = [a for a in self.answers if not a.held_out]
        return train, [a for a in self.answers if a.held_out]

    def add(self, answer: Answer, flush_every_s: float = 60.0) -> bool:
        """Append an answer (False if its key is already stored); written out at least every flush_every_s."""
        if not self._keep(answer):
            return False
        if self._shard is None or len(self._shard_answers) >= self.shard_records:
            self.flush()
            self._shard = self.folder / self._next_name()
            self._shard_answers = []
        self._shard_answers.append(answer)
        if time.monotonic() - self._flushed_at > flush_every_s:
            self.flush()
        return True

    @property
    def current_shard(self) -> Path | None:
        """The shard answers are added to now."""
        return self._shard

    def _next_name(self) -> str:
        """Start time and tag, sorting after every shard before it. Within the last shard's second,
        or with the clock stepped back behind it, the stamp is the second after the last one's: a
        name of the same length (the last one's stem extended by a tag grew 9 characters a shard
        until the clock caught up, and after a step back of an hour the 24th shard's name was too
        long to write: an audit)."""
        tag = uuid.uuid4().hex[:8]
        stamp = time.strftime(STAMP, time.gmtime())
        last = self._last_name[: len(stamp)]
        if stamp <= last:
            stamp = time.strftime(STAMP, time.gmtime(calendar.timegm(time.strptime(last, STAMP)) + 1))
        self._last_name = f"{stamp}-{tag}"
        return self._last_name + SUFFIX

    def flush(self) -> None:
        """Rewrite the current shard atomically."""
        self._flushed_at = time.monotonic()
        if self._shard is None or not self._shard_answers:
            return
        (self.write or write_shard)(self._shard, list(self._shard_answers))


def stamped(stem: str) -> bool:
    """Whether a shard's name starts with its start time, as the store names shards."""
    try:
        time.strptime(stem[:15], STAMP)
    except ValueError:
        return False
    return stem[15:16] == "-"


def shard_stem(path: Path) -> str:
    return path.name.removesuffix(SUFFIX).removesuffix(OLD_SUFFIX)


def shard_paths(folder: Path) -> list[Path]:
    """A store's shards in the order they were written: their stems sort so, whatever compressed them."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.name.endswith((SUFFIX, OLD_SUFFIX))), key=shard_stem)


def open_shard(path: Path) -> IO[str]:
    return gzip.open(path, "rt") if path.name.endswith(OLD_SUFFIX) else lzma.open(path, "rt")


STRONGEST = 9 | lzma.PRESET_EXTREME  # the committed store's: 0.59x gzip's bytes


def write_shard(path: Path, answers: Iterable[Answer], preset: int = STRONGEST) -> None:
    """Atomically, as xz (the same answers always make the same bytes: xz keeps no time)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        with lzma.open(tmp, "wb", preset=preset) as fh:
            for answer in answers:
                fh.write((json.dumps(asdict(answer), separators=(",", ":")) + "\n").encode())

    write_atomically(path, write)


class AnswerStoreError(ValueError):
    """A shard that cannot be read back."""


ANSWER_FIELDS = frozenset(f.name for f in fields(Answer))
# An answer's line: the longest prompt a daemon takes (512 Ki characters, six bytes each escaped)
# and a long context's token ids fit in a fraction of it.
MAX_LINE_CHARS = 16 << 20


def shard_lines(fh: IO[str]) -> Iterator[str]:
    """A shard's lines, each at most MAX_LINE_CHARS long: a 61 KB shard of one endless line
    decompressed into 883 MB before it was refused, and 6 MB of it would ask for 88 GB (an audit)."""
    while line := fh.readline(MAX_LINE_CHARS + 1):  # its newline beyond the limit
        if len(line) > MAX_LINE_CHARS and not line.endswith("\n"):
            raise AnswerStoreError(f"a line longer than {MAX_LINE_CHARS} characters")
        yield line


def read_shard(path: Path) -> list[Answer]:
    """A field a newer version added is left out, not the shard: an older checkout sharing the
    store dropped every shard written after `made_by` came (an audit); a field missing still fails."""
    out = []
    try:
        with open_shard(path) as fh:
            for line in shard_lines(fh):
                if line.strip():
                    record = json.loads(line)
                    out.append(Answer(**{k: v for k, v in record.items() if k in ANSWER_FIELDS}))
    except (EOFError, OSError, lzma.LZMAError, TypeError, AttributeError, ValueError) as exc:  # ValueError: JSON too
        raise AnswerStoreError(f"{path}: not a readable answer shard ({type(exc).__name__}: {exc})") from exc
    return out
