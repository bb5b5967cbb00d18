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


@pytest.fixture(scope="module")
def three_digits(tmp_path_factory) -> Path:
    """The walk-through's data: digits 0–2 as 32×32 RGB PNGs, one subfolder per class."""
    from image_folders import digits_images

    root = tmp_path_factory.mktemp("bn") / "pictures"
    images, labels = digits_images(3, 32)
    for i, (pic, label) in enumerate(zip(images, labels, strict=True)):
        if label < 3:
            (root / str(label)).mkdir(parents=True, exist_ok=True)
            pic.save(root / str(label) / f"{i:05d}.png")
    return root


def test_a_batchnorm_model_learns_over_grpc_in_eval_mode(three_digits: Path, tmp_path: Path) -> None:
    """torchvision's MobileNetV3 at 32×32 (maps of 1×1 in its last blocks): with the statistics clients recompute
    for their trained weights the global model classifies in eval mode after two rounds; with PyTorch's running
    averages, averaged as they are, it stays near chance (1/3) on the same split and seed."""
    keys = dict(
        data=str(three_digits),
        model="torchvision.models:mobilenet_v3_small",
        model_args={"num_classes": 3},
        input_shape=[3, 32, 32],
        factorization="atoms-lowrank",
        tiers=[1.0, 0.25, 0.125],
        clients=3,
        fraction=1.0,
        partition="iid",
        rounds=2,
    )
    precise = run_simulation(
        SimulationConfig(transport="grpc", **keys), database_url=f"sqlite:///{tmp_path / 'bn.db'}", workers=2
    )
    running = run_simulation(SimulationConfig(bn_statistics="running", **keys))
    best_precise = max(r["test_accuracy"] for r in precise["rounds"])
    best_running = max(r["test_accuracy"] for r in running["rounds"])
    assert best_precise >= 0.7, best_precise
    assert best_running < best_precise - 0.25, (best_running, best_precise)
