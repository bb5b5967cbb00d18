"""A ``FEDATOMS_*`` variable that nothing reads is named, by the process whose share of the prefix it is in.

An operator's ``FEDATOMS_DATABSE_URL`` left the aggregator on its SQLite default, and a misspelt
``FEDATOMS_DASHBOARD_READ_TOKEN`` left the dashboard's reads open, with nothing said. The oracles are
hand-written environments, the names this repository's deploy files and docs set (each must be read by
something), and the real processes' own output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from grpc_helpers import SECRET
from support import free_port, wait_serving

from aggregator_service import config as aggregator_config
from aggregator_service.environment import READ_ELSEWHERE, Unread, settings_variables
from dashboard_api import settings as dashboard_settings

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"FEDATOMS_[A-Z0-9_]*[A-Z0-9]")  # a prefix mention (FEDATOMS_DASHBOARD_) ends in "_"


def _unread(monkeypatch, environ: dict[str, str]) -> tuple[list[Unread], list[Unread]]:
    """What the aggregator and the dashboard each name, in exactly ``environ``."""
    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    return aggregator_config.unread_environment(), dashboard_settings.unread_environment()


def test_each_process_names_a_misspelt_variable_of_its_share_with_the_one_it_meant(monkeypatch) -> None:
    environ = {
        "PATH": "/usr/bin",
        "FEDATOMS_DATABSE_URL": "postgresql://db/fed",  # the aggregator's and the dashboard's shared key
        "FEDATOMS_FEDERATION_ROUNDS": "50",  # one underscore: a nested key needs two
        "FEDATOMS_DB": "x",  # close to nothing
        "FEDATOMS_DASHBOARD_READ_TOKN": "r" * 16,
        # read by someone: the dashboard, a nested key, compose, the tests, the agent's unit
        "FEDATOMS_DASHBOARD_ADMIN_TOKEN": "a" * 16,
        "FEDATOMS_DATABASE_URL": "sqlite:///f.db",
        "FEDATOMS_FEDERATION__ROUNDS": "50",
        "FEDATOMS_TAG": "1.0",
        "FEDATOMS_TEST_POSTGRES_URL": "postgresql://x",
        "FEDATOMS_SERVER": "aggregator:50051",
    }
    aggregator, dashboard = _unread(monkeypatch, environ)
    assert aggregator == [
        Unread("FEDATOMS_DATABSE_URL", "FEDATOMS_DATABASE_URL"),
        Unread("FEDATOMS_DB", None),
        Unread("FEDATOMS_FEDERATION_ROUNDS", "FEDATOMS_FEDERATION__ROUNDS"),
    ]
    assert dashboard == [Unread("FEDATOMS_DASHBOARD_READ_TOKN", "FEDATOMS_DASHBOARD_READ_TOKEN")]


def test_the_shipped_environment_files_warn_nothing(monkeypatch) -> None:
    """deploy/systemd's files serve both processes (fedatoms.env) and the client agent's unit (client.env)."""
    for path in (ROOT / "deploy/systemd/fedatoms.env", ROOT / "deploy/systemd/client.env"):
        pairs = [
            line.lstrip("# ").split("=", 1) for line in path.read_text().splitlines() if NAME.match(line.lstrip("# "))
        ]
        assert pairs, path
        assert _unread(monkeypatch, {k: v for k, v in pairs}) == ([], []), path


def _names_in(paths: list[Path]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in paths:
        for name in NAME.findall(path.read_text(errors="replace")):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_deploy_files_and_docs_set_is_read_by_something() -> None:
    paths = [p for p in (ROOT / "deploy").rglob("*") if p.is_file()]
    paths += [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "Makefile", ROOT / ".ci/run"]
    names = _names_in(paths)
    assert "FEDATOMS_DATABASE_URL" in names and "FEDATOMS_HEALTH_ADDR" in names  # the scan sees what it must
    read = set(READ_ELSEWHERE)
    nested: tuple[str, ...] = ()
    for settings in (aggregator_config.AggregatorSettings, dashboard_settings.DashboardSettings):
        names_read, starts = settings_variables(settings)
        read |= names_read
        nested += starts
    misspelt = {"FEDATOMS_DATABSE_URL", "FEDATOMS_DASHBOARD_READ_TOKN"}  # the docs' examples of the warning
    unread = {
        n: sorted(where)
        for n, where in names.items()
        if n not in read and not n.startswith(nested) and not n.startswith("FEDATOMS_TEST_") and n not in misspelt
    }
    assert unread == {}


def test_every_variable_read_elsewhere_is_read_somewhere() -> None:
    """READ_ELSEWHERE does not outlive what reads its names."""
    paths = [p for p in (ROOT / "deploy").rglob("*") if p.is_file()]
    paths += [*(ROOT / "fedcore").rglob("*.py"), *(ROOT / "tests/deploy").rglob("*")]
    names = _names_in([p for p in paths if p.is_file()])
    assert sorted(READ_ELSEWHERE - names.keys()) == []


def test_a_serving_aggregator_logs_a_misspelt_variable(tmp_path) -> None:
    config = tmp_path / "federation.toml"
    config.write_text(f'enrollment_secret = "{SECRET}"\n')
    log, target = tmp_path / "server.log", f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "fedatoms", "aggregator", "serve", "--config", str(config), "--listen", target]
    cmd += ["--database-url", f"sqlite:///{tmp_path / 'agg.db'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "FEDATOMS_DEADLINE_SECOND": "30"}
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    try:
        wait_serving(target)  # the check runs before the server starts
    finally:
        server.terminate()
        server.wait(30)
    warned = [line for line in log.read_text().splitlines() if "event=unread_environment_variable" in line]
    assert len(warned) == 1, log.read_text()
    assert "level=WARNING" in warned[0]
    assert warned[0].endswith("name=FEDATOMS_DEADLINE_SECOND did_you_mean=FEDATOMS_DEADLINE_SECONDS")


@pytest.mark.parametrize(
    ("argv", "variable", "meant"),
    [
        (["aggregator", "export", "m.safetensors"], "FEDATOMS_FEDERATION_NAM", "FEDATOMS_FEDERATION_NAME"),
        (["db", "upgrade"], "FEDATOMS_DATABASE_UR", "FEDATOMS_DATABASE_URL"),
    ],
)
def test_the_store_commands_print_a_misspelt_variable(tmp_path, argv, variable, meant) -> None:
    url = f"sqlite:///{tmp_path / 'f.db'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), variable: "x", "FEDATOMS_DATABASE_URL": url}
    done = subprocess.run(
        [sys.executable, "-m", "fedatoms", *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert f"warning: {variable} is set, but no fedatoms process reads it; did you mean {meant}?" in done.stderr


def test_the_migration_command_prints_a_misspelt_variable(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDATOMS_DATABSE_URL": f"sqlite:///{tmp_path / 'f.db'}"}
    done = subprocess.run(
        [sys.executable, "-m", "aggregator_service.store", "current"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    warning = (
        "warning: FEDATOMS_DATABSE_URL is set, but no fedatoms process reads it; did you mean FEDATOMS_DATABASE_URL?"
    )
    assert done.stderr.strip() == warning


def test_a_serving_dashboard_prints_a_misspelt_variable(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "FEDATOMS_DASHBOARD_READ_TOKN": "r" * 16}
    cmd = [sys.executable, "-m", "fedatoms", "dashboard", "serve", "--database-url", f"sqlite:///{tmp_path / 'd.db'}"]
    proc = subprocess.Popen(
        [*cmd, "--listen", "127.0.0.1:0"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = threading.Timer(120, proc.kill)  # a banner that never comes ends the read with EOF
    deadline.start()
    try:
        assert proc.stdout is not None and proc.stderr is not None
        banner = proc.stdout.readline()  # printed once it listens: the warning came before
    finally:
        deadline.cancel()
        proc.terminate()
        proc.wait(30)
    assert banner.startswith("fedatoms dashboard: http://127.0.0.1:"), banner
    first = proc.stderr.readline().strip()
    assert first == (
        "warning: FEDATOMS_DASHBOARD_READ_TOKN is set, but no fedatoms process reads it; "
        "did you mean FEDATOMS_DASHBOARD_READ_TOKEN?"
    )


def test_a_misspelt_nested_key_is_refused_as_one_in_the_file_is(monkeypatch) -> None:
    from pydantic import ValidationError

    from aggregator_service.toml_settings import explain

    monkeypatch.setenv("FEDATOMS_FEDERATION__ROUDNS", "3")
    with pytest.raises(ValidationError) as refused:
        aggregator_config.AggregatorSettings()
    assert explain(refused.value) == "federation.roudns: Unexpected keyword argument (got '3')"
    assert aggregator_config.unread_environment() == []  # refused, so not named twice
