"""Context keys and values of prefixes a target asked the draft daemon to keep, per peer.

A target with a prefix cache starts a request from an earlier one's rows; the drafter's context
for those positions is the same too (keys and values depend only on a position's features and
the position), so the target names the prefix (`keep`) and a later session of the same peer
starts from it (`restore`): neither the feature rows on the wire nor their recomputation.

Scoped as sessions are where peers are CURVE keys: by (peer, name), so one key's names are
invisible to every other. Without CURVE a peer is a connection and each of a target's slots has
its own, so a prefix kept from one slot must be found from another: there the name alone keys it,
and names are capabilities (the target draws 128 random bits per process into each). Bounded in
bytes; when full, the peer that keeps the most bytes loses its least recently used entry, so a peer
that floods the store with keeps evicts its own entries, not everyone else's (an audit: one peer's
48 keeps of 4,096 rows emptied it of every other target's prefixes). A keep that would make its
peer the largest holder with nothing older of its own to give up is refused, evicting nothing,
unless (without CURVE) other slots of its target hold entries it can give up instead. A miss is
answered with 0 rows and the target ships them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import torch

Key = tuple[str, str]


class KeptPrefixes:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        # (peer, name) -> (keys, values, their bytes, the peer that kept them)
        self.entries: dict[Key, tuple[torch.Tensor, torch.Tensor, int, str]] = {}
        self.by_owner: dict[str, OrderedDict[Key, None]] = {}  # each peer's entries, least recently used first
        self.held = 0
        self.held_by: Counter[str] = Counter()  # bytes each peer kept
        self.counters = {"kept": 0, "restored": 0, "missed": 0, "evicted": 0}
        self.by_peer = True  # scope names by peer (CURVE keys); False: names alone (see above)

    def _key(self, peer: str, name: str) -> Key:
        return (peer if self.by_peer else "", name)

    def keep(self, peer: str, name: str, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Hold these [layers, kv_heads, rows, head_dim] under (peer, name), replacing what was there."""
        size = 2 * keys.numel() * keys.element_size()
        key = self._key(peer, name)
        self._drop(key)
        victims = self._room_for(peer, name, size)
        if victims is None:
            return False
        for victim in victims:
            self._drop(victim)
            self.counters["evicted"] += 1
        self.entries[key] = (keys, values, size, peer)
        self.by_owner.setdefault(peer, OrderedDict())[key] = None
        self.held += size
        self.held_by[peer] += size
        self.counters["kept"] += 1
        return True

    def _room_for(self, peer: str, name: str, size: int) -> list[Key] | None:
        """The entries to evict so `size` more bytes of `peer`'s fit (each the oldest of the peer then
        holding the most, the new entry counted as `peer`'s), or None where the new entry would be
        the one to go."""
        need = self.held + size - self.max_bytes
        held_by = Counter(self.held_by)
        held_by[peer] += size
        oldest = {owner: iter(keys) for owner, keys in self.by_owner.items()}  # nothing changes while read
        victims: list[Key] = []
        while need > 0:
            largest = max(held_by, key=held_by.__getitem__)
            victim = next((key for key in oldest.get(largest, iter(())) if key not in victims), None)
            if victim is None:  # only the new entry is left of the largest holder's
                victim = self._sibling(name, victims)
                if victim is None:
                    return None
            victims.append(victim)
            owner, freed = self.entries[victim][3], self.entries[victim][2]
            held_by[owner] -= freed
            need -= freed
        return victims

    def _sibling(self, name: str, taken: list[Key]) -> Key | None:
        """Without CURVE, the oldest entry another slot of the same target kept (its name has the
        same process secret), not yet in `taken`: that target's own to give up. A keep was refused
        while the store held only such stale entries of other slots (an audit), and each slot of
        a target is a peer of its own here."""
        family = _family(name)
        if self.by_peer or family is None:
            return None
        for owner in sorted(self.by_owner, key=self.held_by.__getitem__, reverse=True):
            for key in self.by_owner[owner]:
                if _family(key[1]) == family and key not in taken:
                    return key
        return None

    def take(self, peer: str, name: str, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The first `rows` (or fewer, as held) positions' keys and values of (peer, name), or None."""
        key = self._key(peer, name)
        found = self.entries.get(key)
        if found is None:
            self.counters["missed"] += 1
            return None
        self.by_owner[found[3]].move_to_end(key)
        self.counters["restored"] += 1
        keys, values, _, _ = found
        return keys[:, :, :rows], values[:, :, :rows]

    def _drop(self, key: Key) -> None:
        found = self.entries.pop(key, None)
        if found is None:
            return
        size, owner = found[2], found[3]
        self.held -= size
        self.held_by[owner] -= size
        del self.by_owner[owner][key]
        if not self.by_owner[owner]:
            del self.by_owner[owner], self.held_by[owner]

    def of(self, peer: str) -> int:
        """Entries this peer holds (what its own `stats` may show; 0 where names alone key them)."""
        return sum(owner == peer for owner, _ in self.entries) if self.by_peer else 0


def _family(name: str) -> str | None:
    """The process secret a target's names begin with (`<secret>-<n>`, prefix_cache.py), or None."""
    secret, dash, _ = name.rpartition("-")
    return secret if dash and len(secret) >= 32 else None
