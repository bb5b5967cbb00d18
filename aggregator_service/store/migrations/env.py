"""Alembic environment, configured in code.

:func:`aggregator_service.store.upgrade` passes an open connection in
``config.attributes["connection"]``; the ``alembic`` command line (maintainers, see the
store's README.md) passes ``sqlalchemy.url`` instead, or ``FEDATOMS_DATABASE_URL`` is used.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy.engine import Connection

from aggregator_service.store.engine import create_engine_for
from aggregator_service.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("FEDATOMS_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: set sqlalchemy.url or FEDATOMS_DATABASE_URL")
    return url


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    url = _url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    engine = create_engine_for(_url())
    try:
        with engine.begin() as conn:
            _configure(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
