"""``python -m dashboard_api serve …``: the dashboard alone, as ``fedatoms dashboard serve …``.

The full ``fedatoms`` command mounts the simulator's flags, and torch with them; this entry mounts
only the dashboard's parser, so a host or image without torch serves the dashboard.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dashboard_api.cli import add_parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboard_api")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["dashboard", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
