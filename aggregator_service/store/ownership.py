"""One aggregator per federation: a lock held for as long as the process serves it.

The coordinator keeps the open round in memory, so two aggregators serving the same federation
(a second replica, an operator starting the service twice) would each close rounds the other
does not know about. :func:`exclusive_federation` makes the second one refuse to start:

* **PostgreSQL**: a session-level advisory lock, keyed by database, schema and federation name,
  on a connection kept open while serving. PostgreSQL drops it when that session ends, so a
  killed aggregator never leaves it behind.
* **SQLite**: ``flock`` on a file beside the database, ``<database>.<federation>-<hash>.lock``
  (the name made safe for a file name, plus a hash of it), which also names the holder's pid, and,
  where the kernel has them (Linux), an open-file-description ``fcntl`` write lock on the same file:
  :func:`federation_served` tests that one with ``F_OFD_GETLK``, which takes nothing, so a probe never
  makes a starting aggregator find its federation busy. The kernel drops both when the process dies,
  ``kill -9`` included. An older release takes the ``flock`` alone, and still excludes (and is excluded by)
  this one.

:func:`federation_served` tells whether some aggregator serves a federation now, without taking part in
the lock (for the dashboard).

The lock's own PostgreSQL connection has a ``statement_timeout`` (:data:`LOCK_STATEMENT_TIMEOUT_MS`), and
:meth:`_AdvisoryLock.release` waits a bounded time for its connection to close, so a database that hangs
(a stopped backend, a link that swallows packets) never holds a shutdown.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlsplit

from sqlalchemy import text
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from .engine import create_engine_for

__all__ = [
    "LOCK_STATEMENT_TIMEOUT_MS",
    "FederationBusy",
    "FederationLock",
    "LockUnconfirmed",
    "exclusive_federation",
    "federation_served",
]

#: the lock connection's ``statement_timeout``: its statements (``SELECT 1``, ``pg_try_advisory_lock``) never
#: wait on anything, so one that runs this long means the database is stuck
LOCK_STATEMENT_TIMEOUT_MS = 5_000
#: how long closing the lock's connection may take when the server lets go (a hung database: the process
#: exits anyway, and the lock dies with its session)
_RELEASE_WAIT_SECONDS = 2.0


class FederationBusy(RuntimeError):
    """Another aggregator serves this federation on this database."""


_PG_KEY = "hashtextextended(current_database() || '/' || current_schema() || '/' || :name, 0)"
_PG_TRY_LOCK = text(f"SELECT pg_try_advisory_lock({_PG_KEY})")
# a bigint advisory key shows in pg_locks split: classid its high 32 bits, objid its low 32, objsubid 1
_PG_HELD = text(
    f"SELECT EXISTS (SELECT 1 FROM pg_locks, (SELECT {_PG_KEY} AS k) AS key "
    "WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid = ((key.k >> 32) & 4294967295)::oid AND objid = (key.k & 4294967295)::oid)"
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
        try:
            conn.execute(text(f"SET statement_timeout = {LOCK_STATEMENT_TIMEOUT_MS}"))
        except BaseException:
            conn.close()
            raise
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
        conn, self.conn = self.conn, None
        if conn is None:
            return

        def close() -> None:
            try:
                conn.close()  # ends the session, which releases the lock
            except DBAPIError:
                pass

        # a check stuck on a hung database holds the connection: closing it would wait as long
        closer = threading.Thread(target=close, name="federation-lock-release", daemon=True)
        closer.start()
        closer.join(_RELEASE_WAIT_SECONDS)


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


def federation_served(database: str | Engine | Connection, federation_name: str) -> bool:
    """Whether an aggregator holds ``federation_name``'s lock on ``database`` (a URL, or an engine or connection
    of the caller's, whose timeouts then bound the query) now; takes no lock.

    PostgreSQL: the advisory lock granted to some session in ``pg_locks``. SQLite: the ``fcntl`` lock on
    the lock file, tested with ``F_OFD_GETLK`` (without it, a ``flock`` probe let go at once; the aggregator's
    start retries briefly, so such a probe never makes it refuse to start). A memory database is private to
    its process: never served as far as another can tell.
    """
    u = make_url(database) if isinstance(database, str) else database.engine.url
    if u.get_backend_name() == "sqlite":
        path = _sqlite_path(u)
        return False if path is None else _file_served(_lock_path(path, federation_name))
    if isinstance(database, Connection):
        return bool(database.execute(_PG_HELD, {"name": federation_name}).scalar())
    engine = create_engine_for(database, poolclass=NullPool) if isinstance(database, str) else database
    try:
        with engine.connect() as conn:
            return bool(conn.execute(_PG_HELD, {"name": federation_name}).scalar())
    finally:
        if isinstance(database, str):
            engine.dispose()


def _sqlite_path(u: URL) -> Path | None:
    """The file a SQLite URL names, a URI filename (``file:…?mode=rw``, as the dashboard opens it) included;
    ``None`` for a memory database."""
    name = u.database
    if name in (None, "", ":memory:"):
        return None
    if u.query.get("uri") and name.startswith("file:"):
        parts = urlsplit(name)
        return None if "mode=memory" in parts.query else Path(unquote(parts.path))
    return Path(name)


def _lock_path(database: Path, federation_name: str) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in federation_name)
    digest = hashlib.sha256(federation_name.encode()).hexdigest()[:8]  # two names that sanitize alike differ
    return database.resolve().with_name(f"{database.name}.{safe}-{digest}.lock")


# open-file-description locks (Linux): owned by the open file, like flock (two opens in one process exclude
# each other, unlike classic fcntl locks), and testable with F_OFD_GETLK, unlike flock
_OFD = hasattr(fcntl, "F_OFD_GETLK") and hasattr(fcntl, "F_OFD_SETLK")
_FLOCK = "hhqqi4x"  # struct flock on LP64 Linux: l_type, l_whence, (pad), l_start, l_len, l_pid, (pad)
# a start retries its flock this long: a flock probe (where there are no OFD locks) holds it for microseconds
_START_RETRY_SECONDS = 0.5


def _ofd(fd: int, cmd: int, kind: int) -> int:
    """``fcntl(fd, cmd, struct flock)`` over the whole file; the ``l_type`` the kernel answered."""
    answer = fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, 0, 0, 0))
    return int(struct.unpack(_FLOCK, answer)[0])


def _file_served(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # never served here
        return False
    try:
        if _OFD:
            return _ofd(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK) != fcntl.F_UNLCK
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _take_file_lock(fd: int) -> bool:
    """``flock`` then (where there are OFD locks) the OFD write lock; ``False`` when another holds either."""
    deadline = time.monotonic() + (0 if _OFD else _START_RETRY_SECONDS)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
    if _OFD:
        try:
            _ofd(fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK)
        except OSError:  # EAGAIN/EACCES: held through another open file
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
    return True


@contextmanager
def _file_lock(database: Path, federation_name: str, url: str) -> Iterator[None]:
    path = _lock_path(database, federation_name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not _take_file_lock(fd):
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise FederationBusy(_busy(federation_name, url, f" (pid {holder}, lock {path})")) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock and the OFD lock (the last descriptor of its open file)
