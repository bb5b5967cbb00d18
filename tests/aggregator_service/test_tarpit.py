"""The tarpit: a few refusals per peer host answered at once, the rest held, on bounded threads.

Hand-derived with a fake clock: burst 3, delay 2 s, so a host refused 5 times at t = 0 has 3 answered
at once and 2 held; the refill (one per delay) starts when the last hold ends.
"""

from __future__ import annotations

import threading

import pytest

from aggregator_service.tarpit import Tarpit, peer_host


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def _pit(clock: _Clock, **kw) -> Tarpit:
    return Tarpit(kw.pop("delay", 2.0), kw.pop("waiters", 4), kw.pop("burst", 3), clock=clock, sleep=clock.sleep, **kw)


def test_a_host_has_its_burst_answered_at_once_and_the_rest_held() -> None:
    clock = _Clock()
    pit = _pit(clock)
    assert [pit.refused("ipv4:10.0.0.7:5000") for _ in range(5)] == [0.0, 0.0, 0.0, 2.0, 2.0]
    assert clock.slept == [2.0, 2.0]
    clock.now = 2.0  # the refill starts when the last hold ends (t = 2): nothing back yet
    assert pit.refused("ipv4:10.0.0.7:5001") == 2.0  # another port: the same host
    clock.now = 6.0  # one refusal back (2 s per refusal since t = 4)
    assert [pit.refused("ipv4:10.0.0.7:5002") for _ in range(2)] == [0.0, 2.0]
    clock.now = 9.0  # half a refusal back since t = 8: still held
    assert pit.refused("ipv4:10.0.0.7:5003") == 2.0
    clock.now = 100.0  # refilled, but never past the burst
    assert [pit.refused("ipv4:10.0.0.7:5004") for _ in range(4)] == [0.0, 0.0, 0.0, 2.0]


def test_hosts_are_counted_apart() -> None:
    clock = _Clock()
    pit = _pit(clock, burst=1)
    assert pit.refused("ipv4:10.0.0.7:1") == 0.0
    assert pit.refused("ipv6:[::1]:2") == 0.0  # a different host still has its burst
    assert pit.refused("ipv4:10.0.0.7:3") == 2.0
    assert pit.refused("ipv6:[::1]:4") == 2.0


def test_peer_host_drops_only_the_port() -> None:
    assert peer_host("ipv4:127.0.0.1:50051") == "ipv4:127.0.0.1"
    assert peer_host("ipv6:[2001:db8::1]:443") == "ipv6:[2001:db8::1]"
    assert peer_host("unix:/run/fedatoms.sock") == "unix:/run/fedatoms.sock"


def test_when_every_waiter_holds_a_refusal_the_next_is_answered_at_once() -> None:
    """Held refusals never take more than ``waiters`` threads: past them, no hold (as without the tarpit)."""
    release = threading.Event()
    holding = threading.Semaphore(0)

    holds: list[float] = []

    def sleep(seconds: float) -> None:
        holds.append(seconds)
        holding.release()
        release.wait(10)

    pit = Tarpit(1.0, waiters=2, burst=1, sleep=sleep)
    assert pit.refused("ipv4:1.2.3.4:1") == 0.0
    threads = [threading.Thread(target=pit.refused, args=("ipv4:1.2.3.4:1",)) for _ in range(2)]
    for t in threads:
        t.start()
    assert holding.acquire(timeout=10) and holding.acquire(timeout=10)  # both waiters hold
    assert pit.refused("ipv4:1.2.3.4:1") == 0.0  # the third is not held
    release.set()
    for t in threads:
        t.join(10)
    assert holds == [1.0, 1.0]  # the two held, each for the delay


def test_delay_zero_turns_it_off_and_hosts_are_bounded() -> None:
    clock = _Clock()
    off = _pit(clock, delay=0.0)
    assert all(off.refused("ipv4:9.9.9.9:1") == 0.0 for _ in range(10)) and clock.slept == []
    pit = _pit(clock, burst=1, hosts=2)
    pit.refused("ipv4:1.1.1.1:1")
    pit.refused("ipv4:2.2.2.2:1")
    pit.refused("ipv4:3.3.3.3:1")  # forgets 1.1.1.1, which gets its burst back
    assert pit.refused("ipv4:1.1.1.1:1") == 0.0
    with pytest.raises(ValueError, match="burst"):
        Tarpit(1.0, 1, burst=0)
