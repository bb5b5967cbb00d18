"""`--engine ray`: Ray actors run the virtual clients; the record is the local engine's, in process and over gRPC.

One local Ray with 2 CPUs serves the whole module (it takes seconds to start). The oracle for
every run is the local engine's run of the same configuration; an actor killed mid-run
(SIGKILL to its process) is checked against bytes worked out from that run.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from fedatoms.simulate import SimulationConfig, run_simulation  # noqa: E402
from fedcore.keys import client_key  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# two tiers (two actors on 2 CPUs), atoms with low-rank coefficients, FedLAMA, personal atoms
RICH: dict[str, Any] = dict(
    dataset="digits",
    factorization="atoms-lowrank",
    clients=4,
    fraction=1.0,
    rounds=3,
    tiers=[1.0, 0.25],
    interval_policy="fedlama",
    tau=1,
    phi=2,
    personal_atoms=True,
    classes_per_client=3,
    batch_size=32,
    seed=5,
)
# plain FedAvg, one tier: 2 actors hold clients {0, 2} and {1, 3} (placement rule)
PLAIN: dict[str, Any] = dict(
    dataset="digits", clients=4, fraction=1.0, rounds=3, partition="iid", batch_size=32, seed=7
)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _same(a: Any, b: Any, path: str) -> None:
    """Equal, floats to 1e-12 relative (numpy's pairwise sums may round differently with memory alignment)."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15), (path, a, b)
    else:
        assert a == b, (path, a, b)


def _rounds(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in results["rounds"]]


@pytest.fixture(scope="module")
def local_rich() -> dict[str, Any]:
    return run_simulation(SimulationConfig(**RICH))


@pytest.fixture(scope="module")
def local_plain() -> dict[str, Any]:
    return run_simulation(SimulationConfig(**PLAIN))


def test_ray_in_process_gives_the_local_record(local_rich):
    ray_run = run_simulation(SimulationConfig(engine="ray", **RICH))
    _same(_rounds(local_rich), _rounds(ray_run), "rounds")
    assert set(ray_run["summary"]) == set(local_rich["summary"])
    assert ray_run["config"]["engine"] == "ray" and local_rich["config"]["engine"] == "local"
    assert ray.is_initialized()  # a Ray the caller started is left running


def test_ray_over_grpc_gives_the_local_record(local_rich, tmp_path):
    ray_run = run_simulation(
        SimulationConfig(engine="ray", transport="grpc", **RICH), database_url=f"sqlite:///{tmp_path / 'agg.db'}"
    )
    _same(_rounds(local_rich), _rounds(ray_run), "rounds")


def test_ray_over_grpc_agents_train_on_the_given_device(tmp_path):
    """``--device`` reaches the agents every actor runs: each records it in its saved state (the server's task
    alone says ``auto``)."""
    from client_agent.state import ClientState

    config = SimulationConfig(engine="ray", transport="grpc", device="cpu", **{**PLAIN, "rounds": 2})
    run_simulation(config, database_url=f"sqlite:///{tmp_path / 'agg.db'}", state_dir=str(tmp_path / "clients"))
    states = [ClientState.load(tmp_path / "clients" / client_key(i)) for i in range(PLAIN["clients"])]
    assert [s.rounds_joined for s in states] == [2] * PLAIN["clients"]
    assert [s.last_config["device"] for s in states] == ["cpu"] * PLAIN["clients"]


def _kill_after_round_1(slot: int) -> Any:
    """A progress callback that, once round 1 is recorded, SIGKILLs the actor of ``slot`` and waits for it to go."""
    killed: list[int] = []

    def progress(record: dict[str, Any]) -> None:
        if record["round"] != 1:
            return
        names = [n for n in ray.util.list_named_actors() if n.endswith(f"-slot{slot}-g0")]
        assert len(names) == 1, names
        pid = ray.get(ray.get_actor(names[0]).pid.remote())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and "\nState:\tZ" not in _status(pid):
            assert time.monotonic() < deadline, f"actor process {pid} still runs"
            time.sleep(0.05)
        killed.append(pid)

    progress.killed = killed  # type: ignore[attr-defined]
    return progress


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return "\nState:\tZ"


def test_a_killed_actors_clients_retry_the_round_on_its_replacement(local_plain):
    progress = _kill_after_round_1(0)
    run = run_simulation(SimulationConfig(engine="ray", **PLAIN), progress=progress)
    assert progress.killed
    lost = [client_key(0), client_key(2)]
    faults = run["rounds"][1].pop("faults")
    assert faults == [{"client": c, "phase": "train", "outcome": "retried", "cause": faults[0]["cause"]} for c in lost]
    assert all("faults" not in r for r in run["rounds"])
    # plain FedAvg trains from the global model: the retried updates are the lost ones, the model the same
    local = local_plain["rounds"]
    assert [r["test_accuracy"] for r in run["rounds"]] == [r["test_accuracy"] for r in local]
    assert [r["local_accuracy"] for r in run["rounds"]] == [r["local_accuracy"] for r in local]
    # but the new actor held nothing: its two clients fetched the whole model again (a round-1 fetch each, of 4)
    whole_model = local[0]["bytes_train_fetch"] // 4
    assert local[1]["bytes_train_fetch"] == 0  # round 1's evaluation fetch left every client current
    assert run["rounds"][1]["bytes_train_fetch"] == 2 * whole_model
    assert run["rounds"][2]["bytes_train_fetch"] == local[2]["bytes_train_fetch"]


def test_a_killed_actors_clients_drop_out_of_the_round_and_come_back(local_plain):
    run = run_simulation(
        SimulationConfig(engine="ray", actor_failure="dropout", **PLAIN), progress=_kill_after_round_1(1)
    )
    second = run["rounds"][1]
    assert [(f["client"], f["outcome"]) for f in second["faults"]] == [
        (client_key(1), "dropout"),
        (client_key(3), "dropout"),
    ]
    assert (second["cohort_size"], second["reported"]) == (4, 2)
    assert second["latent_clients"] == 0  # no atoms: m² − m counts only where atoms were averaged
    assert run["rounds"][2]["reported"] == 4  # the replacement's clients are back
    assert second["test_accuracy"] != local_plain["rounds"][1]["test_accuracy"]


# twelve clients on 2 actors: each actor's six members of a round travel in chunks of two (CHUNKS_PER_ACTOR = 4)
MANY: dict[str, Any] = {**PLAIN, "clients": 12}


def test_chunked_calls_give_the_local_record_with_a_sampled_cohort():
    config = {**MANY, "fraction": 0.75, "rounds": 4}  # 9 of 12 a round: uneven members per actor, uneven chunks
    _same(
        _rounds(run_simulation(SimulationConfig(**config))),
        _rounds(run_simulation(SimulationConfig(engine="ray", **config))),
        "rounds",
    )


def test_a_killed_actors_chunks_are_all_retried_and_their_clients_fetch_once():
    local = run_simulation(SimulationConfig(**MANY))["rounds"]
    progress = _kill_after_round_1(0)
    run = run_simulation(SimulationConfig(engine="ray", **MANY), progress=progress)
    assert progress.killed
    faults = run["rounds"][1].pop("faults")
    lost = [client_key(i) for i in range(0, 12, 2)]  # slot 0 hosts the even clients: three chunks of two
    assert [(f["client"], f["phase"], f["outcome"]) for f in faults] == [(c, "train", "retried") for c in lost]
    assert all("faults" not in r for r in run["rounds"])
    assert [r["test_accuracy"] for r in run["rounds"]] == [r["test_accuracy"] for r in local]
    whole_model = local[0]["bytes_train_fetch"] // 12
    assert run["rounds"][1]["bytes_train_fetch"] == 6 * whole_model  # each lost client fetched the model once
    assert [r["bytes_eval_fetch"] for r in run["rounds"]] == [r["bytes_eval_fetch"] for r in local]


def test_the_command_starts_and_stops_its_own_ray_and_writes_the_local_form(tmp_path, local_plain):
    """`fedatoms simulate --engine ray` with [simulation.resources] from its TOML: same record, same output form."""
    config = tmp_path / "sim.toml"
    config.write_text(
        'dataset = "digits"\nclients = 4\nfraction = 1.0\nrounds = 3\npartition = "iid"\nbatch_size = 32\nseed = 7\n'
        '[simulation]\nengine = "ray"\nray_num_cpus = 2\n[simulation.resources]\n"1" = {num_cpus = 0.5}\n'
    )
    out = tmp_path / "ray.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "fedatoms", "simulate", "--config", str(config), "--output", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"results written to {out}" in done.stdout
    assert "round: 100%" in done.stderr  # the local engine's progress bar
    results = json.loads(out.read_text())
    assert results["config"]["resources"] == {"1": {"num_cpus": 0.5}}
    _same(_rounds(local_plain), _rounds(results), "rounds")
    assert set(results["summary"]) == set(local_plain["summary"])


def test_bad_resources_are_refused_before_ray_starts(tmp_path):
    config = tmp_path / "sim.toml"
    config.write_text('clients = 4\n[simulation]\nengine = "ray"\n[simulation.resources]\n"1/8" = {num_cpus = 1}\n')
    done = subprocess.run(
        [sys.executable, "-m", "fedatoms", "simulate", "--config", str(config)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 2
    assert "no client has tier 0.125" in done.stderr
    assert "Ray" not in done.stderr


@pytest.mark.parametrize(
    "setting, says",
    [
        (dict(partition="shards"), "shards"),  # 4 clients × 2 classes cannot cover digits' 10
        (dict(device="tpu"), "unknown device 'tpu'"),
        (dict(device="tpu", transport="grpc"), "unknown device 'tpu'"),
        pytest.param(
            dict(device="cuda"),
            "CUDA is not available",
            marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA"),
        ),
    ],
)
def test_a_setup_mistake_is_refused_by_the_driver_before_the_first_round(setting, says):
    """As with the local engine: one line, before a progress bar would start; not an actor's traceback."""
    started: list[int] = []
    config = SimulationConfig(engine="ray", **{**PLAIN, "rounds": 1, **setting})
    with pytest.raises(ValueError, match=says) as refused:
        run_simulation(config, on_start=lambda: started.append(1))
    assert not started
    assert not isinstance(refused.value, ray.exceptions.RayError)


def test_a_users_mistake_raised_on_an_actor_prints_its_own_message():
    from fedatoms.cli import user_message

    wrapped = ray.exceptions.RayTaskError("train", "Traceback ...\nValueError: boom", ValueError("boom"))
    assert user_message(wrapped.as_instanceof_cause()) == "boom"
    assert user_message(ValueError("plain")) == "plain"


# two clients on two actors (2 CPUs), each killing its actor whenever it trains
DYING: dict[str, Any] = {**PLAIN, "clients": 2, "rounds": 1, "model": "tests.dying_model:build"}
SLOT_FAILED = (
    r"the Ray actor of slot \d \(clients client-\d+\) died 4 times, more than the 3 replacements a run allows: "
    r"The actor is dead because .+"
)


def test_clients_that_kill_their_actor_every_time_fail_the_run_in_one_line(capsys):
    """In process a lost call is retried once, then dropped: without a limit the run went on, every round without
    these clients, and ended as a success with the untrained model's accuracy."""
    from fedatoms.cli import main

    args = [f"--{k.replace('_', '-')}={v}" for k, v in DYING.items() if k != "fraction"]
    assert main(["simulate", "--engine", "ray", "--quiet-json", *args]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "round:" not in line]
    assert len(lines) == 1 and re.fullmatch("fedatoms: error: " + SLOT_FAILED, lines[0]), lines


def test_clients_that_kill_their_actor_every_time_fail_a_grpc_run(tmp_path):
    from client_agent.ray_pool import SlotFailed

    with pytest.raises(SlotFailed, match=SLOT_FAILED):
        run_simulation(
            SimulationConfig(engine="ray", transport="grpc", **DYING), database_url=f"sqlite:///{tmp_path / 'a.db'}"
        )
