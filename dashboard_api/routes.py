"""REST resources under ``/api/v1``: one router per resource, admin actions beside what they change."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, status
from sqlalchemy.orm import Session

from aggregator_service import store

from . import queries
from .deps import AdminAccess, FederationRow, FederationToWrite, ReadAccess, SessionDep, StateDep, WriteSessionDep
from .schemas import (
    Bandwidth,
    ClientDetail,
    ClientOut,
    FederationStateChange,
    FederationSummary,
    Intervals,
    Page,
    Problem,
    RoundDetail,
    RoundOut,
    RoundState,
    TensorRoundOut,
)

__all__ = ["ROUTERS"]

MAX_PAGE = 1000

Offset = Annotated[int, Query(ge=0, le=2**31 - 1, description="items to skip")]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description=f"page size, at most {MAX_PAGE}")]
After = Annotated[int | None, Query(ge=0, le=2**31 - 1, description="only rounds numbered above this")]
RoundNumber = Annotated[int, Path(ge=1, le=2**31 - 1, description="round number (from 1)")]
ClientId = Annotated[
    str, Path(min_length=1, max_length=64, pattern=r"^[0-9A-Za-z_-]+$", description="client id (32 hex digits)")
]

_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": Problem, "description": "no such federation or item"}}
_READ_ERRORS: dict[int | str, dict[str, Any]] = {
    **_NOT_FOUND,
    401: {"model": Problem, "description": "a read token is configured and was not given"},
    503: {"model": Problem, "description": "the database is unreachable or not migrated"},
}
_ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    **_READ_ERRORS,
    401: {"model": Problem, "description": "missing or wrong admin token"},
    409: {"model": Problem, "description": "the federation is done"},
    503: {"model": Problem, "description": "no admin token configured, or the database is unreachable"},
}


def _page(total: int, offset: int, limit: int, items: list[Any]) -> dict[str, Any]:
    return {"total": total, "offset": offset, "limit": limit, "items": items}


# --------------------------------------------------------------------------- federation

federation = APIRouter(prefix="/federation", tags=["federation"], responses=_READ_ERRORS)


@federation.get("", response_model=FederationSummary, dependencies=[ReadAccess])
def get_federation(state: StateDep, session: SessionDep, fed: FederationRow) -> dict[str, Any]:
    """Configuration summary, lifecycle state, current round and how many clients are online."""
    summary = queries.federation_summary(session, fed, state.online_since())
    return {
        **summary,
        "heartbeat_timeout_seconds": state.settings.heartbeat_timeout_seconds,
        "poll_seconds": state.settings.poll_seconds,
    }


def _set_state(session: Session, fed: store.Federation, new: str) -> dict[str, Any]:
    previous = fed.state
    if previous == "done":
        raise HTTPException(status.HTTP_409_CONFLICT, "the federation is done; it cannot be paused or resumed")
    store.set_federation_state(session, fed, new)
    return {"name": fed.name, "state": new, "previous_state": previous}


@federation.post("/pause", response_model=FederationStateChange, dependencies=[AdminAccess], responses=_ADMIN_ERRORS)
def pause(session: WriteSessionDep, fed: FederationToWrite) -> dict[str, Any]:
    """Pause: clients are told to wait and deadlines stop (the aggregator re-reads the state every second)."""
    return _set_state(session, fed, "paused")


@federation.post("/resume", response_model=FederationStateChange, dependencies=[AdminAccess], responses=_ADMIN_ERRORS)
def resume(session: WriteSessionDep, fed: FederationToWrite) -> dict[str, Any]:
    return _set_state(session, fed, "running")


# --------------------------------------------------------------------------- rounds

rounds = APIRouter(prefix="/rounds", tags=["rounds"], responses=_READ_ERRORS, dependencies=[ReadAccess])


@rounds.get("", response_model=Page[RoundOut])
def list_rounds(
    session: SessionDep,
    fed: FederationRow,
    offset: Offset = 0,
    limit: Limit = 100,
    state: Annotated[RoundState | None, Query(description="only rounds in this state")] = None,
    after: After = None,
    order: Annotated[queries.Order, Query(description="by round number")] = "asc",
) -> dict[str, Any]:
    """Rounds with their timings, accuracies, dispersion and bytes; `after` fetches only what is new."""
    total, items = queries.round_page(session, fed.id, queries.RoundFilters(state, after), offset, limit, order)
    return _page(total, offset, limit, items)


def _round_or_404(session: SessionDep, fed: store.Federation, number: int) -> dict[str, Any]:
    detail = queries.round_detail(session, fed.id, number)
    if detail is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"round {number} does not exist (yet) in {fed.name!r}")
    return detail


@rounds.get("/{number}", response_model=RoundDetail)
def get_round(session: SessionDep, fed: FederationRow, number: RoundNumber) -> dict[str, Any]:
    return _round_or_404(session, fed, number)


@rounds.get("/{number}/tensors", response_model=list[TensorRoundOut])
def round_tensors(session: SessionDep, fed: FederationRow, number: RoundNumber) -> list[Any]:
    """Per tensor, in model order: role, interval τ_l, d_l, dispersion, bytes and version (bytes only while open)."""
    _round_or_404(session, fed, number)
    return list(store.round_tensor_metrics(session, fed, number))


# --------------------------------------------------------------------------- clients

clients = APIRouter(prefix="/clients", tags=["clients"], responses=_READ_ERRORS)


@clients.get("", response_model=Page[ClientOut], dependencies=[ReadAccess])
def list_clients(
    state: StateDep,
    session: SessionDep,
    fed: FederationRow,
    offset: Offset = 0,
    limit: Limit = 100,
    status_: Annotated[queries.ClientStatus | None, Query(alias="status", description="filter by presence")] = None,
    tier: Annotated[float | None, Query(gt=0.0, le=1.0, description="only clients of this tier γ")] = None,
) -> dict[str, Any]:
    """Clients in registration order: tier, presence, rounds joined, bytes and last accuracy (never tokens)."""
    total, items = queries.client_page(session, fed.id, state.online_since(), offset, limit, status=status_, tier=tier)
    return _page(total, offset, limit, items)


@clients.get("/{client_id}", response_model=ClientDetail, dependencies=[ReadAccess])
def get_client(state: StateDep, session: SessionDep, fed: FederationRow, client_id: ClientId) -> dict[str, Any]:
    detail = queries.client_detail(session, fed.id, client_id, state.online_since())
    if detail is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no client {client_id!r} in federation {fed.name!r}")
    return detail


@clients.post("/{client_id}/revoke", response_model=ClientOut, dependencies=[AdminAccess], responses=_ADMIN_ERRORS)
def revoke(state: StateDep, session: WriteSessionDep, fed: FederationToWrite, client_id: ClientId) -> dict[str, Any]:
    """Revoke the client's token for good: its next call to the aggregator answers UNAUTHENTICATED."""
    client = store.get_client(session, client_id)
    if client is None or client.federation_id != fed.id:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no client {client_id!r} in federation {fed.name!r}")
    store.revoke_client(session, client_id)
    return queries.client_item(client, state.online_since())


