"""The round state machine: cohorts, due tensors, per-tier downloads, fold and close."""

from __future__ import annotations

import pytest
import torch

from aggregator_service.intervals import EveryRound, FedLAMA, FixedSchedule
from aggregator_service.rounds import CohortSampler, Federation
from aggregator_service.strategies import FedAvg
from aggregator_service.updates import ClientUpdate
from fedcore.keys import derive_seed
from fedcore.spec import ModelSpec

SPEC = ModelSpec("digits-cnn", 10, "atoms-lowrank", 9)
CLIENTS = [f"c{i}" for i in range(8)]


def federation(
    policy_cls=EveryRound, mode="period", tier_init="energy", tiers=(1.0,), nested_rank_ratio=None, **policy_kw
) -> Federation:
    full = SPEC.full()
    return Federation(
        full,
        FedAvg(),
        policy_cls(full.tensors, **policy_kw),
        CohortSampler(0.5, 2, mode, seed=1),
        tiers=tiers,
        init_seed=0,
        tier_init=tier_init,
        nested_rank_ratio=nested_rank_ratio,
    )


def perturbed(tensors: dict[str, torch.Tensor], scale: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: t + scale * torch.randn(t.shape, generator=g) if t.is_floating_point() else t for n, t in tensors.items()
    }


def test_derive_seed_is_stable_and_distinct():
    assert derive_seed(0, 1, "a") == derive_seed(0, 1, "a")
    assert len({derive_seed(0, r, c) for r in range(5) for c in "abc"}) == 15
    assert 0 <= derive_seed("x") < 2**63


def test_cohort_size_and_validation():
    s = CohortSampler(0.5, 3, seed=0)
    assert s.size(20) == 10 and s.size(4) == 3 and s.size(2) == 2
    assert s.sample(1, CLIENTS) == s.sample(1, list(reversed(CLIENTS)))  # order of candidates does not matter
    with pytest.raises(ValueError, match="at least 3"):
        s.sample(1, ["a", "b"])
    for bad in (dict(fraction=0.0), dict(fraction=1.5), dict(min_clients=0), dict(mode="sometimes")):
        with pytest.raises(ValueError):
            CohortSampler(**bad)


def test_period_mode_keeps_the_cohort_for_the_sync_period():
    fed = federation(FedLAMA, tau_base=1, phi=3)
    cohorts = []
    for r in range(1, 7):
        plan = fed.plan(r, CLIENTS)
        fed.begin(plan)
        cohorts.append(plan.cohort)
        assert plan.continue_unsynced == ((r - 1) % 3 != 0)
        for cid in plan.cohort:
            fed.fold(update(fed, cid, plan.due, seed=r))
        fed.close()
    assert cohorts[0] == cohorts[1] == cohorts[2]
    assert cohorts[3] == cohorts[4] == cohorts[5]
    assert cohorts[0] != cohorts[3]


def test_per_round_mode_resamples_every_round():
    fed = federation(FedLAMA, mode="per_round", tau_base=1, phi=3)
    plans = []
    for r in range(1, 4):
        plan = fed.plan(r, CLIENTS)
        fed.begin(plan)
        plans.append(plan)
        for cid in plan.cohort:
            fed.fold(update(fed, cid, plan.due, seed=r))
        fed.close()
    assert not any(p.continue_unsynced for p in plans)
    assert len({p.cohort for p in plans}) > 1


def update(fed: Federation, cid: str, due, seed: int, tier: float = 1.0) -> ClientUpdate:
    spec = fed.tier_spec(tier)
    local = perturbed(fed.tier_tensors(tier), 0.01, seed * 100 + int(cid[1:]))
    names = fed.tier_due(tier, due)
    return ClientUpdate(cid, 10 + int(cid[1:]), tier, spec, {n: local[n] for n in names})


def test_close_updates_due_tensors_versions_and_intervals():
    fed = federation(FixedSchedule, beta=0.5)
    plan = fed.plan(1, CLIENTS)
    fed.begin(plan)
    assert "conv2.coefficients" not in plan.due and "conv2.atoms" in plan.due
    before = {n: t.clone() for n, t in fed.global_tensors.items()}
    for cid in plan.cohort:
        fed.fold(update(fed, cid, plan.due, seed=1))
    outcome = fed.close()
    assert outcome.reported == len(plan.cohort)
    assert outcome.latent_clients == 0  # coefficients were not averaged: no atom swapping this round
    for name in fed.spec.names:
        changed = not torch.equal(before[name], fed.global_tensors[name])
        assert fed.versions[name] == (1 if name in plan.due else 0)
        if fed.global_tensors[name].is_floating_point():
            assert changed == (name in plan.due), name
    assert set(outcome.discrepancy) == set(plan.due)
    assert all(d >= 0 for d in outcome.discrepancy.values())


