"""Group commit: writes that arrive together share one transaction, and one fsync.

The store acknowledges a write only after its commit, and a commit is an fsync (milliseconds
on SQLite). A hundred clients pushing in the same second would each wait for every earlier
commit in turn. Here the first writer to find no commit in progress leads: it takes every
write queued so far (itself included), runs them in one transaction and commits; writers
that arrived meanwhile queue for the next batch, which the first of them leads. Each writer
still returns only after the commit that holds its write.

A write is a function of a session and must be safe to run again: when a batch fails, it
is rolled back and each of its writes runs again in a transaction of its own, so one bad
write (a stale round, a conflict) fails alone and the others still commit. ``guard``, when
given, is entered around each transaction, before it begins (the coordinator's prune gate).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Generic, TypeVar

from sqlalchemy.orm import Session, sessionmaker

__all__ = ["GroupCommit"]

T = TypeVar("T")


class _Write(Generic[T]):
    __slots__ = ("done", "error", "fn", "lead", "result", "wake")

    def __init__(self, fn: Callable[[Session], T]) -> None:
        self.fn = fn
        self.wake = threading.Event()
        self.lead = False  # asked to lead the next batch
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None


class GroupCommit:
    """Run ``write(session)`` functions in shared transactions; :meth:`run` returns after the commit."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        max_batch: int = 32,
        guard: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
        self._factory = factory
        self._guard = guard
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[_Write[Any]] = []
        self._busy = False  # a leader is running a batch
        self.batches = 0  # committed transactions, for tests and logs
        self.writes = 0

    def run(self, write: Callable[[Session], T]) -> T:
        item: _Write[T] = _Write(write)
        with self._lock:
            self._queue.append(item)
            item.lead, self._busy = not self._busy, True
        while True:
            if item.lead:
                item.lead = False
                self._lead()
            item.wake.wait()
            if item.done:
                break
            item.wake.clear()  # woken to lead
        if item.error is not None:
            raise item.error
        return item.result  # type: ignore[no-any-return]

    def _lead(self) -> None:
        with self._lock:
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
        try:
            self._commit(batch)
        finally:
            with self._lock:
                successor = self._queue[0] if self._queue else None
                self._busy = successor is not None
            for item in batch:
                item.done = True
                item.wake.set()
            if successor is not None:
                successor.lead = True
                successor.wake.set()

    def _commit(self, batch: list[_Write[Any]]) -> None:
        if len(batch) > 1:
            try:
                with self._guard(), self._factory.begin() as s:
                    results = [item.fn(s) for item in batch]
            except BaseException:
                pass
            else:
                for item, result in zip(batch, results, strict=True):
                    item.result = result
                self.batches += 1
                self.writes += len(batch)
                return
        for item in batch:
            try:
                with self._guard(), self._factory.begin() as s:
                    item.result = item.fn(s)
                self.batches += 1
                self.writes += 1
            except BaseException as exc:
                item.error = exc
