"""The bearer-token lookup every RPC makes, as cheap as a database read can be.

Tokens are never cached (a revocation by any process must refuse the very next call), so this
is the hottest read of the service: about four per client per round. On a SQLite file each RPC
thread keeps its own autocommit, read-only ``sqlite3`` connection, and each lookup is one
``SELECT``, its own WAL read transaction: it sees every commit and waits for no writer. That
skips SQLAlchemy's pool checkout, ``BEGIN`` and rollback, which cost more than the read
itself. Other databases run one prebuilt Core statement on the service's engine.
"""

from __future__ import annotations

import sqlite3
import threading
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import bindparam, select
from sqlalchemy.engine import Engine

from aggregator_service import store

__all__ = ["TokenLookup", "TokenRow"]


class TokenRow(NamedTuple):
    id: str
    federation_id: int
    revoked_at: Any  # only ever compared with None
    tier: float
    name: str
    number: int
    last_seen: datetime
    cert_sha256: str | None


_COLUMNS = [c.name for c in (getattr(store.Client, f) for f in TokenRow._fields)]
# built once: each call skips building the query and adapting result columns (half its cost)
_STATEMENT = select(*(getattr(store.Client, f) for f in TokenRow._fields)).where(
    store.Client.token_hash == bindparam("token_hash")
)
_SQL = f"SELECT {', '.join(_COLUMNS)} FROM {store.Client.__tablename__} WHERE token_hash = ?"


class TokenLookup:
    """``lookup(token_hash)`` → the client's :class:`TokenRow`, or ``None``; thread-safe."""

    def __init__(self, engine: Engine, *, busy_timeout_ms: int = 30_000) -> None:
        self._engine = engine
        database = engine.url.database
        self._sqlite_path = (
            database if engine.dialect.name == "sqlite" and database not in (None, "", ":memory:") else None
        )
        self._busy_timeout_ms = busy_timeout_ms
        self._local = threading.local()

    def __call__(self, token_hash: str) -> TokenRow | None:
        if self._sqlite_path is None:
            with self._engine.connect() as conn:
                row = conn.execute(_STATEMENT, {"token_hash": token_hash}).one_or_none()
            return None if row is None else TokenRow(*row)
        # fetchall, not fetchone: a statement left unfinished would keep its read transaction, and
        # with it a WAL snapshot that stops checkpoints (the log grows, every statement slows)
        rows = self._connection().execute(_SQL, (token_hash,)).fetchall()
        if not rows:
            return None
        hit = rows[0]
        seen = datetime.fromisoformat(hit[6])  # SQLAlchemy stores UTC without an offset on SQLite
        cid, federation_id, revoked_at, tier, name, number, _, cert = hit
        last_seen = seen if seen.tzinfo else seen.replace(tzinfo=UTC)
        return TokenRow(cid, federation_id, revoked_at, tier, name, number, last_seen, cert)

    def _connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            assert self._sqlite_path is not None
            conn = sqlite3.connect(self._sqlite_path, isolation_level=None)  # autocommit: no lingering snapshot
            conn.execute("PRAGMA query_only=1")
            conn.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_ms)}")
            self._local.conn = conn
        return conn
