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
48 keeps of 4,096 rows emptied it of every other target's prefixes). A miss is answered with 0 rows
and the target ships them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import torch


class KeptPrefixes:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        # (peer, name) -> (keys, values, their bytes, the peer that kept them)
        self.entries: OrderedDict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, int, str]] = OrderedDict()
        self.held = 0
        self.held_by: Counter[str] = Counter()  # bytes each peer kept
        self.counters = {"kept": 0, "restored": 0, "missed": 0, "evicted": 0}
        self.by_peer = True  # scope names by peer (CURVE keys); False: names alone (see above)

    def _key(self, peer: str, name: str) -> tuple[str, str]:
        return (peer if self.by_peer else "", name)

    def keep(self, peer: str, name: str, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Hold these [layers, kv_heads, rows, head_dim] under (peer, name), replacing what was there."""
        size = 2 * keys.numel() * keys.element_size()
        key = self._key(peer, name)
        self._drop(key)
        if size > self.max_bytes:
            return False
        self.entries[key] = (keys, values, size, peer)
        self.held += size
        self.held_by[peer] += size
        self.counters["kept"] += 1
        while self.held > self.max_bytes:
            largest = max(self.held_by, key=self.held_by.__getitem__)
            self._drop(next(k for k, entry in self.entries.items() if entry[3] == largest))
            self.counters["evicted"] += 1
        return True

    def take(self, peer: str, name: str, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The first `rows` (or fewer, as held) positions' keys and values of (peer, name), or None."""
        key = self._key(peer, name)
        found = self.entries.get(key)
        if found is None:
            self.counters["missed"] += 1
            return None
        self.entries.move_to_end(key)
        self.counters["restored"] += 1
        keys, values, _, _ = found
        return keys[:, :, :rows], values[:, :, :rows]

    def _drop(self, key: tuple[str, str]) -> None:
        found = self.entries.pop(key, None)
        if found is not None:
            self.held -= found[2]
            self.held_by[found[3]] -= found[2]
            if not self.held_by[found[3]]:
                del self.held_by[found[3]]

    def of(self, peer: str) -> int:
        """Entries this peer holds (what its own `stats` may show; 0 where names alone key them)."""
        return sum(owner == peer for owner, _ in self.entries) if self.by_peer else 0
