"""tests/deploy: static checks of deploy/ (every run) and real containers (``make test-deploy`` only).

Tests marked ``deploy`` build images and run containers; the main suite deselects them unless
``FEDATOMS_DEPLOY_TESTS=1`` (``make test-deploy`` sets it and runs only them).
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "deploy: builds images and runs containers (make test-deploy)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = os.environ.get("FEDATOMS_DEPLOY_TESTS") == "1"
    keep = [item for item in items if (item.get_closest_marker("deploy") is not None) == wanted]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
