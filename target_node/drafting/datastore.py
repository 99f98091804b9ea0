"""A datastore of the target's own earlier answers: what it wrote after the context's tail before.

Prompt lookup finds continuations in the request's own context; this finds them in every answer
the target gave before (REST, He et al. 2024, over a corpus; here the target's own greedy
answers, which are the continuations it is most likely to repeat). A small model repeats its
phrasing across requests ("Here are some tips", a function's boilerplate), and those phrases
are right at other steps than the drafter's: on the held-out prompts, offline, the two lookups
alone accept 0.90 and 0.94 tokens a step, the better of the two 1.67 (docs/trees.md).

Every position of the stored answers is indexed by the up to K tokens before it, packed into one
integer with the latest token in the highest bits: so the positions whose last k tokens match a
query's, for any k <= K, are one contiguous run of the sorted keys. A query takes the longest k
that occurs, and from the positions found (at most `sample` of them) votes a continuation token by
token: the commonest next token, then the commonest after it among the positions that agreed.
Verification keeps the output the target's own whatever the continuation says.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from target_node.drafting.proposal import Continuation

MAX_CONTEXT = 4  # tokens of context a key holds (fewer where the vocabulary needs more bits)


class Datastore:
    """Continuations of a context's tail in a fixed body of token sequences (immutable once built)."""

    name = "datastore"

    def __init__(self, tokens: np.ndarray, keys: np.ndarray, positions: np.ndarray, bits: int) -> None:
        self.tokens, self.keys, self.positions, self.bits = tokens, keys, positions, bits
        self.context = min(MAX_CONTEXT, 64 // bits)
        self.none = (1 << bits) - 1  # no token: before a sequence's start, and between sequences
        self.vocab_size: int | None = None  # ids at or past it are never proposed (another model's store)

    @classmethod
    def build(cls, sequences: Iterable[list[int]]) -> Datastore:
        """Index `sequences` (token ids; each a continuation the target wrote)."""
        seqs = [np.asarray(s) for s in sequences if len(s) >= 2]  # int32 from answer_tails: half the memory
        top = max([int(s.max()) for s in seqs] + [1])
        bits = (top + 2).bit_length()
        none = (1 << bits) - 1
        flat = np.full(sum(len(s) + 1 for s in seqs) + 1, none, dtype=np.int64)  # sequences between `none`s
        at = 1
        for s in seqs:
            flat[at : at + len(s)] = s
            at += len(s) + 1
        context = min(MAX_CONTEXT, 64 // bits)
        n = len(flat)
        keys, alive = np.zeros(n, dtype=np.uint64), np.ones(n, dtype=bool)
        for j in range(1, context + 1):  # the j-th token back, in the next lower bits; none past a boundary
            back = np.concatenate([np.full(j, none), flat])[:n]
            alive &= back != none
            keys = (keys << np.uint64(bits)) | np.where(alive, back, none).astype(np.uint64)
        indexed = np.nonzero((flat != none) & (np.concatenate([[none], flat])[:n] != none))[0]
        order = np.argsort(keys[indexed], kind="stable")
        dtype = np.uint16 if bits <= 16 else np.uint32
        where = np.int32 if n < 2**31 else np.int64
        return cls(flat.astype(dtype), keys[indexed][order], indexed[order].astype(where), bits)

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("tokens", "keys", "positions"):
            np.save(folder / f"{name}.npy", getattr(self, name))
        (folder / "bits").write_text(str(self.bits))
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> Datastore:
        """A saved datastore, memory-mapped: processes on one machine share its pages."""
        folder = Path(folder)
        arrays = [np.load(folder / f"{name}.npy", mmap_mode="r") for name in ("tokens", "keys", "positions")]
        return cls(*arrays, int((folder / "bits").read_text()))

    def check(self) -> None:
        """Raise ValueError where the arrays are not an index's (one cut short, or not ours): an index
        of float positions or 2-D tokens was mapped, and every request then drafted nothing."""
        token_dtype = np.uint16 if self.bits <= 16 else np.uint32
        arrays = {"tokens": (self.tokens, (token_dtype,)), "keys": (self.keys, (np.uint64,)),
                  "positions": (self.positions, (np.int32, np.int64))}  # fmt: skip
        for name, (array, dtypes) in arrays.items():
            if array.ndim != 1 or array.dtype not in dtypes:
                wanted = "/".join(np.dtype(d).name for d in dtypes)
                raise ValueError(f"{name}: {array.ndim}-d {array.dtype}, not 1-d {wanted}")
        if len(self.keys) != len(self.positions) or not 1 <= self.bits <= 32:
            raise ValueError(f"{len(self.keys)} keys for {len(self.positions)} positions, {self.bits} bits")
        low, high = (int(np.min(self.positions)), int(np.max(self.positions))) if len(self.positions) else (0, 0)
        if low < 0 or high >= max(len(self.tokens), 1):
            raise ValueError(f"positions outside its {len(self.tokens)} tokens")
        sample = np.asarray(self.keys[:: max(1, len(self.keys) // 4096)])  # a full pass costs every start
        if np.any(sample[1:] < sample[:-1]):
            raise ValueError("its keys are not sorted")
        if not len(self.tokens) or int(self.tokens[0]) != self.none:  # built ones begin with the boundary
            raise ValueError(f"its tokens do not begin with {self.bits} bits' boundary {self.none}")

    def __len__(self) -> int:
        return len(self.positions)

    def _matches(self, tail: list[int]) -> np.ndarray:
        """Positions whose context ends with the longest suffix of `tail` that occurs (none: empty)."""
        bits, context = self.bits, self.context
        for k in range(min(context, len(tail)), 0, -1):
            if any(t < 0 or t >= self.none for t in tail[-k:]):
                continue
            prefix = 0
            for t in reversed(tail[-k:]):  # the latest token first: the highest bits
                prefix = (prefix << bits) | t
            shift = bits * (context - k)
            lo = np.searchsorted(self.keys, np.uint64(prefix << shift), "left")
            hi = np.searchsorted(self.keys, np.uint64(((prefix + 1) << shift) - 1), "right")
            if hi > lo:
                return self.positions[lo:hi]
        return self.positions[:0]

    def __call__(self, tokens: list[int], limit: int, sample: int = 256) -> Continuation:
        """Up to `limit` tokens that most often followed the context's tail in the datastore, each
        with its chance: of the n occurrences still agreeing, the share c that continued with it,
        as c / (n + 1) (one occurrence is a guess, many that agree are not; on the held-out prompts'
        answers the share alone told 9% hits from 73-93%)."""
        if limit <= 0 or not tokens or not len(self):
            return Continuation([])
        found = self._matches(tokens[-self.context :])[:sample]
        follow = np.asarray(self.tokens[np.minimum(found[:, None] + np.arange(limit), len(self.tokens) - 1)])
        return vote(follow.tolist(), limit if len(found) else 0, self.none, self.vocab_size)


def vote(follow: list[list[int]], limit: int, none: int, vocab_size: int | None) -> Continuation:
    """The continuation the rows `follow` (each occurrence's next `limit` tokens) vote, token by
    token among the rows that agreed so far: the commonest (ties to the lowest id), with its share
    c / (n + 1). In Python lists: a step voted with np.unique over at most 256 rows a depth, 0.15-0.3
    ms a step, half of that numpy's per-call overhead on arrays this small (the same tokens and shares)."""
    out, chances = [], []
    for d in range(limit):
        votes = Counter(row[d] for row in follow if row[d] != none)
        if not votes:
            break
        most = max(votes.values())
        best = min(token for token, count in votes.items() if count == most)
        if vocab_size is not None and best >= vocab_size:
            break
        out.append(best)
        chances.append(float(most) / (sum(votes.values()) + 1))
        follow = [row for row in follow if row[d] == best]
    return Continuation(out, chances)
