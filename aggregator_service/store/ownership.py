"""One aggregator per federation: a lock held for as long as the process serves it.

The coordinator keeps the open round in memory, so two aggregators serving the same federation
(a second replica, an operator starting the service twice) would each close rounds the other
does not know about. :func:`exclusive_federation` makes the second one refuse to start:

* **PostgreSQL**: a session-level advisory lock, keyed by database, schema and federation name,
  on a connection kept open while serving. PostgreSQL drops it when that session ends, so a
  killed aggregator never leaves it behind.
* **SQLite**: ``flock`` on a file beside the database (``<database>.<federation>.lock``), which
  also names the holder's pid. The kernel drops it when the process dies, ``kill -9`` included.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from .engine import create_engine_for

__all__ = ["FederationBusy", "exclusive_federation"]


class FederationBusy(RuntimeError):
    """Another aggregator serves this federation on this database."""


_PG_TRY_LOCK = text(
    "SELECT pg_try_advisory_lock(hashtextextended(current_database() || '/' || current_schema() || '/' || :name, 0))"
)


@contextmanager
def exclusive_federation(url: str, federation_name: str) -> Iterator[None]:
    """Hold the federation's lock inside the block; :class:`FederationBusy` when another process holds it."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database in (None, "", ":memory:"):  # a memory database is private to its process
            yield
            return
        with _file_lock(Path(u.database), federation_name, url):
            yield
        return
    engine = create_engine_for(url, poolclass=NullPool)
    try:
        conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")  # no transaction left open
        try:
            if not conn.execute(_PG_TRY_LOCK, {"name": federation_name}).scalar():
                raise FederationBusy(
                    f"federation {federation_name!r} in {u.render_as_string(hide_password=True)} is served by "
                    "another aggregator (it holds the federation's advisory lock): stop it first, or serve "
                    "another federation name or database"
                )
            yield
        finally:
            conn.close()  # ends the session, which releases the lock
    finally:
        engine.dispose()


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
            raise FederationBusy(
                f"federation {federation_name!r} in {url} is served by another aggregator (pid {holder}, lock "
                f"{path}): stop it first, or serve another federation name or database"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock
