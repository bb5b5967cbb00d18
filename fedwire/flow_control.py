"""What each side of an aggregator channel lets the other send ahead of reading it, and so how long a
keepalive ping's ack may take on a slow link that works.

HTTP/2 queues a PING behind the DATA already on its connection, and the peer acks it only once it has read
that data. On a link of ``r`` bytes/s the ack can therefore take ``window / r`` seconds, however alive the
link is. A keepalive timeout shorter than that cuts every long transfer on such a link, and since a cut
attempt keeps only whole chunks, a link slower than ``window / timeout`` would never finish a chunk at all.
So both sides fix their receive window (BDP probes would grow it with the bandwidth they measure,
leaving the wait no bound to count on), and a client derives its keepalive timeout from that window and
the slowest link it allows for (:func:`keepalive_timeout`).

A message arrives whole or not at all, so a link that breaks every connection before a message's end makes
no progress however often it retries. A client sizes its chunks and messages to its link
(:class:`MessageSize`): halved after a cut attempt that carried fewer than :data:`CHUNKS_PER_CONNECTION` of
them, as TCP halves its window on a loss, and doubled back after a transfer that was not cut. Only a transfer
that was under way counts as cut: the server opens each transfer's stream with :data:`STREAM_STARTED`
(initial metadata, before any tensor), so a server that was down or restarting (no stream at all) leaves
the size as it was.
"""

from __future__ import annotations

import threading

from fedcore.codec import CHUNK_BYTES

__all__ = [
    "CHUNKS_PER_CONNECTION",
    "KEEPALIVE_SECONDS",
    "MAX_MESSAGE_BYTES",
    "MIN_CHUNK_BYTES",
    "RECEIVE_WINDOW_BYTES",
    "STREAM_STARTED",
    "MessageSize",
    "check_chunk_bytes",
    "keepalive_timeout",
    "stream_started",
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


#: The smallest chunk (and message) a transfer uses: its headers (≈ 60 bytes) stay under 0.5 % of it.
MIN_CHUNK_BYTES = 16 << 10
#: A cut attempt that carried fewer whole chunks than this halves the next attempt's chunk size: the message
#: a cut breaks is lost, and at this count it can be a fifth of what the attempt moved.
CHUNKS_PER_CONNECTION = 4


def check_chunk_bytes(n: int) -> int:
    """``n`` when it is a chunk size a transfer may use (a power of two from 16 KiB to 1 MiB), else ValueError."""
    if not MIN_CHUNK_BYTES <= n <= CHUNK_BYTES or n & (n - 1):
        raise ValueError(f"chunk_bytes must be a power of two from {MIN_CHUNK_BYTES} to {CHUNK_BYTES}, got {n}")
    return n


#: The initial metadata a server sends as a transfer's stream opens (FetchModel, and PushUpdate once its header
#: is read): a call that fails holding it broke under way; one without it never reached the transfer.
STREAM_STARTED = ("fedatoms-stream", "started")


def stream_started(call: object) -> bool:
    """Whether the failed gRPC ``call`` (its RpcError) had received :data:`STREAM_STARTED`."""
    initial = getattr(call, "initial_metadata", None)
    try:
        metadata = initial() if callable(initial) else None
    except Exception:  # a call that never started has nothing to say
        return False
    return any((m.key, m.value) == STREAM_STARTED for m in metadata or ())


class MessageSize:
    """The chunk and message size of a link's transfers (see the module's docstring), shared by the clients
    on one channel.

    Every size is a power of two dividing 1 MiB, and a transfer's attempts never grow it (:meth:`next`), so a
    resume offset on an earlier attempt's grid is on every later one's, whatever the other transfers do.
    """

    def __init__(self) -> None:
        self.bytes = CHUNK_BYTES
        self._lock = threading.Lock()

    def next(self, previous: int | None = None) -> int:
        """The size of a transfer's next attempt: the link's, never above the transfer's ``previous`` one."""
        return self.bytes if previous is None else min(previous, self.bytes)

    def cut(self, progress: int, size: int) -> int:
        """An attempt at ``size`` broke under way after ``progress`` payload bytes arrived whole; returns the size
        its transfer goes on at (the link's, for the transfers to come, is at most that)."""
        if progress >= CHUNKS_PER_CONNECTION * size:
            return size
        smaller = max(MIN_CHUNK_BYTES, size // 2)
        with self._lock:
            self.bytes = min(self.bytes, smaller)
        return smaller

    def completed(self) -> None:
        """A transfer finished without a cut."""
        with self._lock:
            self.bytes = min(CHUNK_BYTES, self.bytes * 2)
