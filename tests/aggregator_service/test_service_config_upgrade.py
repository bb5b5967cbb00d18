"""A federation stored before a method key existed keeps the behaviour it ran with across an upgrade.

``tier_init``, ``tier_average``, ``tier_training``, ``lama_warmup`` and ``slow_tensors`` came after federations
were stored: one stored without them restarts (not refused as "a different method") and keeps FedHM's truncated
cut, aligned average and tiers that each train their own model, and ``full_rank_share``, with the stem alone
full rank; one stored with a value is held to it. ``atom_lr``'s
and ``num_atoms``' defaults changed: one stored with the old default keeps it when restarted with unchanged
settings.
"""

from __future__ import annotations

import json

import pytest
import torch
from grpc_helpers import register, shards, small_federation
from sqlalchemy import select

from aggregator_service import store
from aggregator_service.config import stored_spec
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
    assert first.coordinator.shared.config.train_config().nested_rank_ratio == 0.25  # tiers 1 and ¼: nested
    first.stop()
    _drop_stored_keys(url, "tier_init", "tier_average", "tier_training")

    shared = start_service(url).coordinator.shared  # the default settings: not refused
    fed = shared.federation
    assert (fed.tier_init, fed.tier_average) == ("truncated", "aligned")
    assert shared.config.train_config().nested_rank_ratio is None  # what its clients are told: each its own model
    expected = fed.tier_spec(0.25).from_full(fed.global_tensors)  # FedHM's exact cut, version 0 included
    got = fed.tier_tensors(0.25)
    assert all(torch.allclose(got[n], expected[n], atol=1e-6) for n in expected)


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
@pytest.mark.parametrize(
    ("key", "stored", "default"), [("tier_init", "truncated", "energy"), ("atom_lr", "shared", "preconditioned")]
)
def test_a_stored_value_is_held_against_another_configured_one(backend, key, stored, default, request, start_service):
    url = request.getfixturevalue(backend)
    start_service(url, small_federation(**{key: stored})).stop()
    with pytest.raises(ValueError, match=f"{key}: stored '{stored}', configured '{default}'"):
        start_service(url, small_federation())


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_a_fedlama_federation_stored_before_lama_warmup_keeps_its_warmup_in_rounds(backend, request, start_service):
    """``lama_warmup`` came later too: a φ = 4 federation stored without it keeps 6 warm-up rounds (the rule it
    ran with), where a new one warms up for 3 adjustment periods (12 rounds)."""
    url = request.getfixturevalue(backend)
    # as an earlier version stored it: warm-up in rounds, its policy state saved with 6
    start_service(url, small_federation(interval_policy="fedlama", phi=4, lama_warmup="rounds")).stop()
    _drop_stored_keys(url, "lama_warmup")
    fed = start_service(url, small_federation(interval_policy="fedlama", phi=4)).coordinator.shared.federation
    assert fed.policy.warmup_rounds == 6  # not refused, not changed
    assert small_federation(interval_policy="fedlama", phi=4).build_federation(1).policy.warmup_rounds == 12


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_a_federation_stored_with_the_old_atom_lr_default_keeps_it(backend, request, start_service):
    """``atom_lr``'s default became ``preconditioned``: a federation stored with the old default (``scaled``) and
    restarted with unchanged settings is not refused and keeps training its clients with ``scaled``; a value
    the operator chose is held to it as before."""
    url = request.getfixturevalue(backend)
    start_service(url, small_federation(atom_lr="scaled")).stop()  # what the old default stored
    service = start_service(url, small_federation())  # the new default, settings unchanged: not refused
    assert small_federation().train_config().atom_lr == "preconditioned"
    clients = [register(service.stub, tier, data) for tier, data in zip((1.0, 0.25), shards(2), strict=True)]
    task = clients[1].task()
    assert task.WhichOneof("kind") == "train"
    assert json.loads(task.train.train_config_json)["atom_lr"] == "scaled"  # what a client trains with


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_a_federation_stored_with_the_papers_nine_atoms_keeps_them(backend, request, start_service):
    """``num_atoms``' default became ``k²`` per conv: a federation of 5×5 convs stored with the old default (9)
    and restarted with unchanged settings is not refused and keeps its 9 atoms, the tensors its database holds;
    a new one gets 25."""
    url = request.getfixturevalue(backend)
    model = dict(model="mnist-cnn", factorization="atoms", tiers=[1.0])
    start_service(url, small_federation(**model, num_atoms=9)).stop()  # what the old default stored
    fed = start_service(url, small_federation(**model)).coordinator.shared.federation
    assert fed.spec.tensor("conv2.atoms").shape == (9, 5, 5) and fed.global_tensors["conv2.atoms"].shape == (9, 5, 5)
    assert small_federation(**model).spec.tensor("conv2.atoms").shape == (25, 5, 5)


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_a_federation_stored_before_full_rank_share_keeps_its_stem_alone(backend, request, start_service):
    """``full_rank_share`` came later: a federation stored without it restarts with the stem alone full rank, so its
    ⅛ clients keep the factor pairs they train (McMahan's ``conv2`` at rank 8); a new one keeps ``conv2`` whole."""
    url = request.getfixturevalue(backend)
    model = dict(model="mnist-cnn", factorization="atoms-lowrank", tiers=[1.0, 0.125])
    start_service(url, small_federation(**model, full_rank_share=0.0)).stop()
    _drop_stored_keys(url, "full_rank_share")
    fed = start_service(url, small_federation(**model)).coordinator.shared.federation  # not refused
    assert fed.tier_spec(0.125).tensor("conv2.coefficients_u").shape == (64, 8)
    assert "conv2.coefficients" in small_federation(**model).spec.at_tier(0.125).names
    # export reads the stored config alone, and finds the model the server runs, not today's default
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine)() as s:
            stored = dict(s.scalars(select(FederationRow)).one().config)
    finally:
        engine.dispose()
    assert "full_rank_share" not in stored and stored_spec(stored) == fed.spec


