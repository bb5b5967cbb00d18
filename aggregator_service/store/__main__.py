"""Maintainer commands for the store's migrations, without an alembic.ini.

    python -m aggregator_service.store upgrade  [--url URL] [--revision head]
    python -m aggregator_service.store current  [--url URL]
    python -m aggregator_service.store revision -m "add x" [--autogenerate] [--url URL]

``--url`` defaults to ``FEDATOMS_DATABASE_URL``, else ``sqlite:///fedatoms.db``. ``revision
--autogenerate`` without ``--url`` diffs the models against a scratch SQLite database
migrated to head, so it never touches a real one; review what it writes (autogenerate
misses CHECK constraints and renders the store's column types by their Python names:
replace ``JSONText`` with ``sa.Text()`` and ``UTCDateTime`` with ``sa.DateTime(timezone=True)``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from .engine import alembic_config, create_engine_for, current_revision, upgrade


def _next_rev_id(message: str) -> str:
    script = ScriptDirectory.from_config(alembic_config())
    numbers = [int(m.group(1)) for rev in script.walk_revisions() if (m := re.match(r"(\d+)_", rev.revision))]
    slug = re.sub(r"[^a-z0-9]+", "_", message.lower()).strip("_")[:40] or "revision"
    return f"{max(numbers, default=0) + 1:04d}_{slug}"


def _with_ruff(cfg: Config) -> Config:
    """Format new revision files with ruff when it is installed (next to this Python, or on PATH)."""
    ruff = Path(sys.executable).with_name("ruff")
    executable = str(ruff) if ruff.exists() else shutil.which("ruff")
    if executable:
        cfg.set_section_option("post_write_hooks", "hooks", "ruff")
        cfg.set_section_option("post_write_hooks", "ruff.type", "exec")
        cfg.set_section_option("post_write_hooks", "ruff.executable", executable)
        cfg.set_section_option("post_write_hooks", "ruff.options", "format REVISION_SCRIPT_FILENAME")
    return cfg


def _revision(message: str, autogenerate: bool, url: str | None) -> None:
    rev_id = _next_rev_id(message)
    if not autogenerate:
        command.revision(_with_ruff(alembic_config()), message=message, rev_id=rev_id)
        return
    with tempfile.TemporaryDirectory() as tmp:
        target = url or f"sqlite:///{Path(tmp) / 'scratch.db'}"
        upgrade(target)
        engine = create_engine_for(target)
        try:
            with engine.begin() as conn:
                cfg = _with_ruff(alembic_config(target))
                cfg.attributes["connection"] = conn
                command.revision(cfg, message=message, rev_id=rev_id, autogenerate=True)
        finally:
            engine.dispose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m aggregator_service.store", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upgrade", help="migrate a database to a revision (default: head)")
    up.add_argument("--url")
    up.add_argument("--revision", default="head")
    cur = sub.add_parser("current", help="print the revision a database is at")
    cur.add_argument("--url")
    rev = sub.add_parser("revision", help="write a new migration file in migrations/versions/")
    rev.add_argument("-m", "--message", required=True)
    rev.add_argument("--autogenerate", action="store_true")
    rev.add_argument("--url", help="database to diff against (default: a scratch SQLite at head)")
    args = parser.parse_args(argv)

    if args.command != "revision":
        from aggregator_service.config import unread_environment
        from aggregator_service.environment import describe

        for found in unread_environment():
            print(f"warning: {describe(found)}", file=sys.stderr)
    default_url = os.environ.get("FEDATOMS_DATABASE_URL", "sqlite:///fedatoms.db")
    if args.command == "upgrade":
        upgrade(args.url or default_url, args.revision)
        print(f"at revision {current_revision(args.url or default_url)}")
    elif args.command == "current":
        print(current_revision(args.url or default_url) or "(empty database)")
    else:
        _revision(args.message, args.autogenerate, args.url)


if __name__ == "__main__":
    main()
