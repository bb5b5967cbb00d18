"""Admission: how many callers may do one kind of work at once, how many may wait, and the rest refused.

A gRPC sync server has a fixed pool of threads; a call that waits holds one. So work that must
be limited (receiving a push holds a model's worth of memory) is guarded by a :class:`Gate`:
``slots`` callers inside, at most ``waiting`` more blocked in line, and any caller beyond that
refused at once, so waiting callers can never take the threads other calls need. A client's own
pushes are limited apart from that (:class:`LatestPerClient`): one enrolled client that opens push
streams and sends nothing holds one thread and one slot, not all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Gate", "LatestPerClient"]


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

    @property
    def in_line(self) -> int:
        """Callers waiting for a slot now."""
        with self._cond:
            return self._in_line


class _Call(Protocol):
    def cancel(self) -> Any: ...


class LatestPerClient:
    """One call of a kind per client: a client's new call cancels its call before.

    A client that opens another push has given up on the one before (it retries after a broken
    link, whose stream the server may not see end for hours); cancelling it frees its thread and its
    slot at once. A client that opens many holds one.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._calls: dict[str, _Call] = {}

    def enter(self, client_id: str, call: _Call) -> None:
        with self._cond:
            before = self._calls.get(client_id)
            self._calls[client_id] = call
        if before is not None:
            before.cancel()

    def leave(self, client_id: str, call: _Call) -> None:
        with self._cond:
            if self._calls.get(client_id) is call:
                del self._calls[client_id]
                self._cond.notify_all()

    def if_latest(self, client_id: str, call: _Call, action: Callable[[], None]) -> bool:
        """Run ``action`` if ``call`` is still the client's call of this kind (no newer one replaced it), with
        no newer call able to enter meanwhile; whether it ran."""
        with self._cond:
            if self._calls.get(client_id) is not call:
                return False
            action()
            return True

    def end(self, client_id: str, timeout: float) -> bool:
        """Cancel the client's call in flight, if any, and wait up to ``timeout`` s for it to leave."""
        with self._cond:
            call = self._calls.get(client_id)
        if call is None:
            return True
        call.cancel()
        with self._cond:
            return self._cond.wait_for(lambda: self._calls.get(client_id) is not call, timeout)
