"""One aggregator per federation: a lock held for as long as the process serves it.

The coordinator keeps the open round in memory, so two aggregators serving the same federation
(a second replica, an operator starting the service twice) would each close rounds the other
does not know about. :func:`exclusive_federation` makes the second one refuse to start:

* **PostgreSQL**: a session-level advisory lock, keyed by database, schema and federation name,
  on a connection kept open while serving. PostgreSQL drops it when that session ends, so a
  killed aggregator never leaves it behind.
* **SQLite**: ``flock`` on a file beside the database, ``<database>.<federation>-<hash>.lock``
  (the name made safe for a file name, plus a hash of it), which also names the holder's pid.
  The kernel drops it when the process dies, ``kill -9`` included.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from .engine import create_engine_for

__all__ = ["FederationBusy", "FederationLock", "LockUnconfirmed", "exclusive_federation"]


class FederationBusy(RuntimeError):
    """Another aggregator serves this federation on this database."""


_PG_TRY_LOCK = text(
    "SELECT pg_try_advisory_lock(hashtextextended(current_database() || '/' || current_schema() || '/' || :name, 0))"
)


class LockUnconfirmed(RuntimeError):
    """The database did not answer, so the lock could neither be confirmed nor taken again: the server keeps
    serving (its writes fail until the database is back) and checks again; a restart of PostgreSQL, a failover
    or a network cut is no reason to exit."""


class FederationLock:
    """The held lock; :meth:`check` (the server calls it every few seconds) confirms it is still held."""

    def check(self) -> bool:
        """Still held? ``False``: yes. ``True``: it was lost and has been taken again. A ``flock`` lives as
        long as this process, so it is always held."""
        return False


class _AdvisoryLock(FederationLock):
    def __init__(self, url: str, federation_name: str) -> None:
        self.url, self.name = url, federation_name
        self.engine = create_engine_for(url, poolclass=NullPool)
        self.conn: Connection | None = None

    def take(self) -> bool:
        conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")  # no transaction left open
        if conn.execute(_PG_TRY_LOCK, {"name": self.name}).scalar():
            self.conn = conn
            return True
        conn.close()
        return False

    def check(self) -> bool:
        """The lock lives as long as its session: if that session died (a database restart, a network
        cut, ``idle_session_timeout``), take the lock again (``True``), or raise :class:`FederationBusy`
        when another aggregator took it meanwhile."""
        try:
            assert self.conn is not None
            self.conn.execute(text("SELECT 1"))
            return False
        except (DBAPIError, AssertionError):
            self.release()
        try:
            taken = self.take()
        except DBAPIError as exc:
            raise LockUnconfirmed(
                f"cannot confirm the lock on federation {self.name!r}: the database does not answer "
                f"({str(getattr(exc, 'orig', None) or exc).strip().splitlines()[0]})"
            ) from exc
        if not taken:
            where = make_url(self.url).render_as_string(hide_password=True)
            raise FederationBusy(_busy(self.name, where, " (it took the lock after this one's session ended)"))
        return True

    def release(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()  # ends the session, which releases the lock
            except DBAPIError:
                pass
            self.conn = None


def _busy(name: str, where: str, holder: str) -> str:
    return (
        f"federation {name!r} in {where} is served by another aggregator{holder}: stop it first, or serve "
        "another federation name or database"
    )


@contextmanager
def exclusive_federation(url: str, federation_name: str) -> Iterator[FederationLock]:
    """Hold the federation's lock inside the block; :class:`FederationBusy` when another process holds it."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database in (None, "", ":memory:"):  # a memory database is private to its process
            yield FederationLock()
            return
        with _file_lock(Path(u.database), federation_name, url):
            yield FederationLock()
        return
    lock = _AdvisoryLock(url, federation_name)
    try:
        if not lock.take():
            raise FederationBusy(
                _busy(
                    federation_name,
                    u.render_as_string(hide_password=True),
                    " (it holds the federation's advisory lock)",
                )
            )
        yield lock
    finally:
        lock.release()
        lock.engine.dispose()


@contextmanager
def _file_lock(database: Path, federation_name: str, url: str) -> Iterator[None]:
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in federation_name)
    digest = hashlib.sha256(federation_name.encode()).hexdigest()[:8]  # two names that sanitize alike differ
    path = database.resolve().with_name(f"{database.name}.{safe}-{digest}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise FederationBusy(_busy(federation_name, url, f" (pid {holder}, lock {path})")) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock
