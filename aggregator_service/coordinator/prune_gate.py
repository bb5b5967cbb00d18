"""The prune gate: no write of per-client history is in flight while a close prunes it.

A write of ``transfers`` or ``evaluations`` rows reads the retention watermark
(``history_pruned_through``) and writes detail rows only for rounds after it. On PostgreSQL a
close's ``DELETE`` does not see rows a concurrent transaction has not committed: a write that read
the old watermark and commits after the prune leaves detail rows of a pruned round, and an
evaluation the prune's summary never counted. Writes hold the gate shared, from before their
transaction begins until it has ended; a close that prunes holds it alone, from before its
transaction begins until the watermark it committed is the one in memory. Taken before any
database lock, it cannot close a cycle with one. A waiting close goes first (new writes queue
behind it), so a steady stream of pushes cannot hold a close off.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PruneGate"]


class PruneGate:
    """A shared/exclusive gate that prefers the exclusive side (the close)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._writes = 0  # holding it shared
        self._pruning = False
        self.closes_waiting = 0
        self.writes_waiting = 0

    @contextmanager
    def write(self) -> Iterator[None]:
        """Held by one transaction that writes detail rows (a ledger flush, a batch of pushes and reports)."""
        with self._cond:
            self.writes_waiting += 1
            try:
                self._cond.wait_for(lambda: not self._pruning and self.closes_waiting == 0)
            finally:
                self.writes_waiting -= 1
            self._writes += 1
        try:
            yield
        finally:
            with self._cond:
                self._writes -= 1
                self._cond.notify_all()

    @contextmanager
    def prune(self) -> Iterator[None]:
        """Held by a close that prunes, alone: in-flight writes have ended, new ones wait."""
        with self._cond:
            self.closes_waiting += 1
            try:
                self._cond.wait_for(lambda: not self._pruning and self._writes == 0)
            finally:
                self.closes_waiting -= 1
                self._cond.notify_all()  # writes that queued behind this close may go, if it never gets in
            self._pruning = True
        try:
            yield
        finally:
            with self._cond:
                self._pruning = False
                self._cond.notify_all()
