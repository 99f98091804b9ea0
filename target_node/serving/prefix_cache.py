"""Committed KV rows (and the drafter's feature rows) kept by token prefix, for later requests.

A chat sends its whole history every turn, and many users share a system prompt: the target
has computed those positions before. Here each finished request (and each prompt, as soon as it
is in) leaves its committed rows, keyed by their tokens; a new request whose prompt starts with
them copies them into its slot and prefills only the rest.

Keyed by hashed blocks, as vLLM's automatic prefix caching is: the hash of each BLOCK-token
boundary chains the hashes before it, so one pass over a prompt finds the longest stored prefix
(through whichever entry holds it), then the match extends token by token inside that entry (a
chat's next turn starts with the whole previous turn, not a block-aligned part of it). A radix
tree would share the rows of common prefixes; here a turn's entry replaces the entries it
extends instead, so a chat holds one entry, and a system prompt shared by others is held once per
conversation (bounded below).

Exact: the engine computes every row with the same bits whatever rows ran with it, so rows
copied from an earlier request are the rows a fresh prefill would compute; the last prompt token
always runs (its logits give the first token). Bounded: at most `max_bytes`, least recently used
out first. A hit copies its rows into the slot, so nothing a running request reads is ever here to
evict. Tenants: the rows are the target's own computation of public token ids, shared by all of
its clients as its weights are (as in vLLM and SGLang); a deployment that must not let one client
time another's prompts turns it off (`--prefix-cache-mb 0`).
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

BLOCK = 16  # tokens per hashed block: the granularity a lookup walks at


@dataclass(frozen=True)
class Prefix:
    """A hit: the first `length` positions of a stored sequence."""

    length: int
    kv: torch.Tensor  # [layers, 2, kv_heads, >= length, head_dim] (the engine cache's layout)
    features: torch.Tensor | None  # [rows, width] of the taps it was stored with, from features_from on; or None
    name: str  # the entry's name, under which a draft daemon may keep its own context of it
    features_from: int = 0  # the position of the features' first row


@dataclass(eq=False)
class _Entry:
    tokens: list[int]
    kv: torch.Tensor
    features: torch.Tensor | None
    taps: tuple[int, ...]
    hashes: list[int]
    name: str
    features_from: int = 0  # past 0: the drafter's ring had wrapped, and only its last rows came
    restorable: bool = True  # a draft daemon may hold its context under `name` (not after taking earlier rows)

    @property
    def reaches_back(self) -> float:
        """The first position its features cover (infinity: it has none)."""
        return self.features_from if self.features is not None else float("inf")

    def serves(self, taps: tuple[int, ...], length: int, reach: int) -> bool:
        """Whether an asker drafting from `taps`, reading `reach` positions back (0: all), can start
        from its first `length` positions: the features a prefill of them would leave it are here."""
        if not taps:
            return True
        return self.taps == taps and self.reaches_back <= (max(0, length - reach) if reach else 0)

    def holds(self, other: _Entry) -> bool:
        """Whether it serves every prefix `other` serves (and so may stand in for it)."""
        return (
            self.taps == other.taps
            and self.tokens[: len(other.tokens)] == other.tokens
            and (not self.taps or self.reaches_back <= other.reaches_back)
        )

    @property
    def bytes(self) -> int:
        held = self.kv.numel() * self.kv.element_size()
        return held + (self.features.numel() * self.features.element_size() if self.features is not None else 0)


def block_hashes(tokens: list[int], limit: int, key: bytes = b"") -> list[int]:
    """The chained hash at each full block boundary within the first `limit` tokens. Keyed with
    the cache's own secret `key`: Python's hash of a tuple of ints is the same in every process, so
    a client could have searched offline for prompts whose blocks collide."""
    hashes, chained = [], b""
    raw = array("q", tokens[: limit - limit % BLOCK]).tobytes()
    step = BLOCK * 8
    for start in range(0, len(raw), step):
        chained = hashlib.blake2b(chained + raw[start : start + step], digest_size=8, key=key).digest()
        hashes.append(int.from_bytes(chained, "little"))
    return hashes


def _common(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a prefix cache needs a positive size, got {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, _Entry] = OrderedDict()  # by id, least recently used first
        self.by_hash: dict[int, dict[int, _Entry]] = {}  # block hash -> the entries that hold it
        self.held = 0
        # Names a draft daemon keeps the drafter's context under: unguessable, and new in every
        # process, so no other target can name them and a restarted one never reuses them.
        secret = secrets.token_hex(16)
        self.names = (f"{secret}-{n}" for n in itertools.count())
        self.key = secrets.token_bytes(16)  # its block hashes' (see block_hashes)
        self.counters = {"lookups": 0, "hits": 0, "tokens_reused": 0, "stored": 0, "evicted": 0}

    def lookup(self, prompt: list[int], taps: tuple[int, ...], reach: int = 0) -> Prefix | None:
        """The longest stored prefix of `prompt` (its last token excluded: it must run), with
        features for `taps` where the asker drafts from them, as far back as it reads them
        (`reach` positions; 0: all); None when nothing of it is held."""
        self.counters["lookups"] += 1
        levels: list[list[_Entry]] = []  # the entries holding every block up to each depth
        for h in block_hashes(prompt, len(prompt) - 1, self.key):
            holders = [e for e in self.by_hash.get(h, {}).values() if self._drafts_from(e, taps)]
            if not holders:
                break
            levels.append(holders)
        # Past the last whole block each holder may match a few tokens more: the one that matches
        # most (the latest stored where several do). Taking the latest stored alone re-ran up to 15
        # tokens of a chat's previous turn when another chat with its system prompt came after it
        # (an audit). (Less than a block: a holder matching a whole block more would have held its
        # hash.) Only a holder with the features a prefill of that much would leave the asker: the
        # deepest level that has one.
        for blocks in range(len(levels), 0, -1):
            at = blocks * BLOCK
            tail = prompt[at : min(len(prompt) - 1, at + BLOCK)]
            matched = ((at + _common(tail, e.tokens[at : at + BLOCK]), e) for e in reversed(levels[blocks - 1]))
            serving = [(length, e) for length, e in matched if e.serves(taps, length, reach)]
            if serving:
                break
        else:
            return None
        length, best = max(serving, key=lambda m: m[0])
        if best.tokens[:length] != prompt[:length]:  # a hash collision: the tokens disagree
            return None
        self.entries.move_to_end(id(best))
        self.counters["hits"] += 1
        self.counters["tokens_reused"] += length
        return Prefix(length, best.kv, best.features, best.name if best.restorable else "", best.features_from)

    @staticmethod
    def _drafts_from(entry: _Entry, taps: tuple[int, ...]) -> bool:
        """A drafter reading features needs them for its taps, or it would draft blind over the prefix."""
        return not taps or (entry.taps == taps and entry.features is not None)

    def store(
        self,
        tokens: list[int],
        kv: torch.Tensor,
        features: torch.Tensor | None,
        taps: tuple[int, ...],
        features_from: int = 0,
    ) -> str | None:
        """Keep rows [0, len(tokens)) of a sequence: `kv` [layers, 2, kv_heads, n, head_dim] and its
        `features` for `taps` of positions [features_from, len(tokens)) (None without them).
        Entries it holds (it extends them, with features reaching as far back) are dropped.
        Returns the new entry's name, or None where nothing new is kept."""
        if len(tokens) < BLOCK:
            return None
        hashes = block_hashes(tokens, len(tokens), self.key)
        # Held in host memory, which its budget is sized from: on a GPU the rows would take the
        # device memory a running request's cache may need to grow into (an audit). A hit copies
        # them back into the slot.
        kv, features = kv.to("cpu"), features.to("cpu") if features is not None else None
        entry = _Entry(list(tokens), kv, features, taps, hashes, next(self.names), features_from)
        self._reach_back(entry)
        if entry.bytes > self.max_bytes:
            return None
        for other in [e for e in self.by_hash.get(entry.hashes[-1], {}).values()]:
            if other.holds(entry):
                self.entries.move_to_end(id(other))  # already held, by a longer sequence
                return None
        for other in list(self.by_hash.get(entry.hashes[0], {}).values()):
            if entry.holds(other):
                self._drop(other)
        self.entries[id(entry)] = entry
        for h in entry.hashes:
            self.by_hash.setdefault(h, {})[id(entry)] = entry
        self.held += entry.bytes
        self.counters["stored"] += 1
        while self.held > self.max_bytes:
            self._drop(next(iter(self.entries.values())))
            self.counters["evicted"] += 1
        return entry.name if id(entry) in self.entries else None

    def _reach_back(self, entry: _Entry) -> None:
        """A wrapped ring's entry takes the earlier feature rows of the entries it extends (the same
        bits: the engine computes a row alike whatever ran with it), reaching as far back as they
        do, so it holds them and replaces them: without them a long chat kept two entries a turn,
        each with its whole KV (a review)."""
        while entry.features is not None and entry.features_from:
            reaching = [
                other
                for other in self.by_hash.get(entry.hashes[0], {}).values()
                if other.taps == entry.taps
                and other.features is not None
                and other.features_from < entry.features_from <= len(other.tokens)
                and entry.tokens[: len(other.tokens)] == other.tokens
            ]
            if not reaching:
                return
            other = min(reaching, key=lambda e: e.features_from)
            earlier = other.features[: entry.features_from - other.features_from]
            entry.features = torch.cat([earlier, entry.features.to(earlier.device)])
            entry.features_from, entry.restorable = other.features_from, False

    def _drop(self, entry: _Entry) -> None:
        self.entries.pop(id(entry))
        for h in dict.fromkeys(entry.hashes):  # two boundaries of one entry may collide
            holders = self.by_hash[h]
            holders.pop(id(entry))
            if not holders:
                del self.by_hash[h]
        self.held -= entry.bytes

    def to_dict(self) -> dict:
        c = self.counters
        return {
            **c,
            "hit_rate": round(c["hits"] / c["lookups"], 4) if c["lookups"] else 0.0,
            "entries": len(self.entries),
            "bytes": self.held,
            "max_bytes": self.max_bytes,
        }
