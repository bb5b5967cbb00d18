"""Suite-wide settings: one intra-op thread per pytest worker (`make test` runs two workers on two cores).

`make test` hands tests to its workers one by one (``--dist loadscope``, each test its own scope here), so
that the slowest files do not keep one worker busy while the other idles; a file that sets up a module- or
session-scoped fixture (a Ray, a federation run once for all its tests) keeps its tests on one worker, so it
sets up once. (pytest-xdist's ``xdist_group`` marks do not group under pytest 9: its scheduler reads a
node id that pytest no longer lets it rewrite.)

The header names the PostgreSQL server and the Chromium the suite will use, or why not
(see support.py: the URL defaults to ``postgresql+psycopg://postgres@127.0.0.1:5432/test``).
"""

import functools
import re
from pathlib import Path

import pytest
import torch
from sqlalchemy.engine import make_url
from support import chromium, postgres_probe

torch.set_num_threads(1)
HERE = Path(__file__).resolve().parent


def pytest_report_header() -> list[str]:
    url, reason = postgres_probe()
    shown = make_url(url).render_as_string(hide_password=True) if url else ""
    browser = chromium()
    return [
        f"postgresql: {shown}" if url else f"postgresql: skipped, {reason}",
        f"chromium: {browser}" if browser else "chromium: skipped, not installed",
    ]


@pytest.hookimpl(optionalhook=True)  # a run without pytest-xdist (-p no:xdist) does not know the hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadscope`` with a test's scope its file where the file shares fixtures (module docstring)."""
    if config.getvalue("dist") != "loadscope":
        return None  # any other mode as pytest-xdist does it
    from xdist.scheduler import LoadScopeScheduling

    class FileWhereShared(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return path if _shares_fixtures(path) else nodeid

    return FileWhereShared(config, log)


SHARED = re.compile(r"""scope\s*=\s*["'](module|package|session)["']""")


@functools.cache
def _shares_fixtures(path: str) -> bool:
    """Whether the test file, or a conftest.py between it and this directory, defines a module-, package- or
    session-scoped fixture (read as text: the controller that schedules does not collect)."""
    file = (HERE.parent / path).resolve()
    places = [file, *(d / "conftest.py" for d in file.parents if d.is_relative_to(HERE) and d != HERE)]
    return any(p.is_file() and SHARED.search(p.read_text()) for p in places)
