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


def _push_control(service, client, round_: int, value: float):
    """The model unchanged at zero, and a control delta of ``value`` for every trainable tensor."""
    trainable = [t for t in client.spec.tensors if t.role != "buffer"]
    entries = [(t.name, torch.zeros(t.shape), 0, pb.TENSOR_KIND_MODEL) for t in client.spec.tensors]
    entries += [(t.name, torch.full(t.shape, value), round_, pb.TENSOR_KIND_CONTROL_DELTA) for t in trainable]
    header = pb.PushHeader(round=round_, update_id=f"r{round_}", num_samples=len(client.data))
    return framing.push_update(service.channel)(framing.push_messages(header, entries), metadata=client.auth)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_revoked_clients_control_stays_in_the_mean_over_every_client_enrolled(start_service, request, backend):
    """SCAFFOLD's ``c = (1/N) Σ_i c_i`` is over the clients the federation enrolled, the paper's m: a revoked
    client is one never sampled again, its ``c_i`` still in the sum. By hand: in round 1 three clients report
    Δc = 1, so c = 3/3 = 1; one is revoked, and in round 2 the other two report Δc = 0: c stays 3/3 = 1, where
    dividing the sum by the two left read 1.5."""
    from support import wait_until

    from aggregator_service.export import revoke

    url = request.getfixturevalue(f"{backend}_url")
    federation = small_federation(strategy="scaffold", factorization="none", tiers=[1.0], min_clients=2, rounds=3)
    service = start_service(url, federation)
    a, b, c = (register(service.stub, 1.0, d) for d in shards(3))

    def control() -> torch.Tensor:
        return service.coordinator.federation.strategy.server_control(a.spec)["head.bias"]

    def closed() -> int:
        return service.stub.Heartbeat(pb.HeartbeatRequest(), metadata=a.auth).last_closed_round

    for round_, cohort, value in ((1, (a, b, c), 1.0), (2, (a, b), 0.0)):
        for client in cohort:
            assert client.task().train.round == round_
        for client in cohort:
            assert _push_control(service, client, round_, value).accepted
        assert wait_until(lambda r=round_: closed() == r, timeout=60)
        torch.testing.assert_close(control(), torch.ones(10))
        if round_ == 1:
            revoke(url, c.client_id)
