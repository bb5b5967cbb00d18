"""Bounds on what one enrolled client's update can do to the global model, over real gRPC, SQLite and PostgreSQL.

Every update here is made by hand around the global model the test reads from the database, so the
expected outcome follows from the bound alone: an update moved by ``Δ`` with ``‖Δ‖₂`` chosen as a
multiple of ``max_update_norm`` is refused (reject) or folded as ``global + Δ·bound/‖Δ‖`` (clip).
"""

from __future__ import annotations

import math
import re

import grpc
import pytest
import torch
from grpc_helpers import global_tensors, register, shards, small_federation, snapshot

BOUND = 0.5
NAME = "head.bias"  # 10 values: Δ = c·(1, …, 1) has ‖Δ‖₂ = c·√10


def _plain() -> object:
    return small_federation(factorization="none", tiers=[1.0])


def _moved(url: str, norm: float) -> dict[str, torch.Tensor]:
    """The global model (read from the store) with ``head.bias`` moved by a vector of L2 norm ``norm``."""
    tensors = {n: t.clone() for n, (t, _v) in global_tensors(url).items()}
    tensors[NAME] = tensors[NAME] + norm / math.sqrt(tensors[NAME].numel())
    return tensors


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_huge_low_rank_factors_are_refused_at_push(start_service, request, backend) -> None:
    """Finite factors whose product overflows float32 (the close failure of test_service_close_failure) never get in."""
    svc = start_service(request.getfixturevalue(f"{backend}_url"))
    data = shards(2)
    full, low = register(svc.stub, 1.0, data[0]), register(svc.stub, 0.25, data[1])
    task = low.task()
    low.fetch()
    push = low.train(task)
    before = snapshot(svc.url)
    huge = {n: torch.full_like(t, 1e30) if n.endswith(("_u", "_v")) else t for n, t in push.tensors.items()}
    with pytest.raises(grpc.RpcError) as err:
        low.push(1, huge, num_samples=push.num_samples)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_update_value" in err.value.details() and "aligned to full rank" in err.value.details()
    assert snapshot(svc.url) == before
    # the same client's honest update is taken, and the round closes
    assert low.push(1, push.tensors, num_samples=push.num_samples).accepted
    round_, reply = full.round_trip()
    assert round_ == 1 and reply.accepted
    assert full.task().train.round == 2


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_reject_mode_refuses_an_update_over_the_norm_bound(start_service, request, backend) -> None:
    svc = start_service(request.getfixturevalue(f"{backend}_url"), _plain(), max_update_norm=BOUND)
    data = shards(2)
    a, b = register(svc.stub, 1.0, data[0]), register(svc.stub, 1.0, data[1])
    assert a.task().train.round == 1
    before = snapshot(svc.url)
    with pytest.raises(grpc.RpcError) as err:
        a.push(1, _moved(svc.url, 2 * BOUND))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    said = re.search(r"‖Δ‖₂ = ([0-9.e+-]+), over max_update_norm = 0.5", err.value.details())
    assert said is not None and float(said.group(1)) == pytest.approx(2 * BOUND, rel=1e-3), err.value.details()
    assert snapshot(svc.url) == before  # nothing stored, nothing counted
    assert a.push(1, _moved(svc.url, 0.9 * BOUND)).accepted  # within the bound: taken
    assert b.push(1, _moved(svc.url, 0.0)).accepted


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_clip_mode_folds_the_update_scaled_to_the_bound(start_service, request, backend) -> None:
    svc = start_service(
        request.getfixturevalue(f"{backend}_url"), _plain(), max_update_norm=BOUND, update_norm_mode="clip"
    )
    data = shards(2)
    a, b = register(svc.stub, 1.0, data[0]), register(svc.stub, 1.0, data[1])  # 150 samples each: equal weights
    assert a.task().train.round == 1
    start = {n: t for n, (t, _v) in global_tensors(svc.url).items()}
    assert a.push(1, _moved(svc.url, 4 * BOUND)).accepted  # accepted whole, clipped at the fold
    assert b.push(1, _moved(svc.url, 0.0)).accepted  # the global model itself: Δ = 0
    assert a.task().train.round == 2
    after = {n: t for n, (t, _v) in global_tensors(svc.url).items()}
    # a's Δ (every entry 4·BOUND/√10) is clipped to ‖Δ‖ = BOUND, i.e. every entry BOUND/√10; averaged with b's 0
    expected = start[NAME].double() + BOUND / math.sqrt(10) / 2
    assert torch.allclose(after[NAME].double(), expected, atol=1e-6)
    assert float(torch.linalg.vector_norm(after[NAME].double() - start[NAME].double())) == pytest.approx(BOUND / 2)
    for n in start:
        if n != NAME:
            assert torch.equal(after[n], start[n]), n  # Δ = 0 elsewhere, for both clients


