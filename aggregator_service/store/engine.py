"""Engines, sessions and schema migrations for the store.

SQLite (the default, one file next to the operator) and PostgreSQL (production, several
replicas) get the settings each needs:

* **SQLite**: WAL journal (readers never block the writer), ``foreign_keys=ON`` (SQLite
  ignores foreign keys otherwise, and ``ON DELETE CASCADE`` relies on them), a busy timeout
  so concurrent writers wait instead of failing, ``check_same_thread=False`` for the gRPC
  thread pool. pysqlite's own transaction handling is turned off and every transaction
  starts with ``BEGIN IMMEDIATE`` (SQLAlchemy's documented workaround): SAVEPOINTs then work,
  and a transaction that reads and then writes cannot fail with ``SQLITE_BUSY`` half-way
  because another connection wrote in between — writers queue on the busy timeout instead.
  ``synchronous`` stays at SQLite's default (FULL), so an acknowledged update survives a
  power cut, not only a crash. A writer engine checkpoints the WAL from a thread of its own
  (:mod:`.wal`), so no commit waits for a checkpoint.
* **PostgreSQL**: ``pool_pre_ping`` so connections dropped by a database restart or a proxy
  are replaced transparently, and bounded waits on the network (:data:`POSTGRES_CONNECT_ARGS`): a
  connect gives up after 10 s, TCP keepalives find a peer that vanished (a host down, a cut link, a
  firewall that forgot the connection) within about a minute instead of the kernel's two hours, and
  ``tcp_user_timeout`` drops a connection whose sent data stays unacknowledged for 60 s. No
  ``statement_timeout`` here: a migration or a large close may legitimately run long (the federation
  lock's own connection has one, :mod:`.ownership`). A value the URL's query or the caller's
  ``connect_args`` gives wins over these.

Migrations are Alembic revisions under ``migrations/`` run programmatically by
:func:`upgrade`; no ``alembic.ini`` is needed at run time.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from .wal import BACKSTOP_PAGES, WalCheckpointer

__all__ = [
    "MIGRATIONS_DIR",
    "POSTGRES_CONNECT_ARGS",
    "alembic_config",
    "create_engine_for",
    "current_revision",
    "downgrade",
    "head_revision",
    "scratch_schema",
    "session_factory",
    "upgrade",
]

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
# pg_advisory_xact_lock key held while migrating, so replicas starting together upgrade one at a time.
_MIGRATION_LOCK_KEY = 0x6665_6461_746D  # "fedatm"

#: libpq connection parameters every PostgreSQL engine gets unless its URL or its caller sets them
POSTGRES_CONNECT_ARGS: dict[str, Any] = {
    "connect_timeout": 10,  # seconds for a connection to be made (libpq: wait forever)
    "keepalives": 1,
    "keepalives_idle": 30,  # seconds idle before the first probe (the kernel's default: 7200)
    "keepalives_interval": 10,  # seconds between probes
    "keepalives_count": 3,  # unanswered probes before the connection is dropped
    "tcp_user_timeout": 60_000,  # ms sent data may stay unacknowledged (Linux; ignored elsewhere)
}


def create_engine_for(
    url: str | URL,
    *,
    sqlite_busy_timeout_ms: int = 30_000,
    sqlite_begin: Literal["IMMEDIATE", "DEFERRED", "EXCLUSIVE"] = "IMMEDIATE",
    sqlite_checkpoint: Literal["background", "commit"] | None = None,
    **kwargs: Any,
) -> Engine:
    """An engine configured for the store's backend; extra ``kwargs`` go to :func:`sqlalchemy.create_engine`.

    ``sqlite_begin`` chooses how SQLite transactions start: ``IMMEDIATE`` (the default)
    takes the write lock at ``BEGIN``, which serializes this engine's transactions but makes
    every read-then-write transaction safe; a read-only consumer such as the dashboard may
    pass ``DEFERRED`` so its reads never wait for the aggregator's writes.

    ``sqlite_checkpoint`` chooses who copies a SQLite file's WAL into the database: ``background``
    (the default for ``IMMEDIATE`` and ``EXCLUSIVE`` engines, the writers) runs checkpoints in a
    :class:`~.wal.WalCheckpointer` thread, so a commit returns as soon as its WAL frames are
    durable; ``commit`` (the default for ``DEFERRED``) leaves them to SQLite's automatic
    checkpoint inside the commit that takes the WAL past 1000 pages.
    """
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        checkpoint = sqlite_checkpoint or ("commit" if sqlite_begin == "DEFERRED" else "background")
        return _sqlite_engine(u, sqlite_busy_timeout_ms, sqlite_begin, checkpoint, kwargs)
    kwargs.setdefault("pool_pre_ping", True)
    if u.get_backend_name() == "postgresql" and u.get_driver_name() in ("psycopg", "psycopg2"):  # libpq's
        connect_args = dict(kwargs.pop("connect_args", None) or {})
        for key, value in POSTGRES_CONNECT_ARGS.items():
            if key not in u.query:  # connect_args would override the URL's own: the operator's value stands
                connect_args.setdefault(key, value)
        kwargs["connect_args"] = connect_args
    return create_engine(u, **kwargs)


def _sqlite_engine(u: URL, busy_timeout_ms: int, begin: str, checkpoint: str, kwargs: dict[str, Any]) -> Engine:
    if begin not in ("IMMEDIATE", "DEFERRED", "EXCLUSIVE"):
        raise ValueError(f"sqlite_begin must be IMMEDIATE, DEFERRED or EXCLUSIVE, got {begin!r}")
    if checkpoint not in ("background", "commit"):
        raise ValueError(f"sqlite_checkpoint must be background or commit, got {checkpoint!r}")
    if busy_timeout_ms < 0:
        raise ValueError(f"sqlite_busy_timeout_ms must be ≥ 0, got {busy_timeout_ms}")
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("check_same_thread", False)
    in_memory = u.database in (None, "", ":memory:")
    if in_memory:
        kwargs.setdefault("poolclass", StaticPool)  # one connection, or every checkout sees a new empty database
    engine = create_engine(u, connect_args=connect_args, **kwargs)
    # a file's WAL, checkpointed off the commit path (memory databases and URI filenames have no such file)
    checkpointer = None
    if checkpoint == "background" and not in_memory and not u.query.get("uri"):
        checkpointer = WalCheckpointer(u.database)  # type: ignore[arg-type]  # a str here
        engine.wal_checkpointer = checkpointer  # type: ignore[attr-defined]  # for tests and operators
        event.listen(engine, "engine_disposed", lambda _engine: checkpointer.stop())
        weakref.finalize(engine, checkpointer.stop)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # pysqlite emits no BEGIN/COMMIT of its own; we do
        cursor = dbapi_connection.cursor()
        try:
            # 64 KiB pages store tensor blobs in 16× fewer overflow pages (a 45 MB update commits ~4× faster);
            # it takes effect only on a new database, so it must come before WAL is switched on
            cursor.execute("PRAGMA page_size=65536")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            if checkpointer is not None:
                cursor.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_PAGES}")
        finally:
            cursor.close()
        if checkpointer is not None:
            checkpointer.start()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql(f"BEGIN {begin}")

    return engine


@contextmanager
def scratch_schema(base_url: str, prefix: str = "t") -> Iterator[str]:
    """A PostgreSQL URL whose connections live in a fresh ``<prefix>_<uuid>`` schema, dropped afterwards.

    For tests and benchmarks that share one database without seeing each other's tables.
    """
    schema = f"{prefix}_{uuid.uuid4().hex}"
    admin = create_engine(base_url)
    try:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        yield (
            make_url(base_url)
            .update_query_dict({"options": f"-csearch_path={schema}"})
            .render_as_string(hide_password=False)
        )
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.dispose()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions for units of work: ``with factory.begin() as session: …`` commits or rolls back as a whole.

    ``expire_on_commit=False`` keeps loaded rows readable after the commit (the servicer
    builds replies from them after the transaction ended).
    """
    return sessionmaker(bind=engine, expire_on_commit=False)


