"""Global tensors (value, version, interval) and strategy tensors such as SCAFFOLD's server control."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from ..models import Federation, GlobalTensor, StrategyTensor
from ._common import _count, _decode, _encode

__all__ = [
    "SERVER_CONTROL",
    "load_global_tensors",
    "load_strategy_tensors",
    "save_global_tensors",
    "save_strategy_tensors",
    "tensor_intervals",
    "tensor_versions",
]

SERVER_CONTROL = "server_control"


# --------------------------------------------------------------------------- global and strategy tensors


def save_global_tensors(session: Session, fed: Federation, tensors: Mapping[str, tuple[Any, int, int]]) -> None:
    """Insert or replace global tensors: name → (array, version, interval). Old blobs are never loaded."""
    encoded = {}
    for name, (array, version, interval) in tensors.items():
        encoded[name] = (_encode(name, array), _count(version, f"version of {name!r}"), _count(interval, "interval", 1))
    if not encoded:
        return
    existing = {
        row.name: row
        for row in session.scalars(
            select(GlobalTensor).where(GlobalTensor.federation_id == fed.id, GlobalTensor.name.in_(list(encoded)))
        )
    }
    for name, (enc, version, interval) in encoded.items():
        row = existing.get(name)
        if row is None:
            row = GlobalTensor(federation_id=fed.id, name=name)
            session.add(row)
        row.version, row.interval = version, interval
        row.dtype, row.shape, row.data = enc.dtype, list(enc.shape), enc.data
    session.flush()


def load_global_tensors(
    session: Session, fed: Federation, names: Iterable[str] | None = None
) -> dict[str, tuple[np.ndarray, int, int]]:
    """name → (array, version, interval), all of them or only ``names`` (unknown names are left out)."""
    q = select(
        GlobalTensor.name,
        GlobalTensor.dtype,
        GlobalTensor.shape,
        GlobalTensor.data,
        GlobalTensor.version,
        GlobalTensor.interval,
    ).where(GlobalTensor.federation_id == fed.id)
    if names is not None:
        q = q.where(GlobalTensor.name.in_(list(names)))
    out = {}
    for name, dtype, shape, data, version, interval in session.execute(q.order_by(GlobalTensor.name)):
        out[name] = (_decode(name, dtype, shape, data), version, interval)
    return out


def tensor_versions(session: Session, fed: Federation) -> dict[str, int]:
    rows = session.execute(select(GlobalTensor.name, GlobalTensor.version).where(GlobalTensor.federation_id == fed.id))
    return {name: version for name, version in rows}


def tensor_intervals(session: Session, fed: Federation) -> dict[str, int]:
    rows = session.execute(select(GlobalTensor.name, GlobalTensor.interval).where(GlobalTensor.federation_id == fed.id))
    return {name: interval for name, interval in rows}


def _set_intervals(session: Session, fed: Federation, intervals: Mapping[str, int]) -> None:
    for name, interval in intervals.items():
        session.execute(
            update(GlobalTensor)
            .where(GlobalTensor.federation_id == fed.id, GlobalTensor.name == name)
            .values(interval=interval)
        )


def save_strategy_tensors(
    session: Session, fed: Federation, tensors: Mapping[str, Any], kind: str = SERVER_CONTROL
) -> None:
    """Insert or replace strategy tensors of one ``kind`` (others of that kind are kept)."""
    encoded = {name: _encode(name, array) for name, array in tensors.items()}
    if not encoded:
        return
    existing = {
        row.name: row
        for row in session.scalars(
            select(StrategyTensor).where(
                StrategyTensor.federation_id == fed.id,
                StrategyTensor.kind == kind,
                StrategyTensor.name.in_(list(encoded)),
            )
        )
    }
    for name, enc in encoded.items():
        row = existing.get(name)
        if row is None:
            row = StrategyTensor(federation_id=fed.id, kind=kind, name=name)
            session.add(row)
        row.dtype, row.shape, row.data = enc.dtype, list(enc.shape), enc.data
    session.flush()


def load_strategy_tensors(session: Session, fed: Federation, kind: str = SERVER_CONTROL) -> dict[str, np.ndarray]:
    rows = session.execute(
        select(StrategyTensor.name, StrategyTensor.dtype, StrategyTensor.shape, StrategyTensor.data)
        .where(StrategyTensor.federation_id == fed.id, StrategyTensor.kind == kind)
        .order_by(StrategyTensor.name)
    )
    return {name: _decode(name, dtype, shape, data) for name, dtype, shape, data in rows}
