"""A federation of a model of token ids (``input_dtype = "int64"``: an ``nn.Embedding`` + LSTM on LongTensor ids,
the classic next-character use of federated learning): it trains in process, over gRPC with agents in their own
processes it gives the same record, and data of the other kind stops the command in one line naming the key."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from token_models import ids

from fedatoms.simulate import SimulationConfig, run_simulation

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
KEYS = dict(
    data="token_models:ids", model="token_models:lstm", input_shape=[8], input_dtype="int64",
    clients=4, fraction=1.0, partition="iid", rounds=3, lr=0.1,
)  # fmt: skip


@pytest.fixture(scope="module")
def local() -> dict:
    return run_simulation(SimulationConfig(**KEYS))


def test_a_token_id_model_learns_in_process(local: dict) -> None:
    _, test = ids()
    labels = test.tensors[1]
    majority = float(torch.bincount(labels).max()) / len(labels)
    rounds = local["rounds"]
    assert rounds[-1]["test_loss"] < rounds[0]["test_loss"]
    assert rounds[-1]["test_accuracy"] > majority + 0.15, (rounds[-1]["test_accuracy"], majority)


@pytest.mark.slow  # real CLI processes, tens of seconds: make test-slow
def test_over_grpc_the_command_gives_the_in_process_record(local: dict, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    cmd = [
        sys.executable, "-m", "fedatoms", "simulate", "--transport", "grpc", "--data", "token_models:ids",
        "--model", "token_models:lstm", "--input-shape", "8", "--input-dtype", "int64", "--clients", "4",
        "--fraction", "1", "--partition", "iid", "--rounds", "3", "--lr", "0.1", "--output", str(out),
        "--database-url", f"sqlite:///{tmp_path / 'a.db'}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    remote = json.loads(out.read_text())
    for a, b in zip(local["rounds"], remote["rounds"], strict=True):
        for key in ("test_accuracy", "test_loss", "local_accuracy"):
            assert math.isclose(a[key], b[key], rel_tol=1e-9), (key, a[key], b[key])


@pytest.mark.slow  # real CLI processes, tens of seconds: make test-slow
@pytest.mark.parametrize(
    ("data", "dtype", "said"),
    [
        ("token_models:ids", "float32", 'the model takes floating-point inputs (input_dtype = "float32")'),
        ("token_models:ids_as_floats", "int64", 'the model takes integer inputs (input_dtype = "int64")'),
    ],
)  # fmt: skip
def test_data_of_the_other_kind_stops_the_command_naming_input_dtype(data: str, dtype: str, said: str) -> None:
    model = "token_models:lstm" if dtype == "int64" else "token_models:mlp"
    cmd = [
        sys.executable, "-m", "fedatoms", "simulate", "--data", data, "--model", model, "--input-shape", "8",
        "--input-dtype", dtype, "--clients", "2", "--partition", "iid", "--rounds", "1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    assert said in proc.stderr, proc.stderr[-2000:]