@pytest.mark.parametrize("backend", ["sqlite"])
def test_clip_mode_leaves_an_update_within_the_bound_as_it_is(start_service, request, backend) -> None:
    svc = start_service(
        request.getfixturevalue(f"{backend}_url"), _plain(), max_update_norm=BOUND, update_norm_mode="clip"
    )
    data = shards(2)
    a, b = register(svc.stub, 1.0, data[0]), register(svc.stub, 1.0, data[1])
    assert a.task().train.round == 1
    start = {n: t for n, (t, _v) in global_tensors(svc.url).items()}
    assert a.push(1, _moved(svc.url, 0.5 * BOUND)).accepted
    assert b.push(1, _moved(svc.url, 0.5 * BOUND)).accepted
    assert a.task().train.round == 2
    after = global_tensors(svc.url)[NAME][0]
    assert float(torch.linalg.vector_norm(after.double() - start[NAME].double())) == pytest.approx(
        0.5 * BOUND, rel=1e-5
    )


def _shifted(url: str, by: float) -> dict[str, torch.Tensor]:
    """The global model (read from the store) with every floating-point value moved by ``by``."""
    return {n: t + by if t.is_floating_point() else t for n, (t, _v) in global_tensors(url).items()}


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_the_magnitude_bound_limits_the_change_so_a_model_past_it_still_learns(start_service, request, backend) -> None:
    """max_update_value = 1: two rounds of updates that each move every value by 0.9 carry the model past 1
    (values near 1.8); an update that then moves nothing is taken, one that moves a value by 1.1 is refused.
    A bound on the values themselves would refuse every update from there on: the federation would stop."""
    svc = start_service(request.getfixturevalue(f"{backend}_url"), _plain(), max_update_value=1.0)
    data = shards(2)
    a, b = register(svc.stub, 1.0, data[0]), register(svc.stub, 1.0, data[1])
    for round_ in (1, 2):
        assert a.task().train.round == round_
        assert a.push(round_, _shifted(svc.url, 0.9)).accepted
        assert b.push(round_, _shifted(svc.url, 0.9)).accepted
    assert a.task().train.round == 3
    peak = max(float(t.abs().max()) for t, _v in global_tensors(svc.url).values() if t.is_floating_point())
    assert peak > 1.7  # the initial weights are under 0.5 in magnitude
    before = snapshot(svc.url)
    over = _shifted(svc.url, 0.0)
    over[NAME] = over[NAME].clone()
    over[NAME][3] += 1.1
    with pytest.raises(grpc.RpcError) as err:
        a.push(3, over)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"'{NAME}'" in err.value.details() and "max_update_value = 1" in err.value.details()
    assert snapshot(svc.url) == before
    start = global_tensors(svc.url)[NAME][0].double()
    assert a.push(3, _shifted(svc.url, 0.0)).accepted
    assert b.push(3, _shifted(svc.url, -0.5)).accepted  # the last round (of 3) closes: equal weights
    assert torch.allclose(global_tensors(svc.url)[NAME][0].double(), start - 0.25, atol=1e-6)


