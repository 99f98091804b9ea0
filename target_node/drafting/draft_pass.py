"""The local slots' drafts of one step in one pass, as the draft daemon drafts a burst of proposes."""

from __future__ import annotations

from draft_node.kv_cache import drafts_alone_in_one_pass, timed_pass
from draft_node.model import DFlashDrafter


class DraftPass:
    """The slots of one target drafting with one in-process drafter. The steps they send ahead
    (`send_draft`: a batch's sequences each do in `prepare`) are drafted in one pass when the first
    of them asks for its drafts, as the draft daemon drafts a burst of proposes; each gets its
    bits alone where the drafter's load check says a pass keeps them, else they run one by one."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        self.together: bool | None = None  # checked at the first pass of two or more
        self.pending: dict[int, tuple[tuple, object]] = {}  # by backend: (its draft arguments, its step)
        self.done: dict[int, tuple[tuple, tuple, float]] = {}  # by backend: (arguments, result, ms)
        self.counters = {"passes": 0, "batched": 0}

    def send(self, backend: object, key: tuple, step) -> None:
        self.done.pop(id(backend), None)
        self.pending[id(backend)] = (key, step)

    def forget(self, backend: object) -> None:
        """Drop what this backend sent (its cache is about to change under it)."""
        self.pending.pop(id(backend), None)
        self.done.pop(id(backend), None)

    def take(self, backend: object, key: tuple) -> tuple[tuple, float] | None:
        """This backend's drafts for `key` and their share of the pass's time, or None where it
        sent none for these arguments."""
        if id(backend) in self.pending:
            self._run()
        entry = self.done.pop(id(backend), None)
        return (entry[1], entry[2]) if entry is not None and entry[0] == key else None

    def _run(self) -> None:
        items, self.pending = list(self.pending.items()), {}
        if len(items) > 1 and self.together is None:
            self.together = drafts_alone_in_one_pass(self.drafter)
        results, share = timed_pass([step for _, (_, step) in items], bool(self.together))
        self.counters["passes"] += 1
        self.counters["batched"] += len(items) if self.together and len(items) > 1 else 0
        for (owner, (key, _)), result in zip(items, results, strict=True):
            self.done[owner] = (key, result, share)
