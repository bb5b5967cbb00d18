"""Pushes that broke off, kept so that the client's retry sends only the rest.

On a link that drops every few megabytes a large update never gets through if every retry starts
from byte 0. A push stream that ends under the server (the client's link broke, its deadline
passed, ``GetUploadProgress`` ended it) leaves its spool files and their reassembly state here,
under the client's id and the update's ``update_id``; the retry asks ``GetUploadProgress`` where
to start and sends the rest with ``PushHeader.resume``. The stream is sequential, so what is kept
is always a prefix: the first tensors whole and part of the next.

What is kept is bounded: one push per client (its latest), ``capacity`` pushes and ``max_bytes`` of
spool in all (the oldest dropped first), each for ``ttl_seconds``. It lives in this process only:
after a restart the client finds nothing kept and pushes whole, as it would without this.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from fedcore import codec

__all__ = ["KeptUpload", "KeptUploads"]


@dataclass
class KeptUpload:
    """What a broken push stream delivered, with the files that hold its bytes."""

    update_id: str
    header: tuple[int, int, tuple[tuple[str, float], ...]]  # round, num_samples, metrics: a resume repeats them
    model: codec.Reassembler
    control: codec.Reassembler | None
    tensor_bytes: dict[str, int]
    files: contextlib.ExitStack
    kept_at: float = field(default=0.0)

    @property
    def progress(self) -> tuple[int, int]:
        """(tensors received whole, bytes of the next): model tensors first, then control deltas."""
        if self.control is None:
            return self.model.progress
        tensors, offset = self.control.progress
        return self.model.progress[0] + tensors, offset

    @property
    def bytes_received(self) -> int:
        return self.model.bytes_received + (self.control.bytes_received if self.control is not None else 0)


class KeptUploads:
    """Kept pushes by client: :meth:`keep` after a stream broke, :meth:`take` to resume it."""

    def __init__(
        self,
        max_bytes: int,
        capacity: int = 1024,
        ttl_seconds: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 0 or capacity < 0 or ttl_seconds <= 0:
            raise ValueError(
                f"kept uploads need max_bytes ≥ 0, capacity ≥ 0 and ttl_seconds > 0, got {max_bytes}, {capacity}, "
                f"{ttl_seconds}"
            )
        self.max_bytes, self.capacity, self.ttl_seconds, self._clock = max_bytes, capacity, ttl_seconds, clock
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, KeptUpload] = OrderedDict()  # client id → its kept push, oldest first

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, client_id: str, upload: KeptUpload) -> None:
        upload.kept_at = self._clock()
        with self._lock:
            gone = [self._kept.pop(client_id)] if client_id in self._kept else []
            self._kept[client_id] = upload
            gone += self._expired_locked()
            held = sum(u.bytes_received for u in self._kept.values())
            while self._kept and (len(self._kept) > self.capacity or held > self.max_bytes):
                oldest = self._kept.popitem(last=False)[1]
                held -= oldest.bytes_received
                gone.append(oldest)
        _close(gone)

    def peek(self, client_id: str, update_id: str) -> KeptUpload | None:
        """The client's kept push of ``update_id``, left in place (``GetUploadProgress``)."""
        with self._lock:
            gone = self._expired_locked()
            upload = self._kept.get(client_id)
        _close(gone)
        return upload if upload is not None and upload.update_id == update_id else None

    def take(self, client_id: str, update_id: str) -> KeptUpload | None:
        """Remove and return the client's kept push of ``update_id`` (a resumed push continues it)."""
        with self._lock:
            gone = self._expired_locked()
            upload = self._kept.get(client_id)
            if upload is not None and upload.update_id == update_id:
                del self._kept[client_id]
            else:
                upload = None
        _close(gone)
        return upload

    def drop(self, client_id: str) -> None:
        """Forget what the client kept (it pushes an update whole)."""
        with self._lock:
            upload = self._kept.pop(client_id, None)
        _close([upload] if upload is not None else [])

    def expire(self) -> None:
        """Drop those past their lifetime: keep/peek/take do too, but an idle server calls none of them
        (the server's ticker calls this)."""
        with self._lock:
            gone = self._expired_locked()
        _close(gone)

    def close(self) -> None:
        """Drop them all (the server stops: nothing can resume them)."""
        with self._lock:
            gone = list(self._kept.values())
            self._kept.clear()
        _close(gone)

    def _expired_locked(self) -> list[KeptUpload]:
        now = self._clock()
        old = [c for c, u in self._kept.items() if now - u.kept_at > self.ttl_seconds]
        return [self._kept.pop(c) for c in old]


def _close(uploads: list[KeptUpload]) -> None:
    for upload in uploads:
        upload.files.close()
