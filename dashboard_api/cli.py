"""``fedatoms dashboard serve``: the parser the main CLI mounts, and the command that runs uvicorn."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "serve", "settings_from_args"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``dashboard serve`` to the main CLI's subparsers; returns the ``dashboard`` parser."""
    dashboard = subparsers.add_parser("dashboard", help="serve the web dashboard, REST API and /metrics")
    sub = dashboard.add_subparsers(dest="dashboard_command", required=True)
    serve_p = sub.add_parser(
        "serve", help="serve the dashboard over the aggregator's database (default http://127.0.0.1:8080)"
    )
    serve_p.add_argument("--config", type=Path, help="the aggregator's TOML file (shared keys, and [dashboard])")
    serve_p.add_argument("--database-url", help="database URL [FEDATOMS_DATABASE_URL, else sqlite:///fedatoms.db]")
    serve_p.add_argument("--listen", help="HOST:PORT [127.0.0.1:8080]")
    serve_p.add_argument("--federation-name", help="which federation in the database [default]")
    serve_p.set_defaults(func=serve)
    return dashboard


def settings_from_args(args: argparse.Namespace) -> Any:
    from .settings import DashboardSettings

    overrides = {
        "database_url": getattr(args, "database_url", None),
        "listen": getattr(args, "listen", None),
        "federation_name": getattr(args, "federation_name", None),
    }
    if getattr(args, "config", None) is not None:
        return DashboardSettings.from_toml(args.config, **overrides)
    return DashboardSettings(**{k: v for k, v in overrides.items() if v is not None})


def serve(args: argparse.Namespace) -> int:
    import socket
    import sys

    import uvicorn
    from pydantic import ValidationError

    from aggregator_service.environment import describe
    from aggregator_service.toml_settings import explain

    from .app import create_app
    from .settings import unread_environment

    for found in unread_environment():
        print(f"warning: {describe(found)}", file=sys.stderr, flush=True)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        raise ValueError(f"invalid dashboard settings: {explain(exc)}") from exc
    host, port = settings.host_port
    # bound here, so the banner names the port port 0 got; a port taken or refused is one line
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {settings.listen}: {exc.strerror or exc}") from exc
    sock.listen(2048)  # connections wait from here: the banner's address answers once printed
    port = sock.getsockname()[1]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"fedatoms dashboard: http://{shown}:{port}/ over {_redacted(settings.database_url)}", flush=True)
    if settings.admin_token is None:
        print("admin endpoints disabled (no admin_token): pause, resume and revoke answer 503", flush=True)
    uvicorn.Server(uvicorn.Config(create_app(settings), log_level="info")).run(sockets=[sock])
    return 0


def _redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