# --------------------------------------------------------------------------- migrations


def alembic_config(url: str | URL | None = None) -> Config:
    """An Alembic configuration for the packaged migrations, built in code (no ini file)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # New revisions are named "<rev id>.py", with rev ids like "0002_add_x" (see README.md).
    cfg.set_main_option("file_template", "%%(rev)s")
    if url is not None:
        # configparser interpolates '%', which URL-encoded passwords and options contain.
        rendered = url if isinstance(url, str) else url.render_as_string(hide_password=False)
        cfg.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    return cfg


def _run_with_connection(url: str | Engine, fn: Any) -> Any:
    engine = url if isinstance(url, Engine) else create_engine_for(url)
    try:
        with engine.connect() as conn:
            sqlite = conn.dialect.name == "sqlite"
            if sqlite:
                # SQLite alters a table by copying it and dropping the original: with foreign keys on,
                # that drop would cascade (ON DELETE CASCADE) and empty every table that refers to it.
                # SQLite's documented procedure: keys off (outside the transaction), migrate, check.
                _foreign_keys(conn, on=False)
            try:
                with conn.begin():
                    cfg = alembic_config(url if isinstance(url, str) else engine.url)
                    cfg.attributes["connection"] = conn
                    if conn.dialect.name == "postgresql":
                        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK_KEY})")
                    result = fn(cfg, conn)
                    if sqlite:
                        broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                        if broken:
                            raise RuntimeError(f"migration left rows whose foreign keys point nowhere: {broken[:5]}")
                    return result
            finally:
                if sqlite:
                    _foreign_keys(conn, on=True)
    finally:
        if not isinstance(url, Engine):
            engine.dispose()


def _foreign_keys(conn: Connection, *, on: bool) -> None:
    """``PRAGMA foreign_keys`` on the DB-API connection itself: inside a transaction SQLite ignores it."""
    conn.connection.driver_connection.execute(f"PRAGMA foreign_keys={'ON' if on else 'OFF'}")  # type: ignore[union-attr]


def upgrade(url: str | Engine, revision: str = "head") -> None:
    """Migrate the database at ``url`` (or behind ``engine``) to ``revision``; a no-op when already there.

    All pending revisions run in one transaction (DDL is transactional on both backends), so
    a failed migration leaves the schema as it was.
    """
    _run_with_connection(url, lambda cfg, conn: (_check_known(cfg, conn), command.upgrade(cfg, revision)))


def _check_known(cfg: Config, conn: Connection) -> None:
    """A database a newer release migrated (rolled back to this one) is refused in one line; alembic raises
    "Can't locate revision" from deep inside with a traceback."""
    from alembic.script import ScriptDirectory

    current = MigrationContext.configure(conn).get_current_revision()
    script = ScriptDirectory.from_config(cfg)
    if current is not None and current not in {r.revision for r in script.walk_revisions()}:
        raise ValueError(
            f"the database's schema is at {current}, which this release does not know (its newest is "
            f"{script.get_current_head()}): a newer release migrated it. Run that release, or restore the backup "
            'taken before its upgrade (docs/deploy.md, "Upgrade")'
        )


def downgrade(url: str | Engine, revision: str) -> None:
    """Migrate down to ``revision`` (``"base"`` drops every table the migrations created)."""
    _run_with_connection(url, lambda cfg, _conn: command.downgrade(cfg, revision))


def current_revision(url: str | Engine) -> str | None:
    """The revision the database is at, or ``None`` for a database never migrated."""
    engine = url if isinstance(url, Engine) else create_engine_for(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        if not isinstance(url, Engine):
            engine.dispose()


def head_revision() -> str:
    """The newest revision shipped with this package."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations found in {MIGRATIONS_DIR}")
    return head
