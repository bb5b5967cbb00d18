"""Every zoo model closes a round over real gRPC, BatchNorm's 0-d ``num_batches_tracked`` included.

Two clients train on small synthetic images shaped for the model and push through a real
server on a real database; the round must close, and the stored global model must equal the
in-process engine's fold of the same two pushes (the oracle computed without the service),
with every tensor keeping its rank — a 0-d buffer stays 0-d.
"""

from __future__ import annotations

import pytest
import torch
from grpc_helpers import fill_keys, global_tensors, offline_round, register, small_federation
from support import wait_until

from fedcore.data import ArrayDataset
from fedcore.models import MODELS


def synthetic(shape: tuple[int, int, int], n: int, seed: int, num_classes: int) -> ArrayDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, num_classes, (n,), generator=g)
    return ArrayDataset(x, y, num_classes, "synthetic")


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_zoo_model_closes_a_round(model, backend, request, start_service) -> None:
    url = request.getfixturevalue(f"{backend}_url")
    info = MODELS[model]
    config = small_federation(model=model, num_classes=info.default_classes, batch_size=8, rounds=2)
    service = start_service(url, federation=config)
    clients = [
        register(service.stub, tier, synthetic(info.input_shape, 16, seed, info.default_classes))
        for seed, tier in enumerate((1.0, 0.25))
    ]
    fill_keys(url, clients)
    assert clients[0].task().WhichOneof("kind") == "train"
    plan = service.coordinator.open_round
    assert plan is not None and plan.round == 1
    for c in clients:
        round_, reply = c.round_trip()
        assert round_ == 1 and not reply.duplicate

    def next_round_open() -> bool:
        kind = clients[0].task().WhichOneof("kind")
        return kind == "train" and clients[0].task().train.round == 2

    assert wait_until(next_round_open, timeout=60), "round 1 did not close"

    oracle = offline_round(config, plan, clients, num_clients_total=2).global_tensors
    stored = global_tensors(url)
    assert set(stored) == set(oracle)
    if model == "resnet18":
        assert any(oracle[n].dim() == 0 for n in oracle), "resnet18's BatchNorm has 0-d num_batches_tracked buffers"
    for name, expected in oracle.items():
        got, version = stored[name]
        assert tuple(got.shape) == tuple(expected.shape), name
        assert version == 1, name
        torch.testing.assert_close(got.to(expected.dtype), expected, rtol=0, atol=0, msg=name)
