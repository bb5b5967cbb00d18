"""A federation stored before a method key existed keeps the behaviour it ran with across an upgrade.

``tier_init`` and ``tier_average`` came after federations were stored: one stored without them
restarts (not refused as "a different method") and keeps FedHM's truncated cut and aligned
average; one stored with a value is held to it.
"""

from __future__ import annotations

import pytest
import torch
from grpc_helpers import small_federation
from sqlalchemy import select

from aggregator_service import store
from aggregator_service.store.models import Federation as FederationRow


def _drop_stored_keys(url: str, *keys: str) -> None:
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine).begin() as s:
            row = s.scalars(select(FederationRow)).one()
            config = dict(row.config)
            for key in keys:
                del config[key]
            row.config = config
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_a_federation_stored_before_the_tier_rules_restarts_with_fedhms(backend, request, start_service):
    url = request.getfixturevalue(backend)
    first = start_service(url)
    assert (first.coordinator.shared.federation.tier_init, first.coordinator.shared.federation.tier_average) == (
        "energy",
        "held",
    )
    first.stop()
    _drop_stored_keys(url, "tier_init", "tier_average")

    fed = start_service(url).coordinator.shared.federation  # the default settings: not refused
    assert (fed.tier_init, fed.tier_average) == ("truncated", "aligned")
    expected = fed.tier_spec(0.25).from_full(fed.global_tensors)  # FedHM's exact cut, version 0 included
    got = fed.tier_tensors(0.25)
    assert all(torch.allclose(got[n], expected[n], atol=1e-6) for n in expected)


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_a_stored_tier_init_is_held_against_another_configured_one(backend, request, start_service):

    url = request.getfixturevalue(backend)
    start_service(url, small_federation(tier_init="truncated")).stop()
    with pytest.raises(ValueError, match="tier_init: stored 'truncated', configured 'energy'"):
        start_service(url, small_federation())
