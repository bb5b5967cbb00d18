"""The dashboard app: REST under ``/api/v1``, Prometheus ``/metrics``, health probes and the page at ``/``.

Built by :func:`create_app` from one :class:`DashboardSettings`; nothing is read from globals,
so tests and benchmarks run several apps side by side, each on its own database.
"""

from __future__ import annotations

import html
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.resources import files
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request, Response, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import Engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import ASGIApp, Receive, Scope, Send

from aggregator_service import store
from aggregator_service.database_url import driver_says

from . import queries
from .deps import DashboardState, KnownParameters, ReadAccess, StateDep
from .metrics import build_registry
from .routes import ROUTERS
from .schemas import Health, Readiness
from .settings import DEFAULT_DATABASE_TIMEOUT, DashboardSettings

__all__ = ["create_app", "create_engine"]

log = logging.getLogger(__name__)
API_PREFIX = "/api/v1"
#: the most of a rejected value a 422 quotes back
ECHOED = 200
#: the most of the driver's message a 503 quotes (``database is locked``, ``connection timeout expired``)
SAID = 200
#: paths that probes and uptime checks (``curl -I``, load balancers) may ask with HEAD
PROBED = frozenset({"/healthz", "/readyz", "/metrics", "/"})
STATIC = files("dashboard_api") / "static"
SWAGGER_UI_URL = "/static/vendor/swagger-ui"  # Swagger UI, vendored (README.md there): /docs works offline


#: how long an admin action waits for the aggregator's locks: SQLite's busy timeout, PostgreSQL's lock and statement
#: timeouts (a pause waits out a round's close instead of failing)
WRITE_WAIT_SECONDS = 30.0


