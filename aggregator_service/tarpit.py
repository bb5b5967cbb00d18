"""Callers who keep failing authentication are answered slowly, so a flood of guesses cannot take the CPU.

A wrong enrollment secret or bearer token is refused in microseconds, and that is the trouble: a
flood of them from a few threads is answered as fast as the server can run, a core's worth of
refusals that enrolled clients' calls then queue behind. Each peer host (the caller's address
without its port) has a few refusals answered at once (a person who mistyped, a device whose
token was revoked); past that, each further refusal is held for ``delay`` seconds before it is
sent. A flooding caller's threads then wait instead of calling, and the refusals cost the server
``threads / delay`` calls a second, not its CPU (``benchmarks/register_flood.py``).

A held refusal sleeps on one of ``waiters`` server threads beyond the workers (the pool is sized
for them), so it never takes a thread that serves enrolled clients; when all are holding, a
refusal is answered at once, as without the tarpit. ``delay = 0`` turns it off.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["Tarpit", "peer_host"]


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string: ``ipv4:10.0.0.7:51234`` → ``ipv4:10.0.0.7``,
    ``ipv6:[::1]:51234`` → ``ipv6:[::1]`` (a caller's every connection is one host)."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rpartition(":")[0]
    return peer


class Tarpit:
    """Per peer host, ``burst`` refusals answered at once, refilled at one per ``delay`` s after the last hold;
    the rest held ``delay`` s.

    Hosts are remembered up to ``hosts`` (least recently refused forgotten first): a memory bound,
    since a forgotten host only gets its burst back.
    """

    def __init__(
        self,
        delay: float,
        waiters: int,
        burst: int = 5,
        hosts: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if delay < 0 or waiters < 0 or burst < 1:
            raise ValueError(f"delay and waiters must be ≥ 0 and burst ≥ 1, got {delay}, {waiters}, {burst}")
        self.delay, self.burst, self.hosts = float(delay), int(burst), int(hosts)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(waiters) if waiters else None
        self._tokens: OrderedDict[str, tuple[float, float]] = OrderedDict()  # host → (tokens, as of when)

    def refused(self, peer: str) -> float:
        """Called before a refusal for failed authentication is sent: holds it when ``peer``'s host has
        no refusals left to be answered at once; the seconds it held."""
        if self.delay == 0 or self._slots is None:
            return 0.0
        host, now = peer_host(peer), self._clock()
        with self._lock:
            tokens, since = self._tokens.pop(host, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + max(0.0, now - since) / self.delay)
            free = tokens >= 1.0
            # a held refusal restarts the refill from when it will be answered: a guesser that keeps calling
            # (one thread or many) gets no refusal at once until it stops for a while
            self._tokens[host] = (tokens - 1.0, now) if free else (tokens, now + self.delay)
            while len(self._tokens) > self.hosts:
                self._tokens.popitem(last=False)
        if free or not self._slots.acquire(blocking=False):
            return 0.0
        try:
            self._sleep(self.delay)
        finally:
            self._slots.release()
        return self.delay
