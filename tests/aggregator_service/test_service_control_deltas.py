"""SCAFFOLD's control deltas over the wire: every trainable tensor's Δc, or the push is refused and nothing stored.

The server's mean of the controls averages each client's Δc for every tensor; a push with some of them missing
(a client bug, or a stream cut where a tensor ends that gRPC ended as if finished) would leave the server's
controls out of step with the client's. Zeros are valid values: what is checked is which names arrive.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_helpers import register, shards, small_federation

from aggregator_service import store
from fedwire import framing
from fedwire.v1 import aggregator_pb2 as pb


def _push(service, client, round_: int, update_id: str, deltas: list[str] | None):
    trainable = [t for t in client.spec.tensors if t.role != "buffer"]
    entries = [
        (t.name, torch.zeros(t.shape, dtype=getattr(torch, t.dtype)), 0, pb.TENSOR_KIND_MODEL)
        for t in client.spec.tensors
    ]
    by_name = {t.name: t for t in trainable}
    entries += [
        (n, torch.zeros(by_name[n].shape, dtype=getattr(torch, by_name[n].dtype)), round_, pb.TENSOR_KIND_CONTROL_DELTA)
        for n in deltas or []
    ]
    header = pb.PushHeader(round=round_, update_id=update_id, num_samples=len(client.data))
    return framing.push_update(service.channel)(framing.push_messages(header, entries), metadata=client.auth)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_control_deltas_are_all_or_refused(start_service, request, backend) -> None:
    url = request.getfixturevalue(f"{backend}_url")
    federation = small_federation(strategy="scaffold", factorization="none", tiers=[1.0], min_clients=2)
    service = start_service(url, federation)
    a, _ = (register(service.stub, 1.0, d) for d in shards(2))
    round_ = a.task().train.round
    trainable = [t.name for t in a.spec.tensors if t.role != "buffer"]
    assert len(trainable) >= 2

    refusals = [
        (None, "SCAFFOLD needs the control deltas"),
        (trainable[:-1], f"missing control delta(s) '{trainable[-1]}'"),
    ]
    for i, (deltas, message) in enumerate(refusals):
        with pytest.raises(grpc.RpcError) as info:
            _push(service, a, round_, f"bad-{i}", deltas)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert message in info.value.details()
    with store.session_factory(store.create_engine_for(url))() as s:
        assert store.count_updates(s, store.get_federation(s, "default"), round_) == 0

    reply = _push(service, a, round_, "good", trainable)
    assert reply.accepted and not reply.duplicate


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_control_deltas_without_scaffold_are_refused(start_service, request, backend) -> None:
    url = request.getfixturevalue(f"{backend}_url")
    service = start_service(url, small_federation(factorization="none", tiers=[1.0], min_clients=2))
    a, _ = (register(service.stub, 1.0, d) for d in shards(2))
    round_ = a.task().train.round
    with pytest.raises(grpc.RpcError) as info:
        _push(service, a, round_, "deltas", [t.name for t in a.spec.tensors if t.role != "buffer"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "control deltas are only accepted when the federation's strategy is SCAFFOLD" in info.value.details()
    with store.session_factory(store.create_engine_for(url))() as s:
        assert store.count_updates(s, store.get_federation(s, "default"), round_) == 0