def create_engine(database_url: str, timeout_seconds: float = DEFAULT_DATABASE_TIMEOUT) -> Engine:
    """A read-mostly engine: SQLite transactions start DEFERRED so reads never queue behind the aggregator. A SQLite
    file is opened only if it exists (``mode=rw``): the aggregator creates and migrates it, and a mistyped path
    would otherwise leave an empty database behind.

    Every wait is bounded by ``timeout_seconds`` (:func:`database_timeouts`), and so is a checkout from the pool:
    a database that does not answer makes a request fail (503, ``fedatoms_database_up 0``) instead of hang."""
    url = make_url(database_url)
    kwargs: dict[str, Any] = database_timeouts(url, timeout_seconds)
    if not (url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")):
        kwargs.update(pool_size=10, max_overflow=40, pool_timeout=timeout_seconds)
    path = sqlite_file(url)
    if path is not None:
        url = url.set(database=f"file:{quote(str(path))}", query={**url.query, "mode": "rw", "uri": "true"})
    return store.create_engine_for(url, sqlite_begin="DEFERRED", **kwargs)


def database_timeouts(url: URL, seconds: float) -> dict[str, Any]:
    """:func:`store.create_engine_for` arguments that bound how long one wait for the database lasts: SQLite's busy
    timeout; for PostgreSQL (libpq drivers) the connection attempt (``connect_timeout``, whole seconds, at least 2 as
    libpq counts them) and each statement and lock wait (``statement_timeout``, ``lock_timeout``). What the URL
    itself sets wins (its ``connect_timeout``, its ``options`` after these)."""
    ms = max(1, round(seconds * 1000))
    if url.get_backend_name() == "sqlite":
        return {"sqlite_busy_timeout_ms": ms}
    if url.get_driver_name() not in ("psycopg", "psycopg2"):
        return {}
    given = url.query.get("options") or ()
    ours = f"-c statement_timeout={ms} -c lock_timeout={ms}"
    options = " ".join([ours, *([given] if isinstance(given, str) else given)])
    connect_args: dict[str, Any] = {"options": options}
    if "connect_timeout" not in url.query:
        connect_args["connect_timeout"] = max(2, math.ceil(seconds))
    return {"connect_args": connect_args}


def writer_engine(engine: Engine) -> Engine | None:
    """An engine for the admin actions, whose waits for the aggregator last up to :data:`WRITE_WAIT_SECONDS` (the
    reader's are bounded for the probes and scrapes). For a SQLite file its transactions begin IMMEDIATE: they take
    the write lock before they read, so they wait for the aggregator's commit (busy_timeout) instead of failing on
    a snapshot it made stale. ``None``: the reader serves (a memory database only it can reach)."""
    if engine.dialect.name != "sqlite":
        return store.create_engine_for(engine.url, pool_size=2, **database_timeouts(engine.url, WRITE_WAIT_SECONDS))
    if engine.url.database in (None, "", ":memory:"):
        return None
    return store.create_engine_for(
        engine.url,
        sqlite_begin="IMMEDIATE",
        sqlite_checkpoint="commit",
        pool_size=2,
        **database_timeouts(engine.url, WRITE_WAIT_SECONDS),
    )


def sqlite_file(url: str | URL) -> Path | None:
    """The file a SQLite URL names, absolute (``None``: another backend, memory, or already a URI filename)."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:") or u.query.get("uri"):
        return None
    return Path(u.database).resolve()  # type: ignore[arg-type]  # a str here


def _openapi(app: FastAPI, *, reads_open: bool) -> dict[str, Any]:
    """FastAPI's schema, saying that reads need no token when no read token is configured."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for methods in schema.get("paths", {}).values():
            read = methods.get("get", {})
            if reads_open and "security" in read:
                read["security"] = [{}, *read["security"]]  # {}: the bearer token is optional
        app.openapi_schema = schema
    return app.openapi_schema


class HeadAsGet:
    """HEAD on a :data:`PROBED` path is answered as GET (the server sends no body for HEAD): routes declared once,
    for GET, so the OpenAPI schema keeps one operation each."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD" and scope["path"] in PROBED:
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


def create_app(settings: DashboardSettings | None = None, *, engine: Engine | None = None) -> FastAPI:
    """An app over ``settings.database_url`` (or ``engine``); the engine is disposed on shutdown if created here."""
    settings = settings or DashboardSettings()
    owned = engine is None
    engine = engine or create_engine(settings.database_url, settings.database_timeout_seconds)
    writer = writer_engine(engine)
    state = DashboardState(
        settings, engine, store.session_factory(engine), store.session_factory(engine if writer is None else writer)
    )
    registry = build_registry(state.factory, settings.federation_name, state.online_since)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if writer is not None:
            writer.dispose()
        if owned:
            engine.dispose()

    app = FastAPI(
        title="fedatoms dashboard",
        version="1",
        description="Rounds, variance, bandwidth, clients and intervals of one federation, read from the "
        "aggregator's database; pause, resume and revoke with the admin token.",
        lifespan=lifespan,
        docs_url=None,  # served below from vendored files: FastAPI's own page loads Swagger UI from a CDN
        redoc_url=None,
    )
    app.state.dashboard = state
    app.add_middleware(HeadAsGet)
    app.openapi = lambda: _openapi(app, reads_open=settings.read_token is None)  # type: ignore[method-assign]
    for router in ROUTERS:
        app.include_router(router, prefix=API_PREFIX, dependencies=[KnownParameters])

    database_file = sqlite_file(settings.database_url)

    def unavailable(exc: SQLAlchemyError, *, where: bool = True) -> str:
        """Why the database cannot be read; ``where``: name the file (not to the probes, which need no token)."""
        if database_file is not None and not database_file.exists():
            named = f"the database file {database_file}" if where else "the database file"
            return (
                f"{named} does not exist: start the aggregator (fedatoms aggregator serve) with this database_url, "
                "which creates and migrates it, or correct database_url"
            )
        # the driver's words say the cause (``database is locked``, a timeout); the probes keep to the type, as they
        # name no file either: a libpq message names the host and the user
        said = f"{type(exc).__name__}: {driver_says(exc)[:SAID]}" if where else type(exc).__name__
        return (
            f"the database is unavailable or not migrated ({said}); check database_url "
            "and that the aggregator has started (it migrates the schema)"
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's 422, with each offending input cut to :data:`ECHOED` characters: a 100,000-character value
        came back whole."""
        errors = [
            {**e, "input": e["input"][:ECHOED] + "…"}
            if isinstance(e.get("input"), str) and len(e["input"]) > ECHOED
            else e
            for e in exc.errors()
        ]
        return JSONResponse({"detail": jsonable_encoder(errors)}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)

    @app.exception_handler(SQLAlchemyError)
    async def database_unavailable(_request: Request, exc: SQLAlchemyError) -> JSONResponse:
        log.warning("database error: %s", driver_says(exc))
        return JSONResponse({"detail": unavailable(exc)}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE)

    # async: answered on the event loop, never queued behind reads that fill the worker threads while the
    # database is slow (liveness must not depend on it)
    @app.get("/healthz", response_model=Health, tags=["health"])
    async def healthz() -> dict[str, str]:
        """The process serves requests (liveness)."""
        return {"status": "ok"}

    @app.get(
        "/readyz",
        response_model=Readiness,
        tags=["health"],
        responses={503: {"model": Readiness, "description": "the database is unreachable or not migrated"}},
    )
    def readyz(state: StateDep, response: Response) -> dict[str, Any]:
        """The database answers and holds the store's tables (readiness)."""
        backend = state.engine.dialect.name
        try:
            with state.factory.begin() as session:
                queries.database_ok(session)
        except SQLAlchemyError as exc:
            response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
            return {"status": "unavailable", "database": backend, "detail": unavailable(exc, where=False)}
        return {"status": "ready", "database": backend}

    @app.get(
        "/metrics",
        tags=["metrics"],
        dependencies=[ReadAccess, KnownParameters],
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}},
    )
    def metrics() -> Response:
        """Prometheus text format, read from the database at scrape time."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    page = (
        (STATIC / "index.html").read_text().replace("{{POLL_MS}}", html.escape(str(int(settings.poll_seconds * 1000))))
    )

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:  # no database: on the event loop, as /healthz
        return HTMLResponse(page)

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    def docs() -> HTMLResponse:
        """The OpenAPI page, Swagger UI from local files: it works offline."""
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} — API",
            swagger_js_url=f"{SWAGGER_UI_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{SWAGGER_UI_URL}/swagger-ui.css",
            swagger_favicon_url=f"{SWAGGER_UI_URL}/favicon-32x32.png",
        )

    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")
    return app