def test_fetch_moves_only_newer_versions_shaped_for_the_tier():
    fed = federation(FixedSchedule, beta=0.5)
    tier = 0.25
    first = fed.fetch(tier, {})
    assert set(first) == set(fed.tier_spec(tier).names)
    assert first["conv2.coefficients_u"][0].shape == fed.tier_spec(tier).tensor("conv2.coefficients_u").shape
    held = {n: v for n, (_, v) in first.items()}
    assert fed.fetch(tier, held) == {}
    plan = fed.plan(1, CLIENTS)
    fed.begin(plan)
    for cid in plan.cohort:
        fed.fold(update(fed, cid, plan.due, seed=1))
    fed.close()
    second = fed.fetch(tier, held)
    assert set(second) == set(fed.tier_due(tier, plan.due))
    assert "conv2.coefficients_u" not in second  # coefficients were not due in round 1


def _close_one_round(fed: Federation) -> None:
    plan = fed.plan(1, CLIENTS)
    fed.begin(plan)
    for cid in plan.cohort:
        fed.fold(update(fed, cid, plan.due, seed=1))
    fed.close()


@pytest.mark.parametrize("tier_init", ["truncated", "energy"])
def test_tier_tensors_are_the_truncated_svd_of_an_aggregated_global_model(tier_init):
    fed = federation(tier_init=tier_init)
    if tier_init == "energy":
        _close_one_round(fed)  # "energy" cuts only tensors no round has aggregated yet
    for tier in (1.0, 0.5, 0.125):
        expected = fed.tier_spec(tier).from_full(fed.global_tensors)
        got = fed.tier_tensors(tier)
        assert got.keys() == expected.keys()
        assert all(torch.allclose(got[n], expected[n], atol=1e-6) for n in got)


def test_a_tiers_first_cut_keeps_the_plain_layers_output_variance():
    """Round 0's ⅛ layers, fed white noise, answer with the plain layers' variance (Kaiming's criterion).

    The oracle is the plain layer itself, run by torch on the same inputs; FedHM's plain cut
    (``truncated``) keeps only the top singular values' share of it.
    """
    gen = torch.Generator().manual_seed(3)
    images, features = torch.randn(128, 32, 8, 8, generator=gen), torch.randn(512, 1024, generator=gen)
    ratios: dict[str, dict[str, float]] = {}
    for tier_init in ("energy", "truncated"):
        fed = federation(tier_init=tier_init)
        full = fed.global_tensors
        net = fed.tier_spec(0.125).build()
        net.load_state_dict(fed.tier_tensors(0.125))
        weight = torch.einsum("oiq,qxy->oixy", full["conv2.coefficients"], full["conv2.atoms"])
        with torch.no_grad():
            conv = net.conv2(images) - full["conv2.bias"][None, :, None, None]
            linear = net.fc1(features) - full["fc1.bias"]
        ratios[tier_init] = {
            "conv2": float(conv.var() / torch.nn.functional.conv2d(images, weight, padding=1).var()),
            "fc1": float(linear.var() / (features @ full["fc1.weight"].T).var()),
        }
    assert ratios["energy"] == pytest.approx({"conv2": 1.0, "fc1": 1.0}, abs=0.1)
    assert all(r < 0.6 for r in ratios["truncated"].values()), ratios


