"""The page in a real browser (Debian's Chromium driven by Playwright) against a live dashboard."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from dashboard_helpers import Federation, LiveServer, database, run_federation
from support import chromium

CHROMIUM = chromium()
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium (/usr/bin/chromium or chromium on PATH): apt-get install chromium"
)


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    """SQLite only: the page reads the same API either way."""
    with database("sqlite", tmp_path_factory.mktemp("page")) as url:
        yield from run_federation(url)


def test_page_plots_the_rounds_without_console_errors(
    dashboard: LiveServer, api: httpx.Client, federation: Federation, tmp_path: Path
) -> None:
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    from playwright.sync_api import sync_playwright

    closed = [r["number"] for r in api.get("/rounds?state=closed").json()["items"]]
    rounds = {r["number"]: r for r in api.get("/rounds").json()["items"]}
    assert closed == [1, 2, 3]
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.goto(dashboard.base_url + "/")
            page.wait_for_function("window.fedatomsDashboard && window.fedatomsDashboard.polls >= 2", timeout=30_000)
            series = page.evaluate("window.fedatomsDashboard.series")
            assert page.evaluate("window.fedatomsDashboard.lastError") is None

            accuracy = series["accuracy"]
            assert accuracy["x"] == closed
            assert accuracy["global (server test set)"] == pytest.approx([rounds[n]["test_accuracy"] for n in closed])
            assert accuracy["cut to tier 0.25 (server test set)"] == pytest.approx(
                [rounds[n]["tier_accuracy"]["0.25"] for n in closed]
            )
            assert accuracy["clients, global model"] == pytest.approx(
                [rounds[n]["mean_client_accuracy"] for n in closed]
            )
            assert accuracy["clients, personalized"] == pytest.approx(
                [rounds[n]["personalized_accuracy"] for n in closed]
            )
            assert series["dispersion"]["client spread (within round)"] == pytest.approx(
                [rounds[n]["dispersion"] for n in closed]
            )
            tensors = [t["name"] for t in api.get("/intervals").json()["tensors"]]
            for key in ("heatmap", "dl", "intervals"):
                assert series[key]["x"] == closed and set(series[key]) == {"x", *tensors}, key
            bandwidth = api.get("/bandwidth").json()["rounds"]["items"]
            assert series["bytes"]["FedAvg-equivalent"] == [r["cumulative_fedavg_equivalent_bytes"] for r in bandwidth]

            for element in (
                "chart-accuracy",
                "chart-dispersion",
                "heatmap",
                "chart-dl",
                "chart-intervals",
            ):
                assert page.get_attribute(f"#{element}", "data-points") == str(len(closed)), element
            # bytes come from the transfers table: the open round's bytes so far are a point too
            assert [r["round"] for r in bandwidth] == [*closed, max(closed) + 1]
            assert page.get_attribute("#chart-bytes", "data-points") == str(len(bandwidth))
            assert page.locator("#chart-accuracy canvas").count() >= 1
            assert page.locator("#clients-table tbody tr").count() == 4
            assert page.locator("#rounds-table tbody tr").count() == 4
            assert page.locator("#fed-state").inner_text() == "running"
            ratio = api.get("/bandwidth").json()["totals"]["saving_ratio"]
            assert ratio > 1 and page.locator("#stat-saving").inner_text().endswith(f"({ratio:.2f}× fewer)")
            # a federation that moved more than FedAvg would have (fp32 atoms at tier 1, say) reads so
            assert page.evaluate("window.fedatomsDashboard.versusFedAvg(0.5)") == "2.00× more"
            assert page.evaluate("window.fedatomsDashboard.versusFedAvg(0.99893)") == "1.00× more"
            assert "dev-1" in page.locator("#clients-table").inner_text()
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    assert problems == []


def test_openapi_page_renders_swagger_ui_offline(dashboard: LiveServer) -> None:
    """/docs draws the API with every request answered by the dashboard: no CDN, so it works offline."""
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    from playwright.sync_api import sync_playwright

    own = dashboard.base_url.rstrip("/")
    elsewhere: list[str] = []
    problems: list[str] = []

    def offline(route) -> None:  # the network is cut: only the dashboard itself answers
        if route.request.url.startswith(own):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page()
            page.route("**/*", offline)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.goto(own + "/docs")
            page.wait_for_selector(".swagger-ui .opblock", timeout=30_000)
            text = page.locator(".swagger-ui").inner_text()
            assert "fedatoms dashboard" in text
            for path in ("/api/v1/rounds", "/api/v1/clients/{client_id}", "/api/v1/intervals"):
                assert path in text, path
        finally:
            browser.close()
    assert elsewhere == [] and problems == []
