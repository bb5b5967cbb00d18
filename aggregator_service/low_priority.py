"""Heavy work that yields to serving: a close computes on a thread of its own at the lowest CPU priority.

A close folds every update of a round and writes the new model, seconds of CPU for a large model,
while a thousand clients poll GetTask and Heartbeat on the server's other threads. On Linux a
thread has its own nice value, so the close's thread at nice 19 takes whatever CPU the serving
threads leave (the store's WAL checkpoint thread runs the same way); elsewhere it runs at the
process's priority. The caller waits for the result as if it had computed it itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["NICE", "at_lowest_priority", "lower_this_thread"]

NICE = 19
T = TypeVar("T")


def lower_this_thread() -> None:
    """Give the calling thread nice ``NICE`` (Linux: a thread's own value; elsewhere nothing, as it would be the
    whole process's)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


def at_lowest_priority(fn: Callable[[], T], name: str = "low-priority") -> T:
    """``fn()`` on a new thread at nice ``NICE``; returns its result or raises its exception."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        lower_this_thread()
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
