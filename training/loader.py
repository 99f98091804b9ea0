"""Batches built ahead of the optimizer, by threads, in step order.

A step's batch depends only on (seed, step) (`Trainer.batch`), so it can be built before its step
comes without changing a bit of the run. It is mostly a copy of cached feature rows (a 64 x 48
batch is 117 MB of them): on a GPU that copy, not the drafter, bounds the step, and the copy
releases the GIL (numpy and torch copies do), so a few threads overlap it with the device's work.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class BatchStream(Generic[T]):
    """`build(step)` for steps start, start + 1, ..., `ahead` of them in flight on `workers` threads
    (0 workers: each built when taken, on the caller's thread)."""

    def __init__(self, build: Callable[[int], T], start: int, workers: int, ahead: int | None = None) -> None:
        self.build, self.next = build, start
        self.ahead = max(1, ahead if ahead is not None else 2 * workers)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="batches") if workers > 0 else None
        self.pending: dict[int, Future] = {}

    def take(self, step: int) -> T:
        """The batch of `step`; steps are taken in order (another step starts the stream there)."""
        if self.pool is None:
            return self.build(step)
        if step not in self.pending:  # the first take, or the caller skipped ahead: restart there
            self._drop()
            self.next = step
        self._fill(step)
        batch = self.pending.pop(step).result()
        self._fill(step + 1)
        return batch

    def _fill(self, first: int) -> None:
        self.next = max(self.next, first)
        while self.next < first + self.ahead:
            self.pending[self.next] = self.pool.submit(self.build, self.next)
            self.next += 1

    def _drop(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()

    def close(self) -> None:
        if self.pool is not None:
            self._drop()
            self.pool.shutdown(wait=True)

    def __enter__(self) -> BatchStream[T]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