def _received_moved(client, norm: float) -> dict[str, torch.Tensor]:
    """The model ``client`` fetched for its tier, as the wire delivered it, with ``head.bias`` moved by ``norm``."""
    client.fetch()
    # float32, as the model trains: a move added in float16 would be rounded
    tensors = {n: t.float() if t.is_floating_point() else t.clone() for n, t in client.state.global_tensors.items()}
    tensors[NAME] = tensors[NAME] + norm / math.sqrt(tensors[NAME].numel())
    return tensors


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_low_tiers_move_is_measured_from_the_cut_it_received(start_service, request, backend) -> None:
    """A tier-1/8 client never held the global model past its rank: pushing back its cut unchanged moves
    nothing, however far the cut lies from the full model (‖W − W_r‖ is several times this bound)."""
    svc = start_service(
        request.getfixturevalue(f"{backend}_url"), small_federation(tiers=[1.0, 0.125]), max_update_norm=BOUND
    )
    data = shards(2)
    full, low = register(svc.stub, 1.0, data[0]), register(svc.stub, 0.125, data[1])
    assert low.task().train.round == 1
    before = snapshot(svc.url)
    with pytest.raises(grpc.RpcError) as err:  # moved by twice the bound: refused, with that norm
        low.push(1, _received_moved(low, 2 * BOUND), update_id="too-far")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    said = re.search(r"‖Δ‖₂ = ([0-9.e+-]+), over max_update_norm", err.value.details())
    assert said is not None and float(said.group(1)) == pytest.approx(2 * BOUND, rel=1e-3)
    assert snapshot(svc.url) == before
    assert low.push(1, _received_moved(low, 0.0), update_id="unchanged").accepted
    assert full.task().train.round == 1
    assert full.push(1, _received_moved(full, 0.0), update_id="full").accepted  # completes round 1
    assert full.task().train.round == 2


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_clip_mode_folds_a_low_tiers_move_from_its_cut(start_service, request, backend) -> None:
    """Two clients of equal weight at tiers 1 and 1/8; the low one moves ``head.bias`` by twice the bound, from
    its cut: told 0.5, and folded so, the mean moves ``head.bias`` by a quarter of its move (BOUND / 2)."""
    url = request.getfixturevalue(f"{backend}_url")
    svc = start_service(url, small_federation(tiers=[1.0, 0.125]), max_update_norm=BOUND, update_norm_mode="clip")
    data = shards(2)
    full, low = register(svc.stub, 1.0, data[0]), register(svc.stub, 0.125, data[1])
    assert low.task().train.round == 1 and full.task().train.round == 1
    start = global_tensors(url)[NAME][0].double()
    assert low.push(1, _received_moved(low, 2 * BOUND), update_id="low").move_scale == pytest.approx(0.5, rel=1e-6)
    assert full.push(1, _received_moved(full, 0.0), update_id="full").move_scale == 1.0
    assert full.task().train.round == 2  # closed
    moved = global_tensors(url)[NAME][0].double() - start
    assert float(torch.linalg.vector_norm(moved)) == pytest.approx(BOUND / 2, rel=1e-5)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_under_fp16_transport_a_move_is_measured_from_the_rounded_model(start_service, request, backend) -> None:
    """With fp16 transport a client starts from the global model rounded to float16: pushing it back unchanged
    moves nothing, although it differs from the server's float32 model by the rounding; the clip scales the
    move from there."""
    url = request.getfixturevalue(f"{backend}_url")
    svc = start_service(
        url,
        small_federation(factorization="none", tiers=[1.0], fp16=True),
        max_update_norm=1e-4,
        update_norm_mode="clip",
    )
    data = shards(2)
    a, b = register(svc.stub, 1.0, data[0]), register(svc.stub, 1.0, data[1])
    assert a.task().train.round == 1 and b.task().train.round == 1
    exact = {n: t.double() for n, (t, _v) in global_tensors(url).items()}
    rounding = math.sqrt(sum(float(((t.half().double() - t) ** 2).sum()) for t in exact.values()))
    assert rounding > 1e-3  # the rounding alone is ten times the bound
    assert a.push(1, _received_moved(a, 0.0), update_id="a").move_scale == 1.0
    assert b.push(1, _received_moved(b, 4e-4), update_id="b").move_scale == pytest.approx(0.25, rel=1e-3)
    assert a.task().train.round == 2  # closed: the mean of x̃ and x̃ + 0.25·Δ_b
    after = global_tensors(url)
    for name, x in exact.items():
        sent = x.half().double()
        if name == NAME:
            assert float(torch.linalg.vector_norm(after[name][0].double() - sent)) == pytest.approx(5e-5, rel=1e-2)
        elif x.is_floating_point():
            torch.testing.assert_close(after[name][0].double(), sent, rtol=0, atol=1e-7)
