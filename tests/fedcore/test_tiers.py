"""Tests for fedcore.tiers: capability profile → the largest FedHM tier that fits."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcore.models import FACTORIZATIONS, MODELS
from fedcore.spec import ModelSpec
from fedcore.tiers import (
    BYTES_PER_TRAINED_PARAMETER,
    TIERS,
    CapabilityProfile,
    NoTierFitsError,
    assign_tier,
    match_tier,
    tier_costs,
    training_memory,
)

SPEC = ModelSpec("lenet-cifar10", 10, "atoms-lowrank")  # fast to derive, strictly cheaper per tier
HYP = settings(max_examples=30, deadline=None)
BATCH = 10  # a federation's default minibatch (FedAvg's B)


def costs() -> dict[float, tuple[int, int]]:
    return tier_costs(SPEC, batch_size=BATCH)


def memory_of(spec: ModelSpec, batch: int = BATCH) -> int:
    """Parameter state plus the saved tensors of a batch, from the spec's two counts."""
    per_sample, per_batch = spec.activation_bytes
    return spec.num_parameters * BYTES_PER_TRAINED_PARAMETER + batch * per_sample + per_batch


def fitting_oracle(memory: int | None = None, macs: float | None = None, preferred: float | None = None) -> float:
    """The largest tier whose costs fit, computed from the specs directly; 0.0 when none fits."""
    fits = [
        g
        for g in TIERS
        if (memory is None or memory_of(SPEC.at_tier(g)) <= memory)
        and (macs is None or SPEC.at_tier(g).macs <= macs)
        and (preferred is None or g <= preferred)
    ]
    return max(fits, default=0.0)


def tier_or_zero(profile: CapabilityProfile) -> float:
    try:
        return assign_tier(profile, SPEC, batch_size=BATCH)
    except NoTierFitsError:
        return 0.0


def test_tiers_are_fedhms_four_levels():
    assert TIERS == (1.0, 0.5, 0.25, 0.125)
    assert BYTES_PER_TRAINED_PARAMETER == 16


def test_tier_costs_are_memory_and_macs_of_each_tier():
    table = costs()
    assert list(table) == list(TIERS)
    for gamma, (memory, macs) in table.items():
        spec = SPEC.at_tier(gamma)
        assert memory == memory_of(spec) == training_memory(spec, BATCH)
        assert macs == spec.macs
    memories = [table[g][0] for g in TIERS]
    mac_counts = [table[g][1] for g in TIERS]
    assert memories == sorted(memories, reverse=True) and len(set(memories)) == 4
    assert mac_counts == sorted(mac_counts, reverse=True) and len(set(mac_counts)) == 4
    assert tier_costs(SPEC, (0.5,), batch_size=BATCH) == {0.5: table[0.5]}
    # the tier the spec is at does not matter
    assert tier_costs(SPEC.at_tier(0.25), batch_size=BATCH) == table


def test_unlimited_profile_gets_the_full_model():
    assert assign_tier(CapabilityProfile(), SPEC, batch_size=BATCH) == 1.0
    assert (
        assign_tier(CapabilityProfile(uplink_bps=1.0, downlink_bps=1.0, num_samples=5), SPEC, batch_size=BATCH) == 1.0
    )


@pytest.mark.parametrize("gamma", TIERS)
def test_memory_budget_boundaries(gamma):
    memory = costs()[gamma][0]
    assert assign_tier(CapabilityProfile(memory_bytes=memory), SPEC, batch_size=BATCH) == gamma  # exactly enough fits
    below = TIERS.index(gamma) + 1
    if below < len(TIERS):
        assert assign_tier(CapabilityProfile(memory_bytes=memory - 1), SPEC, batch_size=BATCH) == TIERS[below]
    else:
        with pytest.raises(NoTierFitsError):
            assign_tier(CapabilityProfile(memory_bytes=memory - 1), SPEC, batch_size=BATCH)


@pytest.mark.parametrize("gamma", TIERS)
def test_compute_budget_boundaries(gamma):
    macs = costs()[gamma][1]
    assert assign_tier(CapabilityProfile(compute_macs=float(macs)), SPEC, batch_size=BATCH) == gamma
    below = TIERS.index(gamma) + 1
    if below < len(TIERS):
        assert assign_tier(CapabilityProfile(compute_macs=macs - 0.5), SPEC, batch_size=BATCH) == TIERS[below]
    else:
        with pytest.raises(NoTierFitsError):
            assign_tier(CapabilityProfile(compute_macs=macs - 0.5), SPEC, batch_size=BATCH)


