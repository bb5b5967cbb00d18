"""`fedatoms simulate --data FOLDER`: an ImageFolder split across the virtual clients by --partition."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from image_folders import write_folder

from fedatoms.simulate import SimulationConfig, run_simulation
from fedcore.data import labels_of
from fedcore.datasource import open_data


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("sim") / "pictures", channels=3, size=12, count=600)


def test_shards_give_every_client_two_classes_of_the_folders_training_split(folder: Path) -> None:
    config = SimulationConfig(data=str(folder), model="digits-cnn", clients=5, partition="shards", rounds=1)
    assert config.num_classes == 10  # the folder's classes
    clients = config.population().build()
    train, _ = open_data(str(folder))
    held = [labels_of(vc.train) for vc in clients]
    assert sum(len(y) for y in held) == len(train)  # every training image lands with exactly one client
    assert all(len(np.unique(y)) == 2 for y in held)
    x, label = clients[0].train[0]
    assert tuple(x.shape) == (1, 8, 8) and 0 <= label < 10  # RGB 12×12 pictures, as the model takes them


def test_a_folder_simulation_over_grpc_gives_the_in_process_record(folder: Path, tmp_path: Path) -> None:
    keys = dict(data=str(folder), model="digits-cnn", clients=4, partition="iid", rounds=2, fraction=1.0)
    local = run_simulation(SimulationConfig(**keys))
    remote = run_simulation(
        SimulationConfig(transport="grpc", **keys), database_url=f"sqlite:///{tmp_path / 'a.db'}", workers=2
    )
    for a, b in zip(local["rounds"], remote["rounds"], strict=True):
        for key in ("test_accuracy", "test_loss", "local_accuracy"):
            assert math.isclose(a[key], b[key], rel_tol=1e-9), (key, a[key], b[key])
    assert local["rounds"][-1]["test_accuracy"] > 0.3  # ten classes: chance is 0.1


def test_cli_config_takes_data_and_a_folder_needs_a_model(folder: Path, tmp_path: Path) -> None:
    config = tmp_path / "sim.toml"
    config.write_text(f'data = "{folder}"\nmodel = "digits-cnn"\nclients = 3\nrounds = 1\npartition = "dirichlet"\n')
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "fedatoms", "simulate", "--config", str(config), "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["config"]["data"] == str(folder)
    assert f"on {folder}" in proc.stdout

    proc = subprocess.run(
        [sys.executable, "-m", "fedatoms", "simulate", "--data", str(folder)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "needs --model" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
