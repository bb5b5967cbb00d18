"""`fedatoms simulate` finds what it can before it draws its progress bar.

Each run is a real `fedatoms simulate` process with one mistake: bad arguments, data the run
cannot use, destinations it could only fail to write after the last round. Its output must be
the one error line, with no trace of the bar (``round:`` and tqdm's ``%|``); a run without a
mistake draws the bar, so its absence means something.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BAR = ("round:", "%|")
NEEDS_RAY = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
NEEDS_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: --device cuda is no mistake")


def simulate(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fedatoms", "simulate", "--rounds", "1", "--quiet-json", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_run_without_a_mistake_draws_the_bar() -> None:
    done = simulate("--clients", "4", "--partition", "iid")
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(mark in done.stderr for mark in BAR) and "100%" in done.stderr


@pytest.mark.parametrize(
    ("args", "error"),
    [
        # found once the data is loaded: two clients of two classes each cannot cover digits' ten
        (("--clients", "2"), "shards need num_clients × classes_per_client ≥ number of classes"),
        (("--clients", "4", "--dataset", "cifar10", "--data-dir", "{tmp}"), "dataset 'cifar10' not found in"),
        (("--clients", "4", "--threads", "0"), "threads must be ≥ 1, got 0"),
        (("--clients", "4", "--device", "tpu"), "unknown device 'tpu'"),
        # the clients' device: checked before the aggregator or a worker starts, as in process
        (("--clients", "4", "--transport", "grpc", "--device", "tpu"), "unknown device 'tpu'"),
        pytest.param(
            ("--clients", "4", "--device", "cuda"),
            "device 'cuda' requested but CUDA is not available on this machine",
            marks=NEEDS_NO_CUDA,
        ),
        pytest.param(
            ("--clients", "4", "--transport", "grpc", "--device", "cuda"),
            "device 'cuda' requested but CUDA is not available on this machine",
            marks=NEEDS_NO_CUDA,
        ),
        (("--clients", "4", "--server", "127.0.0.1:1"), "--server applies only to --transport grpc"),
        (("--clients", "4", "--transport", "grpc", "--workers", "0"), "--workers must be ≥ 1, got 0"),
        (
            ("--clients", "4", "--transport", "grpc", "--enrollment-secret", "s"),
            "--enrollment-secret applies only with",
        ),
        # a method key the chosen method never reads
        (("--clients", "4", "--phi", "4"), "phi = 4 would change nothing: only the fedlama interval policy reads it"),
        # written after the last round: refused before the first
        (("--clients", "4", "--save-model", "{tmp}"), "is a directory: give the model file's path"),
        (("--clients", "4", "--output", "{tmp}/missing/results.json"), "there is no directory"),
        (("--clients", "4", "--transport", "grpc", "--server", "127.0.0.1:1"), "with --server, give --database-url"),
        (("--clients", "4", "--transport", "grpc", "--tls-ca", "{tmp}/ca.pem"), "--tls-ca"),
        (("--clients", "4", "--transport", "grpc", "--database-url", "pg://u:hunter2@h/db"), "u:***@h/db: the store"),
        (("--clients", "4", "--transport", "grpc", "--state-dir", "/proc/fedatoms/state"), "cannot create it"),
        (("--clients", "4", "--transport", "grpc", "--dataset", "cifar10", "--data-dir", "{tmp}"), "not found in"),
        # a Ray head nothing answers for: ray.init retried its GCS for minutes
        pytest.param(
            ("--clients", "4", "--engine", "ray", "--ray-address", "127.0.0.1:1"),
            "--ray-address 127.0.0.1:1: nothing accepts a connection there within 5 s",
            marks=NEEDS_RAY,
        ),
        # Ray ignores num_cpus when it joins a cluster
        (
            ("--clients", "4", "--engine", "ray", "--ray-address", "auto", "--ray-num-cpus", "2"),
            "ray_num_cpus sizes the local Ray, and ray_address auto joins a cluster",
        ),
        pytest.param(
            ("--clients", "4", "--engine", "ray", "--ray-address", "head"),
            "--ray-address head: give HOST:PORT of the Ray head",
            marks=NEEDS_RAY,
        ),
    ],
)
def test_an_early_error_is_one_line_and_no_bar(args: tuple[str, ...], error: str, tmp_path: Path) -> None:
    done = simulate(*(a.format(tmp=tmp_path) for a in args))
    assert done.returncode == 2, done.stderr[-3000:]
    assert not any(mark in done.stderr + done.stdout for mark in BAR), done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("fedatoms: error: ") and error in lines[-1], done.stderr
    assert len(lines) == 1, done.stderr


def test_a_split_the_data_cannot_make_is_one_line_over_grpc_too() -> None:
    """Over gRPC the partition was drawn once the aggregator served: its start lines came first, naming a database
    and a state directory already removed. It is drawn before anything starts now: the error line alone."""
    done = simulate("--clients", "2", "--transport", "grpc")
    assert done.returncode == 2, done.stderr[-3000:]
    assert not any(mark in done.stderr + done.stdout for mark in BAR), done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [
        "fedatoms: error: shards need num_clients × classes_per_client ≥ number of classes so every class is used: "
        "2 × 2 < 10"
    ]


def test_an_aggregator_that_cannot_be_reached_ends_the_run_in_one_line(tmp_path: Path) -> None:
    """``--server`` naming a port nothing listens on: registration retried for ever (killed after 120 s)."""
    import time

    from support import free_port

    started = time.monotonic()
    done = simulate(
        *("--clients", "4", "--partition", "iid", "--transport", "grpc", "--server", f"127.0.0.1:{free_port()}"),
        *("--database-url", f"sqlite:///{tmp_path / 'x.db'}", "--enrollment-secret", "s", "--give-up-after", "2"),
    )
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("fedatoms: error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert re.fullmatch(r"fedatoms: error: cannot reach the aggregator at 127\.0\.0\.1:\d+ for 2 s: .*", errors[0])
    assert time.monotonic() - started < 60


def test_ray_address_auto_without_a_cluster_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ray.init(address="auto")`` with no cluster on this machine raises ConnectionError (a 30-line traceback);
    Ray itself is stood in for: a real ``auto`` would join any cluster another run on this machine started."""
    ray = pytest.importorskip("ray")
    from client_agent.ray_pool import ray_session

    def no_cluster(**_: object) -> None:
        raise ConnectionError("Could not find any running Ray instance.\nPlease specify the one to connect to.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(ValueError) as refused, ray_session("auto"):
        pass
    assert str(refused.value) == "--ray-address auto: no Ray cluster to join (Could not find any running Ray instance.)"


@pytest.mark.parametrize(
    ("simulation", "error"),
    [
        ('ray_num_cpus = "2"', "ray_num_cpus must be a whole number, got '2'"),  # was a TypeError from a comparison
        ("ray_num_cpus = true", "ray_num_cpus must be a whole number, got True"),  # was taken as 1 CPU
        ("ray_num_cpus = 1.5", "ray_num_cpus must be a whole number, got 1.5"),
        ("resources = 5", "resources must be a table ([simulation.resources]), got 5"),  # was a TypeError
        ("ray_address = 6379", "ray_address must be a string (HEAD:6379 or auto), got 6379"),
        ("actor_failure = true", "actor_failure must be a string, got True"),
        ("engine = 1", "engine must be a string, got 1"),
    ],
)
def test_a_simulation_key_of_the_wrong_type_is_one_line_naming_it(simulation: str, error: str, tmp_path: Path) -> None:
    from fedatoms.simulate import SimulationConfig

    config = tmp_path / "sim.toml"
    engine = "" if simulation.startswith("engine") else 'engine = "ray"\n'
    config.write_text(f'clients = 4\npartition = "iid"\n[simulation]\n{engine}{simulation}\n')
    with pytest.raises(ValueError, match=re.escape(error)):
        SimulationConfig.from_toml(config)
