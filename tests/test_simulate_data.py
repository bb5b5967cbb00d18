"""`fedatoms simulate --data FOLDER`: an ImageFolder split across the virtual clients by --partition."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from image_folders import write_folder

import fedatoms
from fedatoms.simulate import SimulationConfig, run_simulation
from fedcore.data import labels_of
from fedcore.datasource import open_data

ROOT = Path(__file__).resolve().parents[1]


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


USER_NET = '''
import torch
from torch import nn


class Net(nn.Sequential):
    """A buffer with no elements (a model's placeholder), which broke FedLAMA's discrepancy per element."""

    def __init__(self, *layers):
        super().__init__(*layers)
        self.register_buffer("placeholder", torch.zeros(0))


def build(num_classes=10):
    """The user's own: a conv with BatchNorm, one conv module applied twice (a reused module, whose two paths
    the spec once missed), then a linear head (12x12 RGB pictures)."""
    shared = nn.Conv2d(8, 8, 3, padding=1)
    return Net(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), shared, nn.ReLU(), shared, nn.Flatten(),
        nn.Linear(8 * 10 * 10, num_classes)
    )
'''


def test_simulate_over_grpc_runs_the_users_own_model_and_leaves_no_temporary_directory(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agents the simulation starts import the model its command names (it is the user's code, not a
    server's choice), and the run's temporary directory is gone afterwards. The model has the shapes users
    have: a reused module, an empty buffer; both stopped a run before."""
    (tmp_path / "user_net.py").write_text(USER_NET)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    cmd = [
        sys.executable, "-m", "fedatoms", "simulate", "--transport", "grpc", "--data", str(folder),
        "--model", "user_net:build", "--input-shape", "3,12,12", "--clients", "2", "--fraction", "1",
        "--rounds", "1", "--partition", "iid", "--output", str(tmp_path / "out.json"),
        "--save-model", str(tmp_path / "model.safetensors"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "TMPDIR": str(scratch)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "out.json").read_text())["rounds"][0]["round"] == 1
    assert not list(scratch.glob("fedatoms-sim-*"))
    monkeypatch.syspath_prepend(str(tmp_path))
    model = fedatoms.load_model(tmp_path / "model.safetensors", allowed_models=["user_net"])
    assert model[3] is model[5]  # the reused module is one module in the model a user gets back


@pytest.mark.parametrize(
    ("clients", "said"),
    [
        (5, r"127\.0\.0\.1"),  # no database answers there: the aggregator cannot start
        (2, "shards need num_clients"),  # 2 × 2 classes cannot cover 10: refused before the aggregator starts
    ],
)
def test_a_failed_simulation_over_grpc_removes_its_temporary_directory(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clients: int, said: str
) -> None:
    from fedatoms.simulate_grpc import run_grpc_simulation

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = SimulationConfig(data=str(folder), model="digits-cnn", clients=clients, rounds=1, transport="grpc")
    with pytest.raises(Exception, match=said):
        run_grpc_simulation(config, database_url="postgresql+psycopg://nobody@127.0.0.1:9/none")
    assert not list(tmp_path.glob("fedatoms-sim-*"))


def test_an_unreadable_image_is_named_in_one_line(tmp_path: Path) -> None:
    pictures = write_folder(tmp_path / "pictures", channels=3, size=12, count=60)
    good = next((pictures / "3").glob("*.png"))
    broken = pictures / "3" / "truncated.png"
    broken.write_bytes(good.read_bytes()[:100])  # a PNG cut short, as a failed copy leaves it
    cmd = [sys.executable, "-m", "fedatoms", "simulate", "--data", str(pictures), "--model", "digits-cnn",
           "--clients", "2", "--partition", "iid", "--rounds", "1", "--output", str(tmp_path / "out.json")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{broken}: cannot read this image" in errors[0]


def test_client_state_from_another_database_is_refused_in_one_line(tmp_path: Path) -> None:
    """--state-dir kept from a run on another database holds tokens this aggregator never issued: the run
    says so before any worker starts (it was a traceback from a worker's first GetTask)."""
    keys = dict(model="digits-cnn", clients=2, fraction=1.0, partition="iid", rounds=1, transport="grpc")
    state = str(tmp_path / "clients")
    run_simulation(SimulationConfig(**keys), database_url=f"sqlite:///{tmp_path / 'a.db'}", state_dir=state)
    with pytest.raises(ValueError, match="does not know this client") as info:
        run_simulation(SimulationConfig(**keys), database_url=f"sqlite:///{tmp_path / 'b.db'}", state_dir=state)
    assert "client-000000" in str(info.value) and "give a new --state-dir" in str(info.value)


def test_a_refused_run_says_what_it_kept_in_its_state_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A rerun on a --state-dir whose database holds another federation's method is refused; what the directory
    holds is the user's, and the run says it kept it, as a finished run does."""
    keys = dict(model="digits-cnn", clients=2, fraction=1.0, partition="iid", rounds=1, transport="grpc")
    state = tmp_path / "state"
    run_simulation(SimulationConfig(**keys), state_dir=str(state))
    capsys.readouterr()
    with pytest.raises(ValueError, match="lr"):
        run_simulation(SimulationConfig(**keys, lr=0.5), state_dir=str(state))
    said = capsys.readouterr().err
    assert (
        f"kept: client state in {state}" in said and f"kept: the database sqlite:///{state / 'aggregator.db'}" in said
    )
    assert (state / "aggregator.db").is_file()


def test_a_benchmark_simulation_records_the_normalization_its_loader_applies() -> None:
    """The digits loader maps raw pixel 0 to its minimum and 16/16 to its maximum: the (mean, std) it used,
    derived from its output, is what the federation records (and an export carries); another is refused."""
    from aggregator_service.config import AggregatorSettings, FederationConfig
    from fedcore.data import load_dataset

    train, _ = load_dataset("digits")
    std = 1.0 / float(train.x.max() - train.x.min())
    mean = -float(train.x.min()) * std
    recorded = SimulationConfig(dataset="digits").normalization
    assert recorded is not None
    assert recorded["mean"] == pytest.approx([mean], abs=1e-6) and recorded["std"] == pytest.approx([std], abs=1e-6)
    assert SimulationConfig(dataset="mnist", data_dir="/nonexistent").normalization == {
        "mean": [0.1307],
        "std": [0.3081],
    }
    with pytest.raises(ValueError, match="differs from digits's own"):
        SimulationConfig(dataset="digits", normalization={"mean": [0.5], "std": [0.5]})
    served = AggregatorSettings(eval_data="digits").federation.normalization
    assert served == recorded
    with pytest.raises(ValueError, match="differs from digits's own"):
        AggregatorSettings(eval_data="digits", federation=FederationConfig(normalization={"mean": [0.5], "std": [0.5]}))
    assert AggregatorSettings().federation.normalization is None  # no benchmark named: nothing assumed
