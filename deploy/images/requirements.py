"""Print the pinned requirements of pyproject.toml, one a line, for an image's dependency layer.

    python3 requirements.py pyproject.toml                       # every dependency
    python3 requirements.py pyproject.toml --exclude torch torchvision
    python3 requirements.py pyproject.toml --only fastapi uvicorn

The pins stay in pyproject.toml alone; the images install them before copying the source, so
a change of source rebuilds only the last layers.
"""

import argparse
import re
import tomllib


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pyproject")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--exclude", nargs="*", default=[])
    args = parser.parse_args()
    with open(args.pyproject, "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    only = None if args.only is None else {n.lower() for n in args.only}
    exclude = {n.lower() for n in args.exclude}
    chosen = [d for d in dependencies if (only is None or _name(d) in only) and _name(d) not in exclude]
    if only is not None and len(chosen) != len(only):
        missing = only - {_name(d) for d in chosen}
        raise SystemExit(f"not in pyproject.toml's dependencies: {', '.join(sorted(missing))}")
    print("\n".join(chosen))


if __name__ == "__main__":
    main()
