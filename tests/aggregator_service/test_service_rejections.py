"""Every way a request is refused, with its status code and message, and the database untouched after each."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_helpers import SECRET, Client, register, shards, snapshot

from aggregator_service import store
from fedcore import codec
from fedcore.tiers import training_memory
from fedwire import framing
from fedwire.v1 import aggregator_pb2 as pb


@pytest.fixture
def round_one(start_service, sqlite_url) -> tuple[Any, Client, Client, dict[str, np.ndarray]]:
    """Round 1 open for a tier-1/4 client ``a`` and a tier-1 client ``b``; ``a`` trained, not pushed yet."""
    svc = start_service(sqlite_url)
    data = shards(3, 60)
    a, b = register(svc.stub, 0.25, data[0]), register(svc.stub, 1.0, data[1])
    task = a.task()
    assert task.WhichOneof("kind") == "train"
    a.fetch()
    push = a.train(task)
    return svc, a, b, {n: t.numpy() for n, t in push.tensors.items()}


def _refused(url: str, code: grpc.StatusCode, fragment: str, call: Callable[[], Any]) -> str:
    before = snapshot(url)
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == code, err.details()
    assert fragment in err.details(), err.details()
    assert snapshot(url) == before, f"database changed after a refused call: {err.details()}"
    return err.details()


def test_authentication_failures_are_unauthenticated(round_one) -> None:
    svc, a, _, tensors = round_one
    stub, url = svc.stub, svc.url
    U = grpc.StatusCode.UNAUTHENTICATED
    _refused(url, U, "missing bearer token", lambda: stub.GetTask(pb.GetTaskRequest()))
    _refused(
        url, U, "unknown token", lambda: stub.GetTask(pb.GetTaskRequest(), metadata=(("authorization", "Bearer nope"),))
    )
    _refused(
        url,
        U,
        "expected 'Bearer <token>'",
        lambda: stub.Heartbeat(pb.HeartbeatRequest(), metadata=(("authorization", a.token),)),
    )
    bad = Client(stub, a.client_id, "forged", a.tier, a.spec, a.data)
    _refused(url, U, "unknown token", lambda: bad.push(1, tensors))
    _refused(url, U, "unknown token", lambda: list(bad.stub.FetchModel(pb.FetchRequest(), metadata=bad.auth)))
    # wrong enrollment secret
    _refused(url, U, "wrong enrollment secret", lambda: register(stub, 1.0, a.data, secret="guess"))
    # revoked token: the client's next call is refused, whatever it is
    engine = store.create_engine_for(url)
    with store.session_factory(engine).begin() as s:
        assert store.revoke_client(s, a.client_id)
    engine.dispose()
    _refused(url, U, "token revoked", a.task)
    _refused(url, U, "token revoked", lambda: a.push(1, tensors))


def test_invalid_tensors_are_refused_and_nothing_is_stored(round_one) -> None:
    svc, a, _, good = round_one
    url = svc.url
    inv = grpc.StatusCode.INVALID_ARGUMENT

    def variant(**changes: Any) -> dict[str, np.ndarray]:
        out = dict(good)
        for name, value in changes.items():
            name = name.replace("__", ".")
            if value is None:
                out.pop(name)
            else:
                out[name] = value
        return out

    u = good["conv2.coefficients_u"]
    nan, inf = u.copy(), u.copy()
    nan[0, 0], inf[3, 2] = np.nan, np.inf
    cases = [
        (
            "wrong shape for the tier",
            "does not match (64, 16)",
            variant(conv2__coefficients_u=np.zeros((64, 64), "f4")),
        ),
        ("unknown tensor", "unknown tensor", {**good, "conv9.weight": np.zeros(3, "f4")}),
        ("NaN", "NaN or Inf", variant(conv2__coefficients_u=nan)),
        ("Inf", "NaN or Inf", variant(conv2__coefficients_u=inf)),
        ("wrong dtype", "dtype float64, expected float32", variant(head__bias=good["head.bias"].astype("f8"))),
        ("int dtype", "dtype int64", variant(head__bias=np.zeros(10, "i8"))),
        ("missing due tensor", "missing due tensor", variant(head__weight=None)),
    ]
    for batched in (False, True):  # one chunk per message, and packed in batches as client_agent sends them
        a.batched = batched
        for label, fragment, tensors in cases:
            details = _refused(url, inv, fragment, lambda t=tensors: a.push(1, t))
            assert "'" in details, f"{label}: the message names no tensor: {details}"
    # float16 payloads are accepted and upcast
    half = {n: t.astype("f2") for n, t in good.items()}
    reply = a.push(1, half)
    assert reply.accepted and not reply.duplicate


def test_round_and_cohort_preconditions(round_one, caplog) -> None:
    svc, a, _, good = round_one
    url = svc.url
    fp = grpc.StatusCode.FAILED_PRECONDITION
    with caplog.at_level(logging.WARNING, logger="fedatoms.aggregator"):
        _refused(url, fp, "round 7 is not open", lambda: a.push(7, good))
    # a round not opened yet: no straggler's late push (the operator reads the log for those)
    assert [r.getMessage().split()[0] for r in caplog.records if "push_refused" in r.getMessage()] == [
        "event=early_push_refused"
    ]
    late = register(svc.stub, 0.25, a.data)  # registered after round 1 opened: not in its cohort
    assert late.task().wait.reason == "not selected for round 1"
    _refused(url, fp, "not in round 1's cohort", lambda: late.push(1, good))
    inv = grpc.StatusCode.INVALID_ARGUMENT
    _refused(
        url, inv, "first PushMessage must carry the PushHeader", lambda: a.stub.PushUpdate(iter([]), metadata=a.auth)
    )
    _refused(url, inv, "update_id", lambda: a.push(1, good, update_id="has space"))
    _refused(url, inv, "num_samples", lambda: a.push(1, good, num_samples=0))
    _refused(url, inv, "metric 'loss'", lambda: a.push(1, good, metrics={"loss": float("nan")}))


def test_oversized_push_is_resource_exhausted(round_one) -> None:
    svc, a, _, good = round_one
    huge = {**good, "head.weight": np.zeros((svc.settings.push_limit // 4 + 1,), "f4")}
    for batched in (False, True):
        a.batched = batched
        _refused(svc.url, grpc.StatusCode.RESOURCE_EXHAUSTED, "too large", lambda: a.push(1, huge))
    # one chunk over the wire's 1 MiB rule, though within gRPC's message limit
    big = np.zeros(codec.CHUNK_BYTES // 4 + 1, "f4")
    chunks = codec.iter_chunks("head.weight", codec.encode(big), chunk_bytes=codec.CHUNK_BYTES + 4)
    header = pb.PushHeader(round=1, update_id=uuid.uuid4().hex, num_samples=10)
    messages = [pb.PushMessage(header=header)] + [pb.PushMessage(chunk=framing.from_chunk(c)) for c in chunks]
    _refused(
        svc.url,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "exceeds the 1048576-byte chunk limit",
        lambda: a.stub.PushUpdate(iter(messages), metadata=a.auth),
    )


def test_duplicate_update_id_is_acknowledged_and_counted_once(round_one) -> None:
    svc, a, b, good = round_one
    update_id = uuid.uuid4().hex
    first = a.push(1, good, update_id=update_id)
    assert first.accepted and not first.duplicate
    state = snapshot(svc.url)
    assert state["updates"] == 1
    again = a.push(1, good, update_id=update_id)
    assert again.accepted and again.duplicate and again.round == 1
    assert snapshot(svc.url) == state  # counted once, transfer bytes included
    # a second, different update for the same round is refused
    _refused(svc.url, grpc.StatusCode.FAILED_PRECONDITION, "already pushed", lambda: a.push(1, good))
    assert a.task().wait.reason == "round 1 update received; waiting for the round to close"
    _, reply = b.round_trip()
    assert reply.accepted and svc.coordinator.open_round is None
    # the round has closed: a retry (its acknowledgement lost) is still answered as the duplicate it is
    closed = snapshot(svc.url)
    retry = a.push(1, good, update_id=update_id)
    assert (retry.accepted, retry.duplicate, retry.round) == (True, True, 1)
    assert retry.message == "duplicate of an update consumed by round 1"
    assert snapshot(svc.url) == closed  # not counted again, not a late push
    # ... but another update for the closed round is a late push: refused, and counted in late_pushes
    with pytest.raises(grpc.RpcError) as info:
        a.push(1, good)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "round 1 is not open" in info.value.details()
    after = snapshot(svc.url)
    assert after["rounds"][0] == (*closed["rounds"][0][:4], 1)
    assert {**after, "rounds": after["rounds"][1:]} == {**closed, "rounds": closed["rounds"][1:]}
    # ids are remembered until the next round closes: then the retry is refused like any late push
    for c in (a, b):
        assert c.round_trip()[1].accepted
    assert svc.coordinator.federation.round == 2
    with pytest.raises(grpc.RpcError) as info:
        a.push(1, good, update_id=update_id)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert snapshot(svc.url)["rounds"][0] == (*closed["rounds"][0][:4], 2)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
@pytest.mark.parametrize(
    "profile",
    [
        {"compute_macs": float("nan")},
        {"compute_macs": float("inf")},
        {"uplink_bps": float("nan")},
        {"downlink_bps": -1.0},
        {"memory_bytes": -5},
    ],
    ids=["macs-nan", "macs-inf", "uplink-nan", "downlink-negative", "memory-negative"],
)
def test_an_impossible_profile_is_invalid_argument(start_service, request, backend, profile) -> None:
    svc = start_service(request.getfixturevalue(f"{backend}_url"))
    field = next(iter(profile))
    message = pb.RegisterRequest(
        profile=pb.CapabilityProfile(device_name="edge", num_samples=10, **profile), enrollment_secret=SECRET
    )
    details = _refused(svc.url, grpc.StatusCode.INVALID_ARGUMENT, field, lambda: svc.stub.Register(message))
    assert "finite number ≥ 0" in details


def _trained_not_pushed(svc: Any) -> tuple[Client, dict[str, np.ndarray]]:
    """A tier-1 client of round 1 with its trained update, not pushed; a tier-¼ client beside it, so the push
    closes nothing."""
    data = shards(2, 60)
    a, _ = register(svc.stub, 1.0, data[0]), register(svc.stub, 0.25, data[1])
    task = a.task()
    a.fetch()
    return a, {n: t.numpy() for n, t in a.train(task).tensors.items()}


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_an_update_weighs_no_more_than_its_client_registered(start_service, request, backend) -> None:
    """num_samples = 2^63 − 1 from a client registered with 60 samples would own the average: refused."""
    svc = start_service(request.getfixturevalue(f"{backend}_url"))
    a, tensors = _trained_not_pushed(svc)
    for claim in (2**63 - 1, 61):
        _refused(
            svc.url,
            grpc.StatusCode.INVALID_ARGUMENT,
            "registered with",
            lambda c=claim: a.push(1, tensors, num_samples=c),
        )
    assert a.push(1, tensors, num_samples=60).accepted  # exactly what it registered


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_registration_caps_the_declared_sample_count(start_service, request, backend) -> None:
    svc = start_service(request.getfixturevalue(f"{backend}_url"), max_client_samples=1000)
    message = pb.RegisterRequest(
        profile=pb.CapabilityProfile(device_name="edge", num_samples=1001), enrollment_secret=SECRET
    )
    _refused(svc.url, grpc.StatusCode.INVALID_ARGUMENT, "max_client_samples = 1000", lambda: svc.stub.Register(message))
    ok = pb.RegisterRequest(
        profile=pb.CapabilityProfile(device_name="edge", num_samples=1000), enrollment_secret=SECRET
    )
    assert svc.stub.Register(ok).client_id


def test_the_tier_fits_the_federations_batch(start_service, sqlite_url) -> None:
    """Enrollment counts the tier's training memory in the federation's batches (here 32, and nested: tier 1
    of tiers 1 and ¼ takes two passes a step): a device declaring that figure gets the tier, one byte
    less the next, and below the smallest tier's it is refused with the batch named."""
    svc = start_service(sqlite_url)
    config = svc.coordinator.shared.config
    assert config.batch_size == 32 and config.nested_rank_ratio == 0.25
    need = {g: training_memory(config.spec.at_tier(g), 32, 0.25) for g in (1.0, 0.25)}
    per_sample, _ = config.spec.at_tier(0.25).activation_bytes
    assert need[0.25] > config.spec.at_tier(0.25).num_parameters * 16 + 31 * per_sample  # a batch's activations
    for memory, tier in ((need[1.0], 1.0), (need[1.0] - 1, 0.25), (need[0.25], 0.25)):
        message = pb.RegisterRequest(
            profile=pb.CapabilityProfile(device_name="edge", num_samples=10, memory_bytes=memory),
            enrollment_secret=SECRET,
        )
        assert svc.stub.Register(message).tier == tier
    message = pb.RegisterRequest(
        profile=pb.CapabilityProfile(device_name="edge", num_samples=10, memory_bytes=need[0.25] - 1),
        enrollment_secret=SECRET,
    )
    details = _refused(svc.url, grpc.StatusCode.FAILED_PRECONDITION, "no tier", lambda: svc.stub.Register(message))
    assert "in batches of 32" in details


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_blank_metric_name_a_round_0_report_and_a_near_tier_are_refused_by_name(start_service, request, backend):
    """Three refusals a hostile sweep found unclear: a metric named "" was stored and averaged under "", a
    report for round 0 (the initial model, which no round closes) was told to wait for its close, and a
    preferred tier of 0.25000000001 was printed as 0.25, "not one of 1, 0.25"."""
    svc = start_service(request.getfixturevalue(f"{backend}_url"))
    a, tensors = _trained_not_pushed(svc)
    for blank in ("", " "):
        _refused(
            svc.url,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"metric name {blank!r} is blank",
            lambda b=blank: a.push(1, tensors, metrics={"train_loss": 0.5, b: 1.0}),
        )
    report = pb.EvaluationReport(round=0, global_accuracy=0.5, global_loss=1.0, num_samples=10)
    _refused(
        svc.url,
        grpc.StatusCode.INVALID_ARGUMENT,
        "round must be ≥ 1",
        lambda: svc.stub.ReportEvaluation(report, metadata=a.auth),
    )
    near = pb.RegisterRequest(
        profile=pb.CapabilityProfile(device_name="edge", num_samples=10, preferred_tier=0.25000000001),
        enrollment_secret=SECRET,
    )
    _refused(
        svc.url,
        grpc.StatusCode.INVALID_ARGUMENT,
        "preferred tier 0.25000000001 is not one of",
        lambda: svc.stub.Register(near),
    )
    assert a.push(1, tensors, metrics={"train_loss": 0.5}).accepted


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_fetch_listing_more_versions_than_the_model_has_tensors_is_refused(start_service, request, backend):
    """``held`` was bounded only by gRPC's message limit: a 4 MB list of names cost the server a second a call.
    A client holds at most its tier model's tensors; as many unknown names as that are still ignored."""
    svc = start_service(request.getfixturevalue(f"{backend}_url"))
    a, _ = _trained_not_pushed(svc)
    count = len(a.spec.tensors)
    unknown = [pb.TensorVersion(name=f"no.such.{i}", version=1) for i in range(count + 1)]
    _refused(
        svc.url,
        grpc.StatusCode.INVALID_ARGUMENT,
        f"FetchRequest.held lists {count + 1} versions; a client of tier 1 holds at most its model's {count}",
        lambda: list(a.stub.FetchModel(pb.FetchRequest(held=unknown), metadata=a.auth)),
    )
    names = set()
    for batch in a.stub.FetchModel(pb.FetchRequest(held=unknown[:count]), metadata=a.auth):
        names.update(chunk.name for chunk in batch.chunks)
    assert names == {t.name for t in a.spec.tensors}  # unknown names ignored: the whole model came
