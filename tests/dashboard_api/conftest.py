"""Dashboard fixtures: per module and backend, a federation's database and a live dashboard over it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from dashboard_helpers import ADMIN_TOKEN, BACKENDS, Federation, LiveServer, database, run_federation, start_dashboard

from dashboard_api.settings import DashboardSettings


@pytest.fixture(scope="module", params=BACKENDS)
def federation(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    with database(request.param, tmp_path_factory.mktemp(request.param)) as url:
        yield from run_federation(url)


@pytest.fixture(scope="module")
def dashboard(federation: Federation) -> Iterator[LiveServer]:
    live = start_dashboard(DashboardSettings(database_url=federation.url, admin_token=ADMIN_TOKEN, poll_seconds=1))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def api(dashboard: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{dashboard.base_url}/api/v1", timeout=30) as client:
        yield client