def test_both_budgets_must_fit():
    table = costs()
    # memory allows γ=1/2 but compute only γ=1/4, and the other way round
    assert (
        assign_tier(CapabilityProfile(memory_bytes=table[0.5][0], compute_macs=table[0.25][1]), SPEC, batch_size=BATCH)
        == 0.25
    )
    assert (
        assign_tier(CapabilityProfile(memory_bytes=table[0.125][0], compute_macs=table[1.0][1]), SPEC, batch_size=BATCH)
        == 0.125
    )


def test_preferred_tier_caps_the_assignment():
    table = costs()
    assert assign_tier(CapabilityProfile(preferred_tier=0.25), SPEC, batch_size=BATCH) == 0.25
    assert assign_tier(CapabilityProfile(preferred_tier=1.0), SPEC, batch_size=BATCH) == 1.0
    assert assign_tier(CapabilityProfile(preferred_tier=1), SPEC, batch_size=BATCH) == 1.0
    # a preference never raises the tier above what fits
    assert (
        assign_tier(CapabilityProfile(preferred_tier=0.5, memory_bytes=table[0.125][0]), SPEC, batch_size=BATCH)
        == 0.125
    )
    assert (
        assign_tier(CapabilityProfile(preferred_tier=0.125, memory_bytes=table[1.0][0]), SPEC, batch_size=BATCH)
        == 0.125
    )


@pytest.mark.parametrize("preferred", [0.3, 0.0, 2.0, -0.5, 1 / 3])
def test_invalid_preferred_tier(preferred):
    with pytest.raises(ValueError, match="preferred tier") as excinfo:
        assign_tier(CapabilityProfile(preferred_tier=preferred), SPEC, batch_size=BATCH)
    assert not isinstance(excinfo.value, NoTierFitsError)
    for gamma in ("1", "0.5", "0.25", "0.125"):
        assert gamma in str(excinfo.value)


def test_nothing_fits_names_device_and_sizes():
    memory, macs = costs()[0.125]
    profile = CapabilityProfile(device_name="pi-zero-7", memory_bytes=memory - 1)
    with pytest.raises(NoTierFitsError) as excinfo:
        assign_tier(profile, SPEC, batch_size=BATCH)
    message = str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert "pi-zero-7" in message
    assert "γ=0.125" in message
    assert SPEC.describe() in message
    assert f"{memory / 2**20:.1f} MiB" in message  # what the smallest tier needs
    assert f"{macs / 1e6:.1f}M MACs" in message
    assert f"{(memory - 1) / 2**20:.1f} MiB" in message  # what the device declares
    assert "unlimited" in message  # no compute limit declared

    with pytest.raises(NoTierFitsError, match=r"0\.0M MACs"):
        assign_tier(CapabilityProfile(device_name="mcu", compute_macs=1.0), SPEC, batch_size=BATCH)


def test_custom_tier_list():
    table = costs()
    assert (
        assign_tier(CapabilityProfile(memory_bytes=table[0.25][0]), SPEC, tiers=(0.125, 0.5, 0.25), batch_size=BATCH)
        == 0.25
    )
    with pytest.raises(NoTierFitsError, match=r"γ=0\.5"):
        assign_tier(CapabilityProfile(memory_bytes=table[0.25][0]), SPEC, tiers=(1.0, 0.5), batch_size=BATCH)
    with pytest.raises(ValueError, match="preferred tier"):
        assign_tier(CapabilityProfile(preferred_tier=0.125), SPEC, tiers=(1.0, 0.5), batch_size=BATCH)


def test_unfactorized_models_have_one_size():
    spec = ModelSpec("lenet-cifar10", 10, "none")
    memory = memory_of(spec)
    assert assign_tier(CapabilityProfile(memory_bytes=memory), spec, batch_size=BATCH) == 1.0
    with pytest.raises(NoTierFitsError):
        assign_tier(CapabilityProfile(memory_bytes=memory - 1), spec, batch_size=BATCH)


