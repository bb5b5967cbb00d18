"""SQLite WAL checkpoints in a thread of their own, off the path of every commit.

By default SQLite checkpoints inside ``COMMIT``: the commit that takes the WAL past
``wal_autocheckpoint`` pages (1000, 64 MB at the store's 64 KiB pages) also copies the whole WAL
into the database file and fsyncs it before it returns. The aggregator acknowledges an update
only after its commit, so with updates of tens of megabytes every other push would wait for a
whole checkpoint before its acknowledgement.

A writer engine of the store therefore moves the automatic checkpoint out of reach
(:data:`BACKSTOP_PAGES`) and gives the work to a :class:`WalCheckpointer`: a daemon thread with
its own connection, at the lowest CPU priority, that runs ``PRAGMA wal_checkpoint(PASSIVE)``
whenever the WAL file has changed, at most every ``interval`` seconds. A passive checkpoint
waits for no reader and no writer, so commits never wait for it, and it copies what SQLite's
own would have: the WAL stays as bounded as before (a reader pinning an old snapshot stalls
both alike), and SQLite resets it to its start once everything is copied. Each engine starts
its thread on its first connection and stops it when it is disposed or collected.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from pathlib import Path

from aggregator_service.low_priority import lower_this_thread

__all__ = ["WalCheckpointer"]

log = logging.getLogger(__name__)

# a commit still checkpoints, as SQLite would, once the WAL has this many pages (4× SQLite's default: 256 MB at
# the store's 64 KiB pages): should the thread ever fall that far behind, the WAL stays bounded all the same
BACKSTOP_PAGES = 4000


class WalCheckpointer:
    """Checkpoints the WAL of the SQLite file at ``path`` every ``interval`` seconds it has changed."""

    def __init__(self, path: str | os.PathLike[str], interval: float = 0.1) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.path = Path(path)
        self.wal = self.path.with_name(self.path.name + "-wal")
        self.interval = interval
        self.checkpoints = 0  # checkpoints run, for tests and logs
        self._guard = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread unless it runs; called on each new connection, so it must be cheap then."""
        if self.running:
            return
        with self._guard:
            if self.running:
                return
            self._stopped = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._stopped,), name=f"wal-checkpoint:{self.path.name}", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread (after the checkpoint in progress, if any); the next :meth:`start` starts anew."""
        with self._guard:
            thread, self._thread = self._thread, None
            self._stopped.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def checkpoint(self, conn: sqlite3.Connection) -> tuple[int, int]:
        """One passive checkpoint: ``(frames in the WAL, frames copied into the database)``."""
        busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        self.checkpoints += 1
        return (frames, copied) if not busy else (frames, -1)

    def _run(self, stopped: threading.Event) -> None:
        lower_this_thread()
        conn: sqlite3.Connection | None = None
        seen: tuple[int, int] | None = None  # (mtime, size) of the WAL when it was last checkpointed in full
        try:
            while not stopped.wait(self.interval):
                try:
                    st = os.stat(self.wal)
                except FileNotFoundError:  # no WAL yet, or the last connection closed and removed it
                    seen = None
                    continue
                changed = (st.st_mtime_ns, st.st_size)
                if changed == seen:
                    continue
                try:
                    if conn is None:
                        conn = sqlite3.connect(self.path, timeout=5.0, isolation_level=None, check_same_thread=False)
                    frames, copied = self.checkpoint(conn)
                except sqlite3.Error as exc:  # the next change tries again; the WAL only waits longer
                    log.warning("wal_checkpoint_failed path=%s error=%r", self.path, exc)
                    continue
                # a reader still on older frames leaves some uncopied: try again next time even unchanged
                seen = changed if copied == frames else None
        finally:
            if conn is not None:
                conn.close()
