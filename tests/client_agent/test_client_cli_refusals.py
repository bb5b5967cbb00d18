"""`fedatoms client run` refuses a careless command line at once, with one line and exit 2, before it registers.

Each case runs the real command (``fedatoms.cli.main``) against a real aggregator where a
registration could happen, and checks the database afterwards: nothing registered.
"""

from __future__ import annotations

import pytest
import torch
from processes import SECRET, Aggregator, federation_toml
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from support import free_port

from aggregator_service import store
from fedatoms.cli import main


@pytest.fixture(scope="module")
def aggregator(tmp_path_factory: pytest.TempPathFactory):
    """One server for every case: none may register, so each finds the database as empty as the first did."""
    root = tmp_path_factory.mktemp("aggregator")
    config = federation_toml(root / "federation.toml", model="digits-cnn", rounds=1)
    server = Aggregator(config, free_port(), f"sqlite:///{root / 'agg.db'}", root / "server.log").start()
    yield server
    server.stop()


def _clients(url: str) -> int:
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            return int(s.execute(select(func.count()).select_from(store.Client)).scalar_one())
    finally:
        engine.dispose()


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(["client", "run", "--enrollment-secret", SECRET, "--partition-index", "0", *argv])
    return code, capsys.readouterr().err


def test_a_server_without_a_port_is_refused(aggregator, tmp_path, capsys) -> None:
    code, err = _run(capsys, "--server", "127.0.0.1", "--state-dir", str(tmp_path / "d"))
    assert code == 2
    assert "--server needs HOST:PORT" in err and len(err.strip().splitlines()) == 1
    assert _clients(aggregator.url) == 0


def test_a_state_dir_that_cannot_be_written_registers_nothing(aggregator, tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")  # a path under a regular file can be created by nobody, root included
    code, err = _run(capsys, "--server", aggregator.target, "--state-dir", str(blocker / "state"))
    assert code == 2
    assert "cannot be written" in err and "nothing was registered" in err
    assert _clients(aggregator.url) == 0


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('compute_macs = "lots"', "compute_macs"),
        ("memory_bytes = -1", "memory_bytes"),
        ("uplink_bps = nan", "uplink_bps"),
        ("memory_bytes = 92233720368547758070", "memory_bytes = 92233720368547758070 is out of range"),
    ],
)
def test_a_bad_profile_value_is_one_line_and_exit_2(aggregator, tmp_path, capsys, line, field) -> None:
    profile = tmp_path / "profile.toml"
    profile.write_text(f'device_name = "edge"\n{line}\n')
    code, err = _run(
        capsys, "--server", aggregator.target, "--state-dir", str(tmp_path / "d"), "--profile", str(profile)
    )
    assert code == 2, err
    assert field in err and len(err.strip().splitlines()) == 1
    assert _clients(aggregator.url) == 0


def test_a_profile_no_tier_fits_is_one_line_and_exit_2(aggregator, tmp_path, capsys) -> None:
    """A device too small for the federation's smallest tier: the aggregator's FAILED_PRECONDITION, said in one line."""
    profile = tmp_path / "profile.toml"
    profile.write_text('device_name = "tiny"\nmemory_bytes = 1024\ncompute_macs = 10\n')
    code, err = _run(
        capsys, "--server", aggregator.target, "--state-dir", str(tmp_path / "d"), "--profile", str(profile)
    )
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("ts=")]  # the agent's own log lines aside
    assert len(lines) == 1 and "no tier" in lines[0] and "tiny" in lines[0], err
    assert _clients(aggregator.url) == 0


def test_threads_below_one_are_refused(aggregator, tmp_path, capsys) -> None:
    code, err = _run(capsys, "--server", aggregator.target, "--threads", "0", "--state-dir", str(tmp_path / "d"))
    assert code == 2
    assert "--threads must be ≥ 1, got 0" in err and len(err.strip().splitlines()) == 1
    assert _clients(aggregator.url) == 0


@pytest.mark.parametrize(
    ("device", "says"),
    [
        ("tpu", "unknown device 'tpu'; use 'auto', 'cpu' or 'cuda[:N]'"),
        pytest.param(
            "cuda:1",
            "device 'cuda:1' requested but CUDA is not available on this machine",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: --device cuda:1 is no mistake"),
        ),
    ],
)
def test_a_device_torch_cannot_use_is_refused(aggregator, tmp_path, capsys, device: str, says: str) -> None:
    """As `fedatoms simulate --device` refuses it, with the same line."""
    code, err = _run(capsys, "--server", aggregator.target, "--device", device, "--state-dir", str(tmp_path / "d"))
    assert code == 2
    assert err.strip() == f"fedatoms: error: {says}"
    assert _clients(aggregator.url) == 0 and not (tmp_path / "d").exists()  # before the state directory, too


def _written_state(directory, client_id: str = "c-1"):
    from client_agent.state import ClientState

    directory.mkdir(parents=True, exist_ok=True)
    ClientState(client_id, 1.0, global_tensors={"w": torch.ones(3)}).save(directory)
    return directory / "state.safetensors"


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_damaged_state_file_is_one_line_and_registers_nothing(aggregator, tmp_path, capsys, damage) -> None:
    """A corrupt state file ended in safetensors' traceback (exit 1), after registering an orphan client."""
    path = _written_state(tmp_path / "d")
    whole = path.read_bytes()
    path.write_bytes({"garbage": b"\xff" * 64, "truncated": whole[: len(whole) // 2], "empty": b""}[damage])
    code, err = _run(capsys, "--server", aggregator.target, "--state-dir", str(tmp_path / "d"))
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("fedatoms: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"{path}: not a readable client state" in errors[0] and "delete the state directory" in errors[0]
    assert _clients(aggregator.url) == 0


def test_a_lost_credentials_file_is_refused_before_registering(aggregator, tmp_path, capsys) -> None:
    """Registering first left an orphan client behind, then refused the state (it named another client): every run."""
    _written_state(tmp_path / "d", client_id="kept-client")
    code, err = _run(capsys, "--server", aggregator.target, "--state-dir", str(tmp_path / "d"))
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("fedatoms: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "holds the state of client kept-client but no credentials.json" in errors[0]
    assert _clients(aggregator.url) == 0


def test_damaged_credentials_are_one_line(aggregator, tmp_path, capsys) -> None:
    (tmp_path / "d").mkdir()
    for text in ('{"client_id": "x", "tier": 1.0', '{"client_id": "x"}'):  # truncated; a key missing
        (tmp_path / "d" / "credentials.json").write_text(text)
        code, err = _run(capsys, "--server", aggregator.target, "--state-dir", str(tmp_path / "d"))
        assert code == 2, err
        errors = [line for line in err.splitlines() if line.startswith("fedatoms: error:")]
        assert len(errors) == 1 and "Traceback" not in err, err
        assert "credentials.json: not readable credentials" in errors[0]
    assert _clients(aggregator.url) == 0


def test_a_second_agent_on_a_state_directory_in_use_is_refused(aggregator, tmp_path, capsys) -> None:
    """Two agents on one directory pushed the same client's updates, and the second's resume cancelled the
    first's push stream (a CANCELLED traceback)."""
    import os

    from client_agent.agent import _only_agent

    with _only_agent(tmp_path / "d"):  # what a running agent holds
        code, err = _run(capsys, "--server", aggregator.target, "--state-dir", str(tmp_path / "d"))
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("fedatoms: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"another agent runs on this state directory (pid {os.getpid()})" in errors[0]
    assert _clients(aggregator.url) == 0
    with _only_agent(tmp_path / "d"):  # released when the agent ends: the next one runs
        pass