def test_resnet18_lowrank_phone_and_desktop():
    """FedHM §2.1's illustration, scaled: a budget between tiers lands on the tier below it. A conv net's
    activations dominate: γ = ⅛ holds 19 MiB of parameter state but saves 4.7 MiB a sample for backward."""
    with torch.device("meta"):  # derivation reads shapes only; skips the SVD initialization
        spec = ModelSpec("resnet18", 10, "lowrank")
        table = tier_costs(spec, batch_size=BATCH)
    assert spec.num_parameters == 11_173_962 and spec.at_tier(0.125).num_parameters == 1_236_042
    assert table[1.0][0] == 11_173_962 * 16 + BATCH * spec.activation_bytes[0] + spec.activation_bytes[1]
    assert 4.5 * 2**20 < spec.at_tier(0.125).activation_bytes[0] < 5 * 2**20
    assert 60 * 2**20 < table[0.125][0] < 70 * 2**20  # parameters × 16 B alone said 19 MiB
    assert assign_tier(CapabilityProfile(memory_bytes=100 * 2**20), spec, batch_size=BATCH) == 0.25  # 100 MiB
    assert assign_tier(CapabilityProfile(memory_bytes=150 * 2**20), spec, batch_size=BATCH) == 0.5
    assert assign_tier(CapabilityProfile(memory_bytes=256 * 2**20), spec, batch_size=BATCH) == 1.0
    with pytest.raises(NoTierFitsError, match=r"in batches of 10"):
        assign_tier(CapabilityProfile(memory_bytes=20 * 2**20), spec, batch_size=BATCH)
    # the batch the federation trains in moves the tier: 400 MiB train γ = 1 in tens, γ = ¼ in 64s
    assert assign_tier(CapabilityProfile(memory_bytes=400 * 2**20), spec, batch_size=BATCH) == 1.0
    assert assign_tier(CapabilityProfile(memory_bytes=400 * 2**20), spec, batch_size=64) == 0.25


@pytest.mark.parametrize("model", ["digits-cnn", "lenet-cifar100"])
@pytest.mark.parametrize("factorization", FACTORIZATIONS)
def test_costs_never_grow_as_the_tier_shrinks(model, factorization):
    table = tier_costs(ModelSpec(model, MODELS[model].default_classes, factorization), batch_size=BATCH)
    for bigger, smaller in itertools.pairwise(TIERS):
        assert table[smaller][0] <= table[bigger][0]
        assert table[smaller][1] <= table[bigger][1]


def test_profile_to_dict():
    profile = CapabilityProfile("phone", compute_macs=1e9, memory_bytes=2**30, preferred_tier=0.5)
    data = profile.to_dict()
    assert data["device_name"] == "phone" and data["memory_bytes"] == 2**30 and data["preferred_tier"] == 0.5
    assert CapabilityProfile(**data) == profile


# --------------------------------------------------------------------------- properties


@HYP
@given(
    st.integers(min_value=0, max_value=12_000_000),
    st.integers(min_value=0, max_value=12_000_000),
)
def test_more_memory_never_gives_a_smaller_tier(a, b):
    low, high = sorted((a, b))
    t_low = tier_or_zero(CapabilityProfile(memory_bytes=low))
    t_high = tier_or_zero(CapabilityProfile(memory_bytes=high))
    assert t_low <= t_high
    assert t_low == fitting_oracle(memory=low)
    assert t_high == fitting_oracle(memory=high)


@HYP
@given(
    memory=st.one_of(st.none(), st.integers(min_value=0, max_value=10_000_000)),
    macs=st.one_of(st.none(), st.floats(min_value=0, max_value=2e7, allow_nan=False)),
    preferred=st.one_of(st.none(), st.sampled_from(TIERS)),
)
def test_assignment_is_the_largest_fitting_tier(memory, macs, preferred):
    profile = CapabilityProfile(memory_bytes=memory, compute_macs=macs, preferred_tier=preferred)
    expected = fitting_oracle(memory, macs, preferred)
    if expected == 0.0 and (memory is not None or macs is not None):
        with pytest.raises(NoTierFitsError):
            assign_tier(profile, SPEC, batch_size=BATCH)
    else:
        assert assign_tier(profile, SPEC, batch_size=BATCH) == expected


def test_match_tier_names_a_tier_but_for_float_rounding() -> None:
    tiers = [1, 0.25, 0.125]
    assert match_tier(1 / 4, tiers) == 0.25
    assert match_tier((0.1 + 0.25) - 0.1, tiers) == 0.25  # 0.24999999999999997
    assert match_tier(1.0, tiers) == 1.0 and isinstance(match_tier(1.0, tiers), float)
    assert match_tier(0.5, tiers) is None
    assert match_tier(0.25 * (1 + 1e-6), tiers) is None  # another number, not a rounding of 0.25
