"""Request dependencies: a read (or, for admin actions, a write) session per request, the federation, and the
bearer tokens."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from aggregator_service import store

from .settings import DashboardSettings

__all__ = [
    "AdminAccess",
    "DashboardState",
    "FederationRow",
    "FederationToWrite",
    "KnownParameters",
    "ReadAccess",
    "SessionDep",
    "StateDep",
    "WriteSessionDep",
]

_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <token>` (see docs/dashboard.md)")
_REALM = 'Bearer realm="fedatoms-dashboard"'


@dataclass
class DashboardState:
    """What one app holds: its settings, its engine, and the sessions it reads and writes with (writes go
    through the store)."""

    settings: DashboardSettings
    engine: Engine
    factory: sessionmaker[Session]
    #: an admin action's sessions. On SQLite they begin IMMEDIATE: a read transaction that then writes fails at
    #: once (SQLITE_BUSY_SNAPSHOT, no busy wait) when the aggregator committed in between, as it does every round
    writer: sessionmaker[Session]

    def online_since(self) -> datetime:
        return store.utcnow() - timedelta(seconds=self.settings.heartbeat_timeout_seconds)


def get_state(request: Request) -> DashboardState:
    state: DashboardState = request.app.state.dashboard
    return state


StateDep = Annotated[DashboardState, Depends(get_state)]


def get_session(state: StateDep) -> Iterator[Session]:
    with state.factory.begin() as session:
        yield session


def get_write_session(state: StateDep) -> Iterator[Session]:
    with state.writer.begin() as session:
        yield session


# scope="function": the transaction ends before the response leaves; for a write, a client that saw
# "paused" or "revoked" can rely on the aggregator reading it from the database
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
WriteSessionDep = Annotated[Session, Depends(get_write_session, scope="function")]


def get_federation(state: StateDep, session: SessionDep) -> store.Federation:
    fed = store.get_federation(session, state.settings.federation_name)
    if fed is None:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"no federation {state.settings.federation_name!r} in the database yet: start the aggregator "
            "(fedatoms aggregator serve) with this database_url and federation_name",
        )
    return fed


FederationRow = Annotated[store.Federation, Depends(get_federation)]


def get_federation_to_write(state: StateDep, session: WriteSessionDep) -> store.Federation:
    return get_federation(state, session)


#: the federation, read in the admin action's own write transaction
FederationToWrite = Annotated[store.Federation, Depends(get_federation_to_write)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _matches(credentials: HTTPAuthorizationCredentials | None, *tokens: SecretStr | None) -> bool:
    if credentials is None:
        return False
    given = credentials.credentials.encode()
    return any(t is not None and hmac.compare_digest(given, t.get_secret_value().encode()) for t in tokens)


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": _REALM})


def require_read(state: StateDep, credentials: Credentials) -> None:
    """Reads are open unless a read token is configured; the admin token reads too."""
    s = state.settings
    if s.read_token is None or _matches(credentials, s.read_token, s.admin_token):
        return
    what = "missing" if credentials is None else "wrong"
    raise _unauthorized(f"{what} bearer token: reads need `Authorization: Bearer <read_token>`")


def require_admin(state: StateDep, credentials: Credentials) -> None:
    if state.settings.admin_token is None:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            "admin endpoints are disabled: set admin_token ([dashboard] in the TOML file or "
            "FEDATOMS_DASHBOARD_ADMIN_TOKEN) and restart the dashboard",
        )
    if not _matches(credentials, state.settings.admin_token):
        what = "missing" if credentials is None else "wrong"
        raise _unauthorized(f"{what} admin token: send `Authorization: Bearer <admin_token>`")


ReadAccess = Depends(require_read)
AdminAccess = Depends(require_admin)


def only_known_parameters(request: Request, _read: None = ReadAccess) -> None:
    """422 for a query parameter the endpoint does not take, or one given twice: FastAPI would ignore the first and
    let the last win, so a typo (``limt``) or a parameter of another endpoint (``offset`` on ``/intervals``) would
    answer as if it were not there. The body is FastAPI's 422 list, one entry per parameter; a caller the read
    token refuses gets its 401 first."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    takes = _query_names(route.dependant)
    given = request.query_params
    what = ", ".join(sorted(takes)) if takes else "none"
    errors = [
        {
            "type": "extra_forbidden",
            "loc": ("query", k[:64]),
            "msg": f"unknown query parameter: {request.url.path} takes {what}",
            "input": given[k],
        }
        for k in sorted(set(given) - takes)[:5]
    ] + [
        {"type": "repeated", "loc": ("query", k[:64]), "msg": "given more than once", "input": given.getlist(k)}
        for k in sorted(set(given) & takes)
        if len(given.getlist(k)) > 1
    ]
    if errors:
        raise RequestValidationError(errors)


def _query_names(dependant: Dependant) -> set[str]:
    """The query parameters a route takes, its dependencies' included."""
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


#: on every API route and /metrics
KnownParameters = Depends(only_known_parameters)
