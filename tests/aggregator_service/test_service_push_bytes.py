"""A push's bytes are durable with its update: committed in the same transaction, before the acknowledgement.

A kill -9 right after an acknowledged push (no flush, no close in between) must find both the update
and its bytes in the database; a retry of the same update (a duplicate) adds no bytes.
"""

from __future__ import annotations

import uuid

import pytest
from grpc_helpers import register, shards
from sqlalchemy import func, select

from aggregator_service import store


def _pushed(url: str) -> tuple[int, int, int]:
    """(stored updates, rows and summed bytes of the ``push`` transfers) as the database holds them now."""
    engine = store.create_engine_for(url)
    try:
        with engine.connect() as conn:
            updates = conn.execute(select(func.count()).select_from(store.Update)).scalar_one()
            rows, total = conn.execute(
                select(func.count(), func.coalesce(func.sum(store.Transfer.bytes), 0)).where(
                    store.Transfer.category == "push"
                )
            ).one()
    finally:
        engine.dispose()
    return int(updates), int(rows), int(total)


def _acknowledged_push_has_its_bytes(start_service, url: str) -> None:
    service = start_service(url, poll_interval_seconds=0.05)  # no ticker runs: nothing flushes behind the push
    data = shards(2)
    clients = [register(service.stub, 1.0, d) for d in data]  # min_clients 2: one pushes, the round stays open
    a = clients[0]
    task = a.task()
    assert task.WhichOneof("kind") == "train"
    a.fetch()
    push = a.train(task)
    sent = sum(t.numel() * t.element_size() for t in push.tensors.values())  # the payload bytes, float32
    update_id = uuid.uuid4().hex
    reply = a.push(task.train.round, push.tensors, update_id=update_id, num_samples=push.num_samples)
    assert reply.accepted and not reply.duplicate
    assert _pushed(url) == (1, 1, sent)  # what a kill now would leave: the update and its bytes
    again = a.push(task.train.round, push.tensors, update_id=update_id, num_samples=push.num_samples)
    assert again.accepted and again.duplicate
    assert _pushed(url) == (1, 1, sent)  # a retry moved bytes, but the ledger counts the update once


def test_acknowledged_push_has_its_bytes_sqlite(start_service, sqlite_url) -> None:
    _acknowledged_push_has_its_bytes(start_service, sqlite_url)


@pytest.mark.usefixtures("postgres_url")
def test_acknowledged_push_has_its_bytes_postgres(start_service, postgres_url) -> None:
    _acknowledged_push_has_its_bytes(start_service, postgres_url)
