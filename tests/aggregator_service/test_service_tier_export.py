"""`fedatoms aggregator export --tier`: the model a small-tier device runs, as its own fetch hands it.

A real aggregator (in this process, on a loopback port) serves digits-cnn at tiers 1 and 1/4 over
SQLite; a tier-1/4 client fetches over gRPC and builds its model from what it received. The file a
`fedatoms aggregator export --tier 0.25` process writes must give that model's logits on the digits
test images, before any round (every cut still the initialization ``tier_init`` makes) and after
round 1, score what the server's own evaluation stored for the tier, and `fedatoms predict` with it
must print that model's classes. ``--tier 1`` is the plain export; a tier not served is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grpc_helpers import Client, register, round_metric, shards
from image_folders import digits_probabilities, gray_pngs
from safetensors import safe_open

from aggregator_service import store
from fedatoms import load_model
from fedcore.data import load_dataset
from fedcore.training import evaluate

ROOT = Path(__file__).resolve().parents[2]


def fedatoms(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fedatoms", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def export(url: str, out: Path, *tier: str) -> None:
    done = fedatoms("aggregator", "export", str(out), "--database-url", url, *tier)
    assert done.returncode == 0, done.stderr[-3000:]


def fetched_model(client: Client) -> torch.nn.Module:
    """The model the client trains and evaluates with: its tier's module holding what its fetch received."""
    model = client.spec.at_tier(client.tier).build()
    model.load_state_dict(client.state.global_tensors)
    return model.eval()


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def file_contents(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys()}


def test_tier_export_is_the_model_a_tier_client_fetches(start_service, sqlite_url, tmp_path) -> None:
    svc = start_service(sqlite_url, eval_data="digits")
    data = shards(2, 60)
    big, small = register(svc.stub, 1.0, data[0]), register(svc.stub, 0.25, data[1])
    test = load_dataset("digits")[1]
    inputs = test.x[:64]

    # round 0: the cut of the initial model, whose factors tier_init "energy" rescales
    small.fetch()
    initial = tmp_path / "initial-0.25.safetensors"
    export(sqlite_url, initial, "--tier", "1/4")
    with torch.no_grad():
        torch.testing.assert_close(
            load_model(initial, factorized=True)(inputs), fetched_model(small)(inputs), rtol=1e-4, atol=1e-5
        )

    for c in (big, small):
        _round, reply = c.round_trip()
        assert reply.accepted
    small.fetch()  # round 1's tensors, cut to the client's tier
    assert small.state.versions["conv2.coefficients_u"] == 1

    tiered, full, tier_one = (tmp_path / f"{n}.safetensors" for n in ("tier", "full", "tier-one"))
    export(sqlite_url, tiered, "--tier", "0.25")
    export(sqlite_url, full)
    export(sqlite_url, tier_one, "--tier", "1")
    assert file_contents(tier_one)[0] == file_contents(full)[0]
    one, whole = file_contents(tier_one)[1], file_contents(full)[1]
    assert one.keys() == whole.keys() and all(torch.equal(one[n], whole[n]) for n in whole)

    expected = fetched_model(small)
    factorized, plain, global_model = load_model(tiered, factorized=True), load_model(tiered), load_model(full)
    with torch.no_grad():
        want = expected(inputs)
        torch.testing.assert_close(factorized(inputs), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(plain(inputs), want, rtol=1e-4, atol=1e-4)  # filters and U V multiplied out
        assert not torch.allclose(global_model(inputs), want, atol=1e-3)  # the cut is another model
    assert parameters(factorized) < parameters(load_model(full, factorized=True))
    assert evaluate(factorized, test, device="cpu").accuracy == pytest.approx(
        round_metric(sqlite_url, 1, store.RoundMetrics.extra)["tier_accuracy"]["0.25"], abs=1e-9
    )

    # `fedatoms predict` runs the tier file: the classes the fetched model gives the same images
    paths = gray_pngs(tmp_path)
    predicted = fedatoms("predict", str(tiered), *map(str, paths))
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    printed = [line.split("\t") for line in predicted.stdout.splitlines()]
    probabilities = digits_probabilities(expected, test)  # under the normalization recorded with eval_data digits
    assert [p[0] for p in printed] == [str(p) for p in paths]
    assert [int(p[1]) for p in printed] == probabilities.argmax(1).tolist()
    assert [float(p[2]) for p in printed] == pytest.approx(probabilities.max(1).values.tolist(), abs=1e-4)


def test_a_tier_the_federation_does_not_serve_is_refused_in_one_line(start_service, sqlite_url, tmp_path) -> None:
    start_service(sqlite_url)  # tiers 1 and 1/4
    out = tmp_path / "model.safetensors"
    refused = fedatoms("aggregator", "export", str(out), "--database-url", sqlite_url, "--tier", "0.5")
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines() == [
        "fedatoms: error: federation 'default' serves no tier 0.5: its tiers are 1, 0.25"
    ]
    assert not out.exists()