def test_nested_tier_init_starts_every_tier_from_the_smallest_tiers_energy_keeping_cut():
    """``tier_init = "nested"`` with mixed tiers trained nested: every tier's round-0 download holds the same ⅛ cut.

    Oracle: torch's SVD of ``fc1.weight`` (a plain 128 × 1024 matrix, no reshaping), ranks derived by
    hand (⅛ of 128 outputs: 16; ½: 64). Tier 1 gets the layer with its top 16 singular values scaled to
    the layer's norm and the other 112 as they were; ⅛ and ½ get that matrix's truncations.
    """
    fed = federation(tier_init="nested", tiers=(1.0, 0.5, 0.125), nested_rank_ratio=0.125)
    w0 = fed.global_tensors["fc1.weight"].double()
    u, s, vh = torch.linalg.svd(w0, full_matrices=False)
    scaled = s.clone()
    scaled[:16] *= s.norm() / s[:16].norm()

    tier1 = fed.tier_tensors(1.0)["fc1.weight"].double()
    torch.testing.assert_close(torch.linalg.svdvals(tier1), scaled, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tier1, (u * scaled) @ vh, rtol=0, atol=1e-5)
    for tier, rank in ((0.125, 16), (0.5, 64)):
        got = fed.tier_tensors(tier)
        product = got["fc1.lowrank_u"].double() @ got["fc1.lowrank_v"].double()
        torch.testing.assert_close(product, (u[:, :rank] * scaled[:rank]) @ vh[:rank], rtol=0, atol=1e-5)
    cut = fed.tier_tensors(0.125)
    eighth = cut["fc1.lowrank_u"].double() @ cut["fc1.lowrank_v"].double()
    assert float(eighth.norm()) == pytest.approx(float(w0.norm()), rel=1e-5)  # the ⅛ cut keeps the layer's energy
    assert torch.equal(fed.tier_tensors(1.0)["fc1.bias"], fed.global_tensors["fc1.bias"])  # not factorized
    # under the default "energy", or without nested training, tier 1 starts from the initial model itself
    for tier_init, ratio in (("energy", 0.125), ("nested", None)):
        plain = federation(tier_init=tier_init, tiers=(1.0, 0.125), nested_rank_ratio=ratio)
        assert all(plain.tier_tensors(1.0)[n] is plain.global_tensors[n] for n in plain.global_tensors)
    # once a round has aggregated a tensor, every tier is its exact truncated SVD again
    _close_one_round(fed)
    assert torch.equal(fed.tier_tensors(1.0)["fc1.weight"], fed.global_tensors["fc1.weight"])


def test_mixed_tiers_fold_to_full_rank():
    fed = federation()
    plan = fed.plan(1, CLIENTS)
    fed.begin(plan)
    for i, cid in enumerate(plan.cohort):
        fed.fold(update(fed, cid, plan.due, seed=1, tier=(1.0, 0.25)[i % 2]))
    outcome = fed.close()
    assert outcome.result.tensors["conv2.coefficients"].shape == fed.spec.tensor("conv2.coefficients").shape
    assert outcome.latent_clients == len(plan.cohort) ** 2 - len(plan.cohort)


def test_state_machine_rejects_misuse():
    fed = federation()
    with pytest.raises(RuntimeError, match="no open round"):
        fed.close()
    plan = fed.plan(1, CLIENTS)
    fed.begin(plan)
    with pytest.raises(RuntimeError, match="still open"):
        fed.plan(2, CLIENTS)
    with pytest.raises(RuntimeError, match="still open"):
        fed.begin(plan)
    outsider = next(c for c in CLIENTS if c not in plan.cohort)
    with pytest.raises(ValueError, match="not in round 1's cohort"):
        fed.fold(update(fed, outsider, plan.due, seed=1))
    with pytest.raises(ValueError, match="lacks tensors"):
        Federation(SPEC, FedAvg(), EveryRound(SPEC.full().tensors), CohortSampler(), global_tensors={})


def test_received_is_what_a_tiers_client_decodes_and_the_close_sees_the_same() -> None:
    """``Federation.received``: tier 1 without fp16 is the global model itself (no copy); under fp16 each tier's
    cut as encode/decode delivers it, aligned to full rank; a fork (the close) holds the same tensors."""
    from fedcore import codec

    plain = federation(tiers=(1.0, 0.125))
    assert all(plain.received(1.0)[n] is t for n, t in plain.global_tensors.items())
    half = federation(tiers=(1.0, 0.125))
    half.fp16 = True
    spec = half.tier_spec(0.125)
    decoded = {}
    for name, t in half.tier_tensors(0.125).items():
        data = codec.encode(t, fp16=True, name=name)
        arr = codec.decode(name, data.dtype, data.shape, data.data)
        decoded[name] = torch.from_numpy(arr).to(t.dtype)  # the client trains in the spec's dtype
    expected = spec.to_full(decoded)
    got = half.received(0.125)
    assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got)
    fork = half.fork()
    assert all(fork.received(0.125)[n] is got[n] for n in got)  # shared, not recomputed
    _close_one_round(half)  # a new version: the entry is stale
    assert any(not torch.equal(half.received(0.125)[n], got[n]) for n in got)
