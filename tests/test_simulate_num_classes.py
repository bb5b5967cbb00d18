"""`simulate --data` with a set num_classes: a head wider than the training labels (a vocabulary whose top ids
never occur as targets) is kept, not overwritten by the labels' largest + 1; a label it cannot score is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedatoms.simulate import SimulationConfig, run_simulation

ROOT = Path(__file__).resolve().parents[1]

TOKENS = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset


def data():
    """Labels 0..2 only, of a model that scores 5 classes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return TensorDataset(x[:96], y[:96]), TensorDataset(x[96:], y[96:])


def build(num_classes=5):
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, num_classes))
'''

KEYS = dict(data="tokens:data", model="tokens:build", input_shape=[6], clients=2, fraction=1.0, partition="iid")


@pytest.fixture
def tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "tokens.py").write_text(TOKENS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_set_num_classes_wider_than_the_labels_is_kept_and_trains(tokens: Path) -> None:
    with pytest.raises(ValueError, match="not 3 class scores"):  # unset: the largest training label + 1
        SimulationConfig(**KEYS)
    assert SimulationConfig(**KEYS, model_args={"num_classes": 5}).num_classes == 5  # the model's own
    config = SimulationConfig(**KEYS, num_classes=5, rounds=1)
    assert config.num_classes == 5 and config.spec.num_classes == 5
    record = run_simulation(config)
    assert record["config"]["num_classes"] == 5
    assert 0.0 <= record["rounds"][-1]["test_accuracy"] <= 1.0


def test_a_training_label_the_set_num_classes_cannot_score_is_refused_by_name(tokens: Path) -> None:
    with pytest.raises(ValueError, match=r"training label 2 but num_classes = 2.*at least 3 \(--num-classes") as info:
        SimulationConfig(**KEYS, num_classes=2, model_args={"num_classes": 2})
    assert "\n" not in str(info.value)


@pytest.mark.slow  # real CLI processes, tens of seconds: make test-slow
def test_the_cli_keeps_num_classes_from_the_toml_and_the_flag(tokens: Path) -> None:
    toml = tokens / "sim.toml"
    toml.write_text(
        'data = "tokens:data"\nmodel = "tokens:build"\ninput_shape = [6]\nnum_classes = 5\nclients = 2\n'
        'fraction = 1.0\npartition = "iid"\nrounds = 1\n'
    )
    env = {"PYTHONPATH": f"{tokens}:{ROOT}", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = tokens / "out.json"
    run = [sys.executable, "-m", "fedatoms", "simulate", "--config", str(toml), "--output", str(out)]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300, env=env, cwd=tokens)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["config"]["num_classes"] == 5

    proc = subprocess.run([*run[:-2], "--num-classes", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "training label 2 but num_classes = 2" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
