"""`fedatoms aggregator`: serve a federation, and administer its clients and models while it runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["DB_HELP", "add_parser", "database_url", "warn_unread_environment"]

DB_HELP = "database URL [FEDATOMS_DATABASE_URL, else sqlite:///fedatoms.db]"


def _settings(args: argparse.Namespace) -> Any:
    from aggregator_service.config import AggregatorSettings

    overrides = {
        "listen": getattr(args, "listen", None),
        "database_url": args.database_url,
        "log_format": getattr(args, "log_format", None),
    }
    if getattr(args, "config", None) is not None:
        return AggregatorSettings.from_toml(args.config, **overrides)
    return AggregatorSettings(**{k: v for k, v in overrides.items() if v is not None})


def _store_target(args: argparse.Namespace) -> Any:
    """The database and federation of ``--database-url``, else the environment's, else ``--config``'s, else the
    defaults: only those two keys are read, so the server's file works on another machine."""
    from pydantic import ValidationError

    from aggregator_service.config import StoreTarget
    from aggregator_service.toml_settings import explain

    warn_unread_environment()
    try:
        if getattr(args, "config", None) is not None:
            return StoreTarget.from_toml(args.config, database_url=args.database_url)
        return StoreTarget(**({} if args.database_url is None else {"database_url": args.database_url}))
    except ValidationError as exc:
        raise ValueError(f"invalid settings: {explain(exc)}") from exc


def warn_unread_environment() -> None:
    """On stderr, each aggregator ``FEDATOMS_*`` variable nothing reads (:mod:`aggregator_service.environment`)."""
    import sys

    from aggregator_service.config import unread_environment
    from aggregator_service.environment import describe

    for found in unread_environment():
        print(f"warning: {describe(found)}", file=sys.stderr)


def database_url(args: argparse.Namespace) -> str:
    """The database of ``--database-url``, else of the environment, else of ``--config``, else the default."""
    return str(_store_target(args).database_url)


def cmd_aggregator_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from aggregator_service.server import serve
    from aggregator_service.toml_settings import explain

    try:
        settings = _settings(args)
    except ValidationError as exc:
        raise ValueError(f"invalid aggregator settings: {explain(exc)}") from exc
    return serve(settings)


def cmd_aggregator_revoke(args: argparse.Namespace) -> int:
    from aggregator_service.export import revoke

    revoke(database_url(args), args.client)
    print(f"client {args.client} revoked: its next call answers UNAUTHENTICATED")
    return 0


def cmd_aggregator_rebind(args: argparse.Namespace) -> int:
    from aggregator_service.export import rebind_certificate

    digest = rebind_certificate(database_url(args), args.client, args.client_cert)
    print(f"client {args.client} bound to certificate sha256 {digest}: other certificates get PERMISSION_DENIED")
    return 0


def cmd_aggregator_export(args: argparse.Namespace) -> int:
    from aggregator_service.export import export_global_model

    target = _store_target(args)
    path, round_ = export_global_model(
        target.database_url, args.round, args.output, target.federation_name, tier=args.tier
    )
    what = "global model" if args.tier is None or args.tier == 1.0 else f"tier {args.tier:g} model"
    print(f"{what} after round {round_} written to {path}")
    return 0


def _tier(text: str) -> float:
    """A tier as written elsewhere: ``0.25`` or ``1/4``; a fraction of the model in (0, 1]."""
    try:
        num, _, den = text.partition("/")
        tier = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a tier (write 0.25 or 1/4)") from None
    if not 0.0 < tier <= 1.0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r} is not a tier: a tier is a fraction of the model in (0, 1]")
    return tier


def add_parser(sub: Any) -> None:
    agg = sub.add_parser("aggregator", help="run and administer the gRPC aggregator")
    agg_sub = agg.add_subparsers(dest="aggregator_command", required=True)

    serve = agg_sub.add_parser("serve", help="serve a federation over gRPC (defaults: 127.0.0.1:50051, a demo)")
    serve.add_argument("--config", type=Path, help="TOML file: service keys, and the method under [federation]")
    serve.add_argument("--listen", help="HOST:PORT to listen on [127.0.0.1:50051]")
    serve.add_argument("--database-url", help=DB_HELP)
    serve.add_argument("--log-format", choices=("logfmt", "json"), help="log lines as logfmt or JSON [logfmt]")
    serve.set_defaults(func=cmd_aggregator_serve)

    revoke = agg_sub.add_parser("revoke", help="revoke a client's token (works while the server runs)")
    revoke.add_argument("client", help="client id, as shown in the server log and the dashboard")
    revoke.add_argument("--config", type=Path, help="the server's TOML file (only its database_url, federation_name)")
    revoke.add_argument("--database-url", help=DB_HELP)
    revoke.set_defaults(func=cmd_aggregator_revoke)

    rebind = agg_sub.add_parser(
        "rebind", help="mutual TLS: bind a client's token to its renewed certificate (works while the server runs)"
    )
    rebind.add_argument("client", help="client id, as shown in the server log and the dashboard")
    rebind.add_argument("--client-cert", type=Path, required=True, help="the client's new certificate (PEM)")
    rebind.add_argument("--config", type=Path, help="the server's TOML file (only its database_url, federation_name)")
    rebind.add_argument("--database-url", help=DB_HELP)
    rebind.set_defaults(func=cmd_aggregator_rebind)

    export = agg_sub.add_parser("export", help="write the global model of the last closed round as safetensors")
    export.add_argument(
        "--round", type=int, help="the last closed round, checked (the model it produced) [the last closed round]"
    )
    export.add_argument("output", help="OUT.safetensors")
    export.add_argument(
        "--tier",
        type=_tier,
        metavar="GAMMA",
        help="the model a client of this tier runs (the global model cut to its rank), e.g. 0.25 [1: the global model]",
    )
    export.add_argument("--config", type=Path, help="the server's TOML file (only its database_url, federation_name)")
    export.add_argument("--database-url", help=DB_HELP)
    export.set_defaults(func=cmd_aggregator_export)
