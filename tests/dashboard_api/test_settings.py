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
