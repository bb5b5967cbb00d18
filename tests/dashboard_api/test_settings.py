"""The dashboard reads the aggregator's TOML file: shared keys, its own table, and the environment above both."""

from __future__ import annotations

from pathlib import Path

import pytest

from dashboard_api.settings import DashboardSettings

TOML = """
database_url = "sqlite:///file.db"
federation_name = "north"
listen = "127.0.0.1:50051"  # the aggregator's: not the dashboard's

[federation]
rounds = 3

[dashboard]
listen = "127.0.0.1:9000"
poll_seconds = 2
"""


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("DATABASE_URL", "DASHBOARD_DATABASE_URL", "DASHBOARD_LISTEN"):
        monkeypatch.delenv(f"FEDATOMS_{name}", raising=False)
    path = tmp_path / "federation.toml"
    path.write_text(TOML)
    return path


def test_shared_keys_and_the_dashboard_table(config: Path) -> None:
    s = DashboardSettings.from_toml(config)
    assert (s.database_url, s.federation_name, s.listen, s.poll_seconds) == (
        "sqlite:///file.db",
        "north",
        "127.0.0.1:9000",
        2.0,
    )


@pytest.mark.parametrize("variable", ["FEDATOMS_DATABASE_URL", "FEDATOMS_DASHBOARD_DATABASE_URL"])
def test_the_environment_wins_over_the_file(config: Path, monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv(variable, "sqlite:///env.db")
    assert DashboardSettings.from_toml(config).database_url == "sqlite:///env.db"


def test_arguments_win_over_both_and_none_is_no_argument(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDATOMS_DASHBOARD_LISTEN", "127.0.0.1:9100")
    s = DashboardSettings.from_toml(config, database_url="sqlite:///flag.db", listen=None)
    assert (s.database_url, s.listen) == ("sqlite:///flag.db", "127.0.0.1:9100")


def test_a_dashboard_key_that_is_not_a_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("dashboard = 3\n")
    with pytest.raises(ValueError, match=r"\[dashboard\] must be a table"):
        DashboardSettings.from_toml(path)


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("federation_name", "", "federation_name must not be empty"),
        ("federation_name", "  ", "federation_name must not be empty"),
        ("federation_name", "n" * 129, "federation_name is 129 characters; the store keeps at most 128"),
        ("listen", "127.0.0.1:99999", "listen's port must be 0–65535"),
    ],
)
def test_a_name_or_port_the_store_or_the_socket_cannot_take_is_refused(key: str, value: str, said: str) -> None:
    """An empty federation name, one longer than ``federations.name`` holds (PostgreSQL raised at the insert), and
    a port past 65535 (uvicorn's bind raised ``OverflowError``) are refused in the settings, as the aggregator's
    are."""
    from aggregator_service.config import AggregatorSettings, StoreTarget

    for settings in (DashboardSettings, AggregatorSettings, *((StoreTarget,) if key == "federation_name" else ())):
        with pytest.raises(ValueError, match=said):
            settings(**{key: value})
    assert DashboardSettings(federation_name="n" * 128).federation_name == "n" * 128


def test_a_missing_sqlite_file_is_named_and_not_created(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A mistyped path used to leave an empty WAL database behind (and its -shm, -wal files) and answer a generic
    503. The dashboard opens only a file that exists, and says which is missing; once the aggregator creates it,
    the same dashboard serves it. Its log says the driver's cause in one line per failed read (it repeated the
    SQL statement, every request and scrape)."""
    import httpx
    from dashboard_helpers import start_dashboard

    from aggregator_service import store

    path = tmp_path / "a typo#1.db"  # a URI filename reads an unquoted "#" as the start of a fragment
    live = start_dashboard(DashboardSettings(database_url=f"sqlite:///{path}"))
    try:
        ready = httpx.get(f"{live.base_url}/readyz")  # no token: it says what is missing, not where
        assert ready.status_code == 503 and "the database file does not exist" in ready.json()["detail"]
        api = httpx.get(f"{live.base_url}/api/v1/federation")
        assert api.status_code == 503 and f"the database file {path} does not exist" in api.json()["detail"]
        assert "fedatoms_database_up 0.0" in httpx.get(f"{live.base_url}/metrics").text
        assert list(tmp_path.iterdir()) == []  # nothing created
        warned = [r.getMessage() for r in caplog.records if r.name.startswith("dashboard_api")]
        assert len(warned) == 2, warned  # the API's read and the scrape's
        assert all("unable to open database file" in w and "\n" not in w and "SQL" not in w for w in warned), warned
        store.upgrade(f"sqlite:///{path}")  # what the aggregator does at its first start
        assert httpx.get(f"{live.base_url}/readyz").status_code == 200
    finally:
        live.stop()


def test_serve_on_port_0_names_the_port_it_got_and_a_taken_port_is_one_line(tmp_path: Path) -> None:
    """The banner printed ``http://127.0.0.1:0/`` (uvicorn's own line alone had the port)."""
    import os
    import re
    import subprocess
    import sys
    import threading

    import httpx

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "fedatoms", "dashboard", "serve", "--database-url", f"sqlite:///{tmp_path / 'd.db'}"]
    proc = subprocess.Popen([*cmd, "--listen", "127.0.0.1:0"], cwd=root, env=env, stdout=subprocess.PIPE, text=True)
    deadline = threading.Timer(120, proc.kill)  # a banner that never comes ends the read with EOF
    deadline.start()
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()  # printed once the socket listens, flushed
        found = re.match(r"fedatoms dashboard: http://127\.0\.0\.1:(\d+)/ over ", banner)
        assert found is not None and int(found.group(1)) > 0, banner
        port = int(found.group(1))
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30).json() == {"status": "ok"}
        taken = subprocess.run(
            [*cmd, "--listen", f"127.0.0.1:{port}"], cwd=root, env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        deadline.cancel()
        proc.terminate()
        proc.wait(30)
    lines = taken.stderr.strip().splitlines()
    assert taken.returncode == 2 and len(lines) == 1, taken.stderr
    assert lines[0].startswith("fedatoms: error: cannot listen on 127.0.0.1:") and "in use" in lines[0], lines
