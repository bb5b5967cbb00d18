"""`fedatoms db`: maintenance of the aggregator's database, found as the aggregator finds it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fedatoms.cli.aggregator import DB_HELP, database_url

__all__ = ["add_parser"]


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import InterfaceError, OperationalError

    from aggregator_service import store
    from aggregator_service.database_url import shown, unreadable

    url = database_url(args)
    try:
        store.upgrade(url)
    except (OperationalError, InterfaceError) as exc:
        raise unreadable(url, exc) from exc
    print(f"{shown(url)}: schema at {store.head_revision()}")
    return 0


def add_parser(sub: Any) -> None:
    db = sub.add_parser("db", help="database maintenance")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_sub.add_parser("upgrade", help="migrate the database to the newest schema")
    upgrade.add_argument("--config", type=Path, help="the server's TOML file (for its database_url)")
    upgrade.add_argument("--database-url", help=DB_HELP)
    upgrade.set_defaults(func=cmd_db_upgrade)