def _set_stored_keys(url: str, **keys: object) -> None:
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine).begin() as s:
            row = s.scalars(select(FederationRow)).one()
            row.config = {**row.config, **keys}
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_a_federation_stored_with_a_key_its_method_never_read_restarts_once_the_key_is_removed(
    backend, request, start_service
):
    """An earlier release accepted ``phi = 4`` with every tensor every round, and stored it. Its settings are now
    refused in one line saying why; with the key removed the federation restarts, the stored value being no part
    of its method. A key the method does read is still held to its stored value."""
    url = request.getfixturevalue(backend)
    start_service(url, small_federation()).stop()
    _set_stored_keys(url, phi=4, beta=0.5)  # what the earlier release stored from the operator's settings
    with pytest.raises(ValueError, match="phi = 4 would change nothing: only the fedlama interval policy reads it"):
        small_federation(phi=4)
    service = start_service(url, small_federation())  # not "a different method"
    fed = service.coordinator.shared.federation
    assert fed.policy.intervals() == {n: 1 for n in fed.spec.names}
    service.stop()
    # under FedLAMA phi is part of the method: held to its stored value
    start_service(url, small_federation(interval_policy="fedlama", phi=4), federation_name="lama").stop()
    with pytest.raises(ValueError, match="phi: stored 4, configured 2"):
        start_service(url, small_federation(interval_policy="fedlama"), federation_name="lama")


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_a_plain_federation_stored_before_the_tier_and_fedlama_rules_restarts(backend, request, start_service):
    """FedAvg over one tier reads none of the tier rules nor FedLAMA's warm-up: stored before they existed, it
    restarts as it ran, not with their old values set on a config that would refuse them."""
    url = request.getfixturevalue(backend)
    plain = dict(factorization="none", tiers=[1.0])
    start_service(url, small_federation(**plain)).stop()
    _drop_stored_keys(url, "tier_init", "tier_average", "tier_training", "lama_warmup", "full_rank_share")
    shared = start_service(url, small_federation(**plain)).coordinator.shared
    assert (shared.config.tier_init, shared.config.lama_warmup) == ("energy", "periods")  # defaults, never read
    assert shared.config.full_rank_share == 0.0  # a key its model spec does read keeps the value it ran with


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
def test_a_fast_slow_federation_stored_before_slow_tensors_restarts_with_its_coefficients_slow(
    backend, request, start_service
):
    """``slow_tensors`` came after fast/slow federations were stored: one stored without it restarts (it was
    refused as "a different method", stored None against configured 'coefficients') and keeps the
    coefficients slow, its only rule then."""
    url = request.getfixturevalue(backend)
    fixed = dict(factorization="atoms", tiers=[1.0], interval_policy="fixed", beta=0.5)
    start_service(url, small_federation(**fixed)).stop()
    _drop_stored_keys(url, "slow_tensors")
    policy = start_service(url, small_federation(**fixed)).coordinator.shared.federation.policy
    assert {n for n, tau in policy.intervals().items() if tau == 2} == {"conv1.coefficients", "conv2.coefficients"}


def _edit_stored(url: str, config: dict, params: dict) -> None:
    """Set keys of the stored config and of the stored interval policy's parameters."""
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine).begin() as s:
            row = s.scalars(select(FederationRow)).one()
            row.config = {**row.config, **config}
            state = dict(row.policy_state)
            state["params"] = {**state["params"], **params}
            row.policy_state = state
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite_url", "postgres_url"])
@pytest.mark.parametrize(
    ("config", "params"),
    [
        ({}, {"hold_cohort": "while_relaxed"}),  # the default, as earlier releases recorded it
        ({"hold_cohort": "sync_period"}, {}),  # the paper's value, which they recorded by leaving it out
    ],
)
def test_a_fedlama_federation_with_a_new_cohort_every_round_restarts_whatever_hold_cohort_it_stored(
    backend, config, params, request, start_service
):
    """``hold_cohort`` times a kept cohort; with a new cohort every round nothing reads it, so a new config that
    sets it is refused. Federations stored when it was accepted, and recorded in the policy's saved parameters,
    restart under a config that leaves it unset, and their intervals come back as they were."""
    url = request.getfixturevalue(backend)
    lama = dict(interval_policy="fedlama", factorization="atoms", tiers=[1.0])
    first = start_service(url, small_federation(**lama))
    intervals = first.coordinator.shared.federation.policy.intervals()
    first.stop()
    _edit_stored(url, config, params)
    policy = start_service(url, small_federation(**lama)).coordinator.shared.federation.policy
    assert policy.intervals() == intervals and policy.hold_cohort is None
    with pytest.raises(ValueError, match="hold_cohort = 'sync_period' would change nothing"):
        small_federation(**lama, hold_cohort="sync_period")
