"""Errors and small helpers shared by the repository modules."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import numpy as np
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from fedcore.codec import DTYPES, CodecError, EncodedTensor, all_finite, decode, encode

from ..models import Client, Federation, utcnow

_MAX_PAGE = 10_000


# --------------------------------------------------------------------------- errors


class StoreError(Exception):
    """Base class of the store's domain errors (the servicer maps them to gRPC status codes)."""


class NotFound(StoreError, LookupError):
    """A federation, client or round that does not exist (``NOT_FOUND`` / ``FAILED_PRECONDITION``)."""


class FederationExists(StoreError):
    """:func:`create_federation` with a name already taken (``ALREADY_EXISTS``)."""


class RoundStateError(StoreError):
    """The round's state forbids this: closed, abandoned, or another one open (``FAILED_PRECONDITION``)."""


class NotInCohort(StoreError):
    """An update from a client outside the round's cohort (``FAILED_PRECONDITION``)."""


class UpdateConflict(StoreError):
    """Another update of this client for this round, or its ``update_id`` reused for another round
    (``FAILED_PRECONDITION``)."""


# --------------------------------------------------------------------------- helpers

_R = TypeVar("_R", Federation, Client)


def _now(now: datetime | None) -> datetime:
    return utcnow() if now is None else _aware(now, "now")


def _aware(value: datetime, what: str) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{what} must be timezone-aware (e.g. datetime.now(UTC)), got naive {value!r}")
    return value.astimezone(UTC)


def _attached(session: Session, row: _R) -> _R:
    """``row`` as an instance of this session (loaded by primary key when it came from another session)."""
    if row in session:
        return row
    fresh = session.get(type(row), row.id)
    if fresh is None:
        raise NotFound(f"{type(row).__name__} {row.id!r} no longer exists")
    return fresh


def _finite(value: Any, what: str) -> float | None:
    if value is None:
        return None
    f = float(value)
    if not math.isfinite(f):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return f


def _count(value: Any, what: str, minimum: int = 0) -> int:
    try:
        ok = not isinstance(value, bool) and int(value) == value and int(value) >= minimum
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{what} must be an integer ≥ {minimum}, got {value!r}")
    return int(value)


def _json(value: Any, what: str) -> Any:
    """Check now (with a message that names the field) what the JSON columns would refuse at flush."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not standard JSON (no NaN/Inf, no tensors): {exc}") from exc
    return value


def _page(offset: int, limit: int) -> tuple[int, int]:
    if offset < 0 or not 1 <= limit <= _MAX_PAGE:
        raise ValueError(f"offset must be ≥ 0 and limit in [1, {_MAX_PAGE}], got offset={offset}, limit={limit}")
    return offset, limit


def _encode(name: str, array: Any) -> EncodedTensor:
    enc = encode(array, name=name)
    if enc.dtype.startswith("float") and enc.data:
        view = np.frombuffer(enc.data, dtype=DTYPES[enc.dtype])
        if not all_finite(view):
            raise CodecError(name, "contains NaN or Inf values", "nonfinite")
    return enc


def _decode(name: str, dtype: str, shape: Sequence[int], data: bytes) -> np.ndarray:
    return decode(name, dtype, tuple(shape), data, allow_nonfinite=False)


def _upsert(session: Session) -> Any:
    """The dialect's INSERT … ON CONFLICT construct (SQLite ≥ 3.24 and PostgreSQL both have it)."""
    return upsert_for(session.get_bind().dialect.name)


def upsert_for(dialect: str) -> Any:
    if dialect == "postgresql":
        return postgresql.insert
    if dialect == "sqlite":
        return sqlite.insert
    raise NotImplementedError(f"the store supports SQLite and PostgreSQL, not {dialect}")


def prebuilt(build: Callable[[str], Any]) -> Callable[[str], Any]:
    """A statement per dialect, built once and executed with parameters ever after.

    For the statements on every client's critical path (a push, a report): executing the same
    statement object skips building it and adapting its result columns to a new one, which
    costs SQLAlchemy more than the statement costs SQLite.
    """
    return functools.cache(build)
