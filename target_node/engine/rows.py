"""What each row of a forward is: its slot, token, position, cache index and the keys it may see.

Row bits depend only on these, so this is where the batch-invariance contract is spelled out.
Trees arrive as `parents` (of rows 1.., row indices, 0 the first row), the one description of a
tree forward that both paths read. A row's visible keys are one list in position order: a
contiguous run of its slot's committed cache `[lo, hi)`, then `extra` entries gathered by index.
A chain row at position p sees `[lo, p + 1)` (itself included, written by the same forward before
attention reads it); a tree node sees the committed context `[lo, start)` and then its ancestors
and itself, gathered from where the tree put them. Both lists hold the same keys in the same
order as the plain step at that position saw, so the kernels, which read a list and never a
mask, give the same bits. Sliding-window layers read the same lists cut to positions above p - window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Rows are built here, then moved to the model's device in one go (`_on`).
HOST = torch.device("cpu")


@dataclass
class KeyLists:
    """One window's key lists for every row (int32, on the cache's device)."""

    lo: torch.Tensor  # [M]
    hi: torch.Tensor  # [M]
    extra: torch.Tensor  # [M, E]: cache indices after [lo, hi)
    count: torch.Tensor  # [M]: how many of `extra` each row reads


@dataclass
class Rows:
    tokens: torch.Tensor  # [M] long
    positions: torch.Tensor  # [M] long: rotary positions
    slots: torch.Tensor  # [M] int32
    index: torch.Tensor  # [M] int32: where each row's key and value are written
    keys: dict[int | None, KeyLists]  # by window (None: full attention)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        """Rows of several parts in one forward (key lists padded to the widest `extra`)."""
        if len(parts) == 1:
            return parts[0]
        keys = {}
        for window in parts[0].keys:
            lists = [p.keys[window] for p in parts]
            width = max(k.extra.shape[1] for k in lists)
            extra = torch.cat([torch.nn.functional.pad(k.extra, (0, width - k.extra.shape[1])) for k in lists])
            keys[window] = KeyLists(
                torch.cat([k.lo for k in lists]),
                torch.cat([k.hi for k in lists]),
                extra,
                torch.cat([k.count for k in lists]),
            )
        cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        return Rows(cat("tokens"), cat("positions"), cat("slots"), cat("index"), keys)

    def blocks(self, size: int, scratch: int) -> list[Rows]:
        """These rows in blocks of exactly `size`, the last padded with rows of the `scratch` slot
        (token 0 at position 0 seeing only itself): so every block runs at one shape."""
        m = len(self)
        total = -(-m // size) * size
        pad = total - m

        def extend(t: torch.Tensor, value: int) -> torch.Tensor:
            return torch.cat([t, t.new_full((pad, *t.shape[1:]), value)]) if pad else t

        keys = {
            w: KeyLists(extend(k.lo, 0), extend(k.hi, 1), extend(k.extra, 0), extend(k.count, 0))
            for w, k in self.keys.items()
        }
        padded = Rows(
            extend(self.tokens, 0), extend(self.positions, 0), extend(self.slots, scratch), extend(self.index, 0), keys
        )
        return [padded.slice(start, start + size) for start in range(0, total, size)]

    def slice(self, start: int, end: int) -> Rows:
        keys = {
            w: KeyLists(k.lo[start:end], k.hi[start:end], k.extra[start:end], k.count[start:end])
            for w, k in self.keys.items()
        }
        part = slice(start, end)
        return Rows(self.tokens[part], self.positions[part], self.slots[part], self.index[part], keys)


def chain_rows(
    tokens: list[int], start: int, windows: set[int | None], slot: int = 0, device: torch.device | str = "cpu"
) -> Rows:
    """Tokens at positions start, start + 1, ... of one slot, each seeing everything before it."""
    n = len(tokens)
    positions = torch.arange(start, start + n, dtype=torch.int32, device=HOST)
    hi = positions + 1
    keys = {}
    for window in windows:
        lo = torch.zeros(n, dtype=torch.int32, device=HOST) if window is None else (positions - window + 1).clamp_min(0)
        keys[window] = KeyLists(
            lo, hi, torch.zeros(n, 0, dtype=torch.int32, device=HOST), torch.zeros(n, dtype=torch.int32, device=HOST)
        )
    return _on(
        Rows(
            torch.tensor(tokens, device=HOST),
            positions.long(),
            torch.full((n,), slot, dtype=torch.int32, device=HOST),
            positions,
            keys,
        ),
        device,
    )


def tree_paths(parents: list[int]) -> list[list[int]]:
    """Each row's path from row 0 to itself (row indices, in depth order)."""
    paths: list[list[int]] = [[0]]
    for row, parent in enumerate(parents, start=1):
        if not 0 <= parent < row:
            raise ValueError(f"row {row}'s parent {parent} does not come before it")
        paths.append([*paths[parent], row])
    return paths


def tree_depths(parents: list[int]) -> list[int]:
    """Each row's depth below row 0 (0 for row 0): its position is the first row's plus this."""
    return [len(path) - 1 for path in tree_paths(parents)]


def tree_rows(
    tokens: list[int],
    start: int,
    parents: list[int],
    windows: set[int | None],
    slot: int = 0,
    device: torch.device | str = "cpu",
) -> Rows:
    """Rows at cache indices start.. and positions start + depth: each sees the committed context,
    then its ancestors and itself in depth order."""
    n = len(tokens)
    if len(parents) != n - 1:
        raise ValueError(f"a tree of {n} rows has {n - 1} parents, not {len(parents)}")
    paths = tree_paths(parents)
    depths = [len(path) - 1 for path in paths]
    positions = [start + d for d in depths]
    keys = {}
    for window in windows:
        lo, lists = [], []
        for node in range(n):
            low = 0 if window is None else max(0, positions[node] - window + 1)
            lo.append(min(low, start))
            lists.append([start + a for a in paths[node] if start + depths[a] >= low])
        width = max(len(x) for x in lists)
        extra = torch.tensor([x + [0] * (width - len(x)) for x in lists], dtype=torch.int32, device=HOST)
        count = torch.tensor([len(x) for x in lists], dtype=torch.int32, device=HOST)
        keys[window] = KeyLists(
            torch.tensor(lo, dtype=torch.int32, device=HOST),
            torch.full((n,), start, dtype=torch.int32, device=HOST),
            extra,
            count,
        )
    rows = Rows(
        torch.tensor(tokens, device=HOST),
        torch.tensor(positions, device=HOST),
        torch.full((n,), slot, dtype=torch.int32, device=HOST),
        torch.arange(start, start + n, dtype=torch.int32, device=HOST),
        keys,
    )
    return _on(rows, device)


def _on(rows: Rows, device) -> Rows:
    if torch.device(device).type == "cpu":
        return rows
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    return Rows(
        move(rows.tokens),
        move(rows.positions),
        move(rows.slots),
        move(rows.index),
        {w: KeyLists(move(k.lo), move(k.hi), move(k.extra), move(k.count)) for w, k in rows.keys.items()},
    )
