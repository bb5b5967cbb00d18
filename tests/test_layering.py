"""The packages import downward only, without cycles, and no private name crosses a package.

The oracle is the table of arrows in docs/architecture.md, written here by hand: the import
graph is read from the source with ``ast`` (lazy imports inside functions included), so a
new upward import, a cycle between modules or a ``from other_package import _private``
fails this test before a reader meets it. The command line's parser, which every ``fedatoms``
process builds, imports none of the heavy layers its other commands need.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Each package and the packages it may import (besides itself), bottom to top.
ALLOWED: dict[str, set[str]] = {
    "fedcore": set(),
    "fedwire": {"fedcore"},
    "aggregator_service": {"fedcore", "fedwire"},
    "client_agent": {"fedcore", "fedwire"},
    "dashboard_api": {"fedcore", "fedwire", "aggregator_service"},
    "fedatoms": {"fedcore", "fedwire", "aggregator_service", "client_agent", "dashboard_api"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, str, int]]:
    """``(imported module, imported name or "", line)`` for every import in one module."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, "", node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                child = f"{source}.{alias.name}"
                if child in known:  # `from package import module`
                    yield child, "", node.lineno
                else:
                    yield source, alias.name, node.lineno


def graph() -> tuple[dict[str, set[str]], list[str], list[str]]:
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    upward, private = [], []
    for name, path in known.items():
        own = name.split(".")[0]
        for target, imported, line in imports(name, path, known):
            top = target.split(".")[0]
            if top not in ALLOWED:
                continue  # the standard library and third-party packages
            where = f"{path.relative_to(ROOT)}:{line}"
            if top != own and top not in ALLOWED[own]:
                upward.append(f"{where} imports {target} ({own} may import {sorted(ALLOWED[own]) or 'nothing'})")
            if top != own and (imported.startswith("_") or any(p.startswith("_") for p in target.split("."))):
                private.append(f"{where} imports the private {target}{'.' + imported if imported else ''}")
            if target in known and target != name:
                edges[name].add(target)
    return edges, upward, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_packages_import_downward_only() -> None:
    _, upward, _ = graph()
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_private_name_crosses_a_package() -> None:
    _, _, private = graph()
    assert not private, "private names imported across packages:\n" + "\n".join(private)


def test_modules_import_without_cycles() -> None:
    edges, _, _ = graph()
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(" ↔ ".join(c) for c in found)


@pytest.mark.parametrize(
    ("source", "expect"),
    [
        ("from aggregator_service import store\n", "upward"),
        ("from fedcore.codec import _private\n", "private"),
    ],
)
def test_the_check_catches_what_it_is_for(tmp_path: Path, source: str, expect: str) -> None:
    """The checker itself, on a module planted in a copy of the bottom package's name."""
    path = tmp_path / "fedwire" / "planted.py"
    path.parent.mkdir()
    path.write_text(source)
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = list(imports("fedwire.planted", path, {}))
    finally:
        ROOT = saved
    target, imported, _ = found[0]
    top = target.split(".")[0]
    if expect == "upward":
        assert top not in ALLOWED["fedwire"] and top != "fedwire"
    else:
        assert imported.startswith("_") and top != "fedwire"


def test_a_planted_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_command_line_builds_its_parser_without_the_dashboard_or_the_store() -> None:
    """Every `fedatoms` process (an aggregator, each client) builds the whole parser: FastAPI, the
    dashboard app and the database layer load only in the commands that use them."""
    probe = (
        "import sys; from fedatoms.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'dashboard_api.app', 'aggregator_service.store') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
    # and the package still offers its app to those who import it
    import dashboard_api

    assert callable(dashboard_api.create_app) and dashboard_api.DashboardSettings.__name__ == "DashboardSettings"


def test_the_dashboard_serves_without_torch() -> None:
    """The dashboard only reads the store: its app and settings load without the training stack."""
    probe = (
        "import sys; from dashboard_api.app import create_app; from dashboard_api.settings import DashboardSettings; "
        "DashboardSettings(database_url='sqlite:///x.db'); print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", done.stdout
