"""A close that cannot succeed does not spin: the same failure twice abandons the round, and the federation goes on.

The failing close is a real one: an enrolled tier-1/4 client pushes finite low-rank factors so large
that their product overflows float32 when the server aligns them to full rank (every value passes
validation). The magnitude bound refuses such pushes (test_service_update_bounds); here it is lifted
(``max_update_value = inf``) to produce the failure it guards against. Without the rule, every tick
would retry the close and the clients would wait forever.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from grpc_helpers import register, shards
from sqlalchemy import select
from sqlalchemy.orm import Session

from aggregator_service import store


def _round_state(url: str, number: int) -> str:
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            return s.execute(select(store.Round.state).where(store.Round.number == number)).scalar_one()
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_the_same_close_failure_twice_abandons_the_round(start_service, request, backend, caplog) -> None:
    svc = start_service(request.getfixturevalue(f"{backend}_url"), max_update_value=math.inf)
    data = shards(2)
    full, low = register(svc.stub, 1.0, data[0]), register(svc.stub, 0.25, data[1])
    caplog.set_level(logging.INFO, logger="fedatoms.aggregator")
    for c in (full, low):
        task = c.task()
        assert task.WhichOneof("kind") == "train" and task.train.round == 1
        c.fetch()
        push = c.train(task)
        tensors = dict(push.tensors)
        if c is low:  # finite, accepted, but U·V overflows float32 at the close
            tensors = {n: torch.full_like(t, 1e30) if n.endswith(("_u", "_v")) else t for n, t in tensors.items()}
        reply = c.push(1, tensors, num_samples=push.num_samples, metrics=push.metrics)
        assert reply.accepted
    failures = [r for r in caplog.records if "event=round_close_failed" in r.getMessage()]
    assert len(failures) == 1 and "action=retry" in failures[0].getMessage()  # the push's close: logged once
    assert _round_state(svc.url, 1) == "open"

    svc.coordinator.tick()  # the ticker tries again, fails the same way, and gives the round up
    failures = [r.getMessage() for r in caplog.records if "event=round_close_failed" in r.getMessage()]
    assert len(failures) == 2 and "action=abandoned" in failures[1] and "cause=" in failures[1]
    assert _round_state(svc.url, 1) == "abandoned"

    svc.coordinator.tick()  # nothing left to retry: no third failure
    assert sum("event=round_close_failed" in r.getMessage() for r in caplog.records) == 2
    task = full.task()
    assert task.WhichOneof("kind") == "train" and task.train.round == 2  # the federation goes on
