"""The prune gate: writes share it; a close that prunes waits for those in flight, and holds off new ones."""

from __future__ import annotations

import threading
from collections.abc import Callable

from support import wait_until

from aggregator_service.coordinator.prune_gate import PruneGate


def _hold(enter: Callable[[], object], release: threading.Event, log: list[str], name: str) -> threading.Thread:
    def body() -> None:
        with enter():  # type: ignore[attr-defined]
            log.append(f"{name} in")
            release.wait(30)
            log.append(f"{name} out")

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    return t


def test_writes_share_the_gate_and_a_close_waits_for_them() -> None:
    gate, log = PruneGate(), []
    first, second = threading.Event(), threading.Event()
    w1 = _hold(gate.write, first, log, "w1")
    w2 = _hold(gate.write, second, log, "w2")
    assert wait_until(lambda: log.count("w1 in") + log.count("w2 in") == 2)  # both in at once
    done = threading.Event()
    close = _hold(gate.prune, done, log, "close")
    assert wait_until(lambda: gate.closes_waiting == 1)
    first.set()
    assert wait_until(lambda: "w1 out" in log)
    assert "close in" not in log  # w2 is still in flight
    second.set()
    assert wait_until(lambda: "close in" in log)
    done.set()
    for t in (w1, w2, close):
        t.join(30)
        assert not t.is_alive()
    assert log.index("close in") > max(log.index("w1 out"), log.index("w2 out"))


def test_a_waiting_close_goes_before_writes_that_come_after_it() -> None:
    """A stream of pushes cannot hold a close off: once a close waits, a new write queues behind it."""
    gate, log = PruneGate(), []
    first, closing, later = threading.Event(), threading.Event(), threading.Event()
    w1 = _hold(gate.write, first, log, "w1")
    assert wait_until(lambda: "w1 in" in log)
    close = _hold(gate.prune, closing, log, "close")
    assert wait_until(lambda: gate.closes_waiting == 1)
    w2 = _hold(gate.write, later, log, "w2")
    assert wait_until(lambda: gate.writes_waiting == 1)  # w2 waits although only a write holds the gate
    first.set()
    assert wait_until(lambda: "close in" in log)
    assert "w2 in" not in log and gate.writes_waiting == 1
    closing.set()
    assert wait_until(lambda: "w2 in" in log)
    later.set()
    for t in (w1, close, w2):
        t.join(30)
        assert not t.is_alive()
    assert log == ["w1 in", "w1 out", "close in", "close out", "w2 in", "w2 out"]


def test_a_close_that_raises_lets_writes_in_again() -> None:
    gate = PruneGate()
    try:
        with gate.prune():
            raise RuntimeError("the close's commit failed")
    except RuntimeError:
        pass
    entered = threading.Event()

    def write() -> None:
        with gate.write():
            entered.set()

    threading.Thread(target=write, daemon=True).start()
    assert entered.wait(30)