# --------------------------------------------------------------------------- bandwidth and intervals

bandwidth = APIRouter(prefix="/bandwidth", tags=["bandwidth"], responses=_READ_ERRORS, dependencies=[ReadAccess])


@bandwidth.get("", response_model=Bandwidth)
def get_bandwidth(
    session: SessionDep, fed: FederationRow, offset: Offset = 0, limit: Limit = 100, after: After = None
) -> dict[str, Any]:
    """Bytes down/up per closed round and cumulative, against what plain FedAvg would have moved."""
    totals, total, items = queries.bandwidth(session, fed.id, offset, limit, after)
    return {"totals": totals, "rounds": _page(total, offset, limit, items)}


intervals = APIRouter(prefix="/intervals", tags=["intervals"], responses=_READ_ERRORS, dependencies=[ReadAccess])


@intervals.get("", response_model=Intervals)
def get_intervals(
    session: SessionDep,
    fed: FederationRow,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="closed rounds of history, oldest first")] = 200,
    tensor: Annotated[
        str | None, Query(max_length=255, pattern=r"^[0-9A-Za-z_.-]+$", description="only this tensor")
    ] = None,
) -> dict[str, Any]:
    """Each tensor's current interval τ_l and its τ_l, d_l and dispersion history."""
    return queries.intervals(session, fed.id, after, limit, tensor)


ROUTERS = (federation, rounds, clients, bandwidth, intervals)
