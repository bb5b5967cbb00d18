"""The one `fedatoms` command, one module per command group.

Each group's module adds its subcommands to the parser; what a subcommand runs (a server, a
client, a training loop) is imported only when that subcommand runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fedatoms.cli import aggregator, analyze, client, db, demo, predict, simulate
from fedatoms.cli.simulate import user_message

__all__ = ["build_parser", "main", "user_message"]


def build_parser() -> argparse.ArgumentParser:
    from dashboard_api.cli import add_parser as add_dashboard

    parser = argparse.ArgumentParser(
        prog="fedatoms",
        description="Federated learning with filter atoms, FedHM low-rank tiers and FedLAMA intervals.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    simulate.add_parser(sub)
    demo.add_parser(sub)
    analyze.add_parser(sub)
    aggregator.add_parser(sub)
    db.add_parser(sub)
    client.add_parser(sub)
    predict.add_parser(sub)
    add_dashboard(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"fedatoms: error: {user_message(exc)}", file=sys.stderr)
        return 2
