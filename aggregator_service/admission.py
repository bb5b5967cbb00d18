"""Admission: how many callers may do one kind of work at once, how many may wait, and the rest refused.

A gRPC sync server has a fixed pool of threads; a call that waits holds one. So work that must
be limited (receiving a push holds a model's worth of memory) is guarded by a :class:`Gate`:
``slots`` callers inside, at most ``waiting`` more blocked in line, and any caller beyond that
refused at once, so waiting callers can never take the threads other calls need.
"""

from __future__ import annotations

import threading

__all__ = ["Gate"]


class Gate:
    """At most ``slots`` callers inside and ``waiting`` in line; :meth:`enter` is False for anyone beyond."""

    def __init__(self, slots: int, waiting: int) -> None:
        if slots < 1 or waiting < 0:
            raise ValueError(f"a gate needs slots ≥ 1 and waiting ≥ 0, got {slots} and {waiting}")
        self.slots, self.waiting = slots, waiting
        self._cond = threading.Condition()
        self._inside = 0
        self._in_line = 0

    def enter(self) -> bool:
        """Wait for a slot, unless the line is full (then False at once: refuse the caller)."""
        with self._cond:
            if self._inside < self.slots:
                self._inside += 1
                return True
            if self._in_line >= self.waiting:
                return False
            self._in_line += 1
            try:
                self._cond.wait_for(lambda: self._inside < self.slots)
            finally:
                self._in_line -= 1
            self._inside += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            self._cond.notify()
