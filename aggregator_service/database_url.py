"""A database URL checked before anything connects, for every command and settings class that takes one.

Its own module, on SQLAlchemy's URL parser alone: the dashboard (which never trains) and the
command line's parser validate a URL without importing the federation's configuration, torch,
or the store.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

__all__ = ["DatabaseURL", "check_url", "driver_says", "shown", "unreadable"]


def check_url(url: str) -> URL:
    """``url`` parsed, for a backend the store runs on; a mistyped one is a one-line ``ValueError`` naming it
    (its password hidden), where SQLAlchemy would raise from deep inside the first connection."""
    try:
        u = make_url(url)
    except ArgumentError:
        raise ValueError(
            f"{shown(url)!r} is not a database URL (e.g. sqlite:///fedatoms.db or postgresql+psycopg://user@host:5432/db)"
        ) from None
    backend, driver = u.get_backend_name(), u.drivername.partition("+")[2]
    if backend == "postgres":  # Heroku's and libpq's spelling, which SQLAlchemy does not take
        raise ValueError(f"{shown(url)}: write postgresql+psycopg:// (SQLAlchemy's name), not postgres://")
    if backend not in ("sqlite", "postgresql"):
        raise ValueError(f"{shown(url)}: the store runs on sqlite or postgresql, not {backend!r}")
    if driver in ("asyncpg", "aiosqlite", "pysqlite_async"):
        raise ValueError(f"{shown(url)}: {driver} is an asyncio driver; the store needs a blocking one (e.g. psycopg)")
    return u


def shown(url: str) -> str:
    """``url`` as a message may print it: its password hidden, even where the URL does not parse (then
    everything from the first ``:`` after the user's name to the last ``@`` is)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return re.sub(r"(//[^:/@]*|^[^:/@]*):.*@", r"\1:***@", url)


def unreadable(url: str, exc: BaseException) -> ValueError:
    """A database the command cannot reach or read (no server, a missing database, refused credentials), in one
    line: the driver's first line, the URL with its password hidden."""
    return ValueError(f"cannot read the database {shown(url)}: {driver_says(exc)}")


def driver_says(exc: BaseException) -> str:
    """The first line of the driver's own message: SQLAlchemy's text adds the statement and its parameters, which
    a log repeating them on every failed read buries the cause under."""
    return (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0]


def _database_url(value: str) -> str:
    check_url(value)
    return value


#: a database URL the store can open (:func:`check_url`): a typo fails at start, in one line
DatabaseURL = Annotated[str, AfterValidator(_database_url)]
