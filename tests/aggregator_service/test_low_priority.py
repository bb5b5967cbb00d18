"""A close's thread: nice 19 on Linux, its result and its exception handed back to the caller."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from aggregator_service.low_priority import NICE, at_lowest_priority


def test_the_work_runs_on_another_thread_at_nice_19_and_returns_its_result() -> None:
    caller = threading.get_native_id()
    seen = at_lowest_priority(lambda: (threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0)))
    assert seen[0] != caller
    if sys.platform.startswith("linux"):  # PRIO_PROCESS with 0 reads the calling thread's own value on Linux
        assert seen[1] == NICE
    assert os.getpriority(os.PRIO_PROCESS, 0) != NICE  # the caller's thread is untouched


def test_the_works_exception_reaches_the_caller() -> None:
    def fail() -> None:
        raise KeyError("round 3")

    with pytest.raises(KeyError, match="round 3"):
        at_lowest_priority(fail)
