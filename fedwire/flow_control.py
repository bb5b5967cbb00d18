"""What each side of an aggregator channel lets the other send ahead of reading it, and so how long a
keepalive ping's ack may take on a slow link that works.

HTTP/2 queues a PING behind the DATA already on its connection, and the peer acks it only once it has read
that data. On a link of ``r`` bytes/s the ack can therefore take ``window / r`` seconds, however alive the
link is. A keepalive timeout shorter than that cuts every long transfer on such a link, and since a cut
attempt keeps only whole chunks, a link slower than ``window / timeout`` would never finish a chunk at all.
So both sides fix their receive window (BDP probes would grow it with the bandwidth they measure,
leaving the wait no bound to count on), and a client derives its keepalive timeout from that window and
the slowest link it allows for (:func:`keepalive_timeout`).
"""

from __future__ import annotations

__all__ = [
    "KEEPALIVE_SECONDS",
    "MAX_MESSAGE_BYTES",
    "RECEIVE_WINDOW_BYTES",
    "keepalive_timeout",
]

#: Chunks carry ≤ 1 MiB of data; 4 MiB + headroom is gRPC's default and leaves room for headers.
MAX_MESSAGE_BYTES = 4 * 2**20 + 64 * 2**10
#: Each side's HTTP/2 receive window (stream and connection): how much may be in flight to it before it reads.
#: A fixed window, not one grown by BDP probes, which on loopback grew to megabytes per stream and made the
#: aggregator's memory grow with the number of concurrent pushes (benchmarks/memory.py: 14× the model at 50
#: resnet18 clients, 3.8× with this). 256 KiB is 20 Mbit/s per transfer at 100 ms RTT.
RECEIVE_WINDOW_BYTES = 256 << 10
#: A call in flight pings this often, so a dead link fails the call long before its deadline.
KEEPALIVE_SECONDS = 30.0


def keepalive_timeout(min_link_bytes_per_second: float, keepalive_seconds: float = KEEPALIVE_SECONDS) -> float:
    """How long a ping may go unanswered before the link counts as dead: two ping intervals, or the time a
    full receive window takes at the slowest link allowed for, with a quarter's headroom, whichever is longer."""
    if min_link_bytes_per_second <= 0:
        raise ValueError(f"min_link_bytes_per_second must be > 0, got {min_link_bytes_per_second}")
    return max(2 * keepalive_seconds, 1.25 * RECEIVE_WINDOW_BYTES / min_link_bytes_per_second)
