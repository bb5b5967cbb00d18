"""A user's model end to end through the `fedatoms` commands: the client's allow-list, then the model back.

A real aggregator (in this process, on a loopback port) federates ``user_models:UserCNN`` on
the bundled digits; the client is a real ``fedatoms client run`` process. Refused first: its
default allow-list does not name ``user_models``, and the module (which records every process
importing it) must not have been imported by the client. Allowed, it trains two rounds; the
exported file, loaded by ``fedatoms.load_model``, must score on the server's test set exactly
what the server's own evaluation of that round stored, and ``fedatoms predict`` must print
the classes the loaded model gives images normalized as the digits loader normalizes them.
Once on PostgreSQL: the export reads the same rows there.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grpc_helpers import SECRET, Service, round_metric, start_aggregator
from image_folders import digits_probabilities, gray_pngs
from support import postgres_base, postgres_schema

from aggregator_service import store
from aggregator_service.config import FederationConfig
from client_agent.allowed_models import ModelNotAllowed
from fedatoms import load_model
from fedatoms.cli import main
from fedcore.data import load_dataset
from fedcore.training import evaluate

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def client_run(port: int, state_dir: Path, marker: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    env["FEDATOMS_TEST_IMPORT_MARKER"] = str(marker)
    cmd = [sys.executable, "-m", "fedatoms", "client", "run", "--server", f"127.0.0.1:{port}"]
    cmd += ["--enrollment-secret", SECRET, "--dataset", "digits", "--partition", "iid", "--num-partitions", "2"]
    cmd += ["--partition-index", "0", "--state-dir", str(state_dir), "--no-progress", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("factorization", "backend"), [("atoms", "sqlite"), ("none", "sqlite"), ("atoms", "postgres")])
def test_allow_list_then_export_load_and_predict(factorization, backend, tmp_path, capsys) -> None:
    with contextlib.ExitStack() as stack:
        if backend == "sqlite":
            url = f"sqlite:///{tmp_path / 'agg.db'}"
        else:
            url = stack.enter_context(postgres_schema(postgres_base()))

        def start_service(url: str, federation: FederationConfig, **settings: object) -> Service:
            service = start_aggregator(url, federation, **settings)
            stack.callback(service.stop)  # before the schema is dropped
            return service

        _federate_export_load_and_predict(url, factorization, tmp_path, start_service, capsys)


def _federate_export_load_and_predict(url: str, factorization: str, tmp_path, start_service, capsys) -> None:
    config = FederationConfig(
        model="user_models:UserCNN",
        model_args={"num_classes": 10, "in_channels": 1, "width": 8},
        num_classes=10,
        input_shape=[1, 8, 8],
        factorization=factorization,
        fraction=1.0,
        min_clients=1,
        rounds=2,
        batch_size=16,
        lr=0.05,
        local_epochs=2,
    )
    service = start_service(url, federation=config, eval_data="digits", poll_interval_seconds=0.1)
    marker = tmp_path / "imported-by"

    refused = client_run(service.port, tmp_path / "device", marker)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "'user_models:UserCNN' is not allowed" in refused.stderr and "--allow-model user_models" in refused.stderr
    assert not marker.exists(), "the client imported the model's module before checking its allow-list"

    allowed = client_run(service.port, tmp_path / "device", marker, "--allow-model", "user_models")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert marker.read_text().split() != [], "the allowed client built the model from its reference"

    out = tmp_path / "model.safetensors"
    assert main(["aggregator", "export", "--round", "2", str(out), "--database-url", url]) == 0
    with pytest.raises(ModelNotAllowed, match="user_models"):
        load_model(out)  # the zoo and torchvision only, unless the caller allows more
    model = load_model(out, allowed_models=["user_models"])
    assert type(model).__name__ == "UserCNN" and not model.training
    assert all(
        type(m).__name__ in ("Conv2d", "Linear") for m in model.modules() if hasattr(m, "weight") and m.weight.dim() > 1
    )
    test = load_dataset("digits")[1]
    assert evaluate(model, test, device="cpu").accuracy == round_metric(url, 2, store.RoundMetrics.test_accuracy)
    factorized = load_model(out, allowed_models=["user_models"], factorized=True)
    torch.testing.assert_close(factorized(test.x[:32]), model(test.x[:32]), rtol=1e-4, atol=1e-5)

    # predict: images written as 8-bit PNGs, read back the way `fedatoms predict` reads them
    paths = gray_pngs(tmp_path)
    capsys.readouterr()
    assert main(["predict", str(out), *map(str, paths), "--allow-model", "user_models"]) == 0
    printed = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    expected = digits_probabilities(model, test)  # under the normalization recorded because eval_data is digits
    assert [p[0] for p in printed] == [str(p) for p in paths]
    assert [int(p[1]) for p in printed] == expected.argmax(1).tolist()
    assert [float(p[2]) for p in printed] == pytest.approx(expected.max(1).values.tolist(), abs=1e-4)
