"""PushReply.move_scale: what the fold scales a clipped update's move by, told at push.

Hand-built updates whose move from the round's model has a known length: the global model plus
``d`` on one tensor's first entry, so ``‖Δ‖₂ = d``.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_helpers import global_tensors, register, shards, small_federation


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")


def first_entry(tensors: dict) -> str:
    """The tensor whose first entry the tests move: the first non-empty floating-point one, by name."""
    return next(n for n, t in sorted(tensors.items()) if t.is_floating_point() and t.numel() > 0)


def moved_by(client, d: float) -> dict:
    """The round's model with one entry moved by ``d``."""
    client.fetch()
    tensors = {n: t.clone() for n, t in client.state.global_tensors.items()}
    first = first_entry(tensors)
    tensors[first].view(-1)[0] += d
    return tensors


@pytest.mark.parametrize(("mode", "d", "expected"), [("clip", 3.0, 0.5), ("clip", 1.0, 1.0), ("reject", 1.0, 1.0)])
def test_the_reply_says_what_the_fold_scales_the_move_by(
    start_service, url: str, mode: str, d: float, expected: float
) -> None:
    svc = start_service(
        url,
        small_federation(factorization="none", tiers=[1.0], min_clients=1),
        max_update_norm=1.5,
        update_norm_mode=mode,
    )
    a = register(svc.stub, 1.0, shards(1, 60)[0])
    assert a.task().train.round == 1
    tensors = moved_by(a, d)
    reply = a.push(1, tensors, update_id="u1")
    assert reply.accepted and reply.move_scale == pytest.approx(expected, rel=1e-6)


def test_a_retry_answers_the_scale_it_was_told_also_after_its_round_closed(start_service, url: str) -> None:
    svc = start_service(
        url,
        small_federation(factorization="none", tiers=[1.0]),
        max_update_norm=1.5,
        update_norm_mode="clip",
    )
    data = shards(2, 60)
    a, b = register(svc.stub, 1.0, data[0]), register(svc.stub, 1.0, data[1])
    assert a.task().train.round == 1 and b.task().train.round == 1
    tensors = moved_by(a, 6.0)
    assert a.push(1, tensors, update_id="u1").move_scale == pytest.approx(0.25, rel=1e-6)
    again = a.push(1, tensors, update_id="u1")  # its acknowledgement was lost: the round still holds it
    assert again.duplicate and again.move_scale == pytest.approx(0.25, rel=1e-6)
    assert b.push(1, moved_by(b, 0.5), update_id="u2").move_scale == 1.0  # completes the round: it closes
    late = a.push(1, tensors, update_id="u1")  # round 1's model is gone; the scale was kept with the update
    assert late.duplicate and late.move_scale == pytest.approx(0.25, rel=1e-6)


@pytest.mark.parametrize("restarted_with", [{}, {"max_update_norm": 0.5, "update_norm_mode": "clip"}])
def test_after_a_restart_with_other_bounds_the_fold_applies_the_scale_the_push_was_told(
    start_service, url: str, restarted_with: dict
) -> None:
    """a is told 0.25 under a bound of 1.5; the aggregator restarts with no bound, or a tighter one, before b's
    push closes the round. The fold scales a's move by 0.25, as a's strategy state already did: the first
    entry moves by 6 · 0.25 · ½ (two clients of equal weight, b unchanged), not by 6 · ½ or 0.5 · ½."""
    federation = small_federation(factorization="none", tiers=[1.0])
    first = start_service(url, federation, max_update_norm=1.5, update_norm_mode="clip")
    data = shards(2, 60)
    a, b = register(first.stub, 1.0, data[0]), register(first.stub, 1.0, data[1])
    assert a.task().train.round == 1 and b.task().train.round == 1
    start = {n: t.clone() for n, (t, _v) in global_tensors(url).items()}
    assert a.push(1, moved_by(a, 6.0), update_id="u1").move_scale == pytest.approx(0.25, rel=1e-6)
    first.stop()
    again = start_service(url, federation, **restarted_with)
    a.stub = b.stub = again.stub
    b.fetch()
    assert b.push(1, dict(b.state.global_tensors), update_id="u2").move_scale == 1.0  # unchanged: closes the round
    assert a.task().train.round == 2
    after = {n: t for n, (t, _v) in global_tensors(url).items()}
    first_name = first_entry(start)
    moved = float(after[first_name].view(-1)[0].double() - start[first_name].view(-1)[0].double())
    assert moved == pytest.approx(6.0 * 0.25 / 2, rel=1e-5)
    for n in start:
        rest = after[n].view(-1)[1:] if n == first_name else after[n]
        assert torch.equal(rest, start[n].view(-1)[1:] if n == first_name else start[n]), n


def test_a_retry_of_an_update_taken_before_a_restart_with_a_tighter_bound_is_a_duplicate(
    start_service, url: str
) -> None:
    """Reject mode binds a push under the settings it was checked by: a's update, taken without a bound, is
    retried (its acknowledgement lost) after a restart with max_update_norm = 1.5. The retry is a duplicate,
    not INVALID_ARGUMENT, and the fold takes a's whole move; a new update over the bound is still refused."""
    federation = small_federation(factorization="none", tiers=[1.0])
    first = start_service(url, federation)
    data = shards(2, 60)
    a, b = register(first.stub, 1.0, data[0]), register(first.stub, 1.0, data[1])
    assert a.task().train.round == 1 and b.task().train.round == 1
    start = {n: t.clone() for n, (t, _v) in global_tensors(url).items()}
    tensors = moved_by(a, 6.0)
    assert a.push(1, tensors, update_id="u1").move_scale == 1.0
    first.stop()
    again = start_service(url, federation, max_update_norm=1.5, update_norm_mode="reject")
    a.stub = b.stub = again.stub
    retry = a.push(1, tensors, update_id="u1")
    assert retry.accepted and retry.duplicate and retry.move_scale == 1.0
    with pytest.raises(grpc.RpcError) as err:
        b.push(1, moved_by(b, 6.0), update_id="u2")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_update_norm" in err.value.details()
    b.fetch()
    assert b.push(1, dict(b.state.global_tensors), update_id="u3").accepted  # unchanged: closes the round
    assert a.task().train.round == 2
    after = {n: t for n, (t, _v) in global_tensors(url).items()}
    first_name = first_entry(start)
    moved = float(after[first_name].view(-1)[0].double() - start[first_name].view(-1)[0].double())
    assert moved == pytest.approx(6.0 / 2, rel=1e-5)
