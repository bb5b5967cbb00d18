"""Tests for aggregator_service.intervals: FedAvg, the fixed fast/slow schedule and FedLAMA.

FedLAMA's Algorithm 2 is checked against a worked example whose arithmetic is written out
below (specs/fedlama.md §4), and its guarantees (full sync every φτ', non-kernels never
relaxed, φ = 1 is FedAvg, identical resume after a restart) over random discrepancy
sequences.
"""

from __future__ import annotations

import json
import math
import random
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggregator_service.intervals import (
    POLICIES,
    EveryRound,
    FedLAMA,
    FixedSchedule,
    IntervalPolicy,
    build_policy,
    discrepancy,
    is_relaxable,
    lama_adjust,
    lama_trace,
)
from fedcore.spec import ModelSpec, TensorSpec


def ts(name: str, shape: tuple[int, ...], role: str = "body", dtype: str = "float32") -> TensorSpec:
    return TensorSpec(name, shape, dtype, role)


# Five relaxable kernels with dims [100, 400, 50, 1000, 200] and five tensors that are never relaxed.
HAND = (
    ts("conv1.weight", (4, 1, 5, 5)),  # dim 100
    ts("conv1.bias", (4,)),
    ts("conv2.weight", (4, 4, 5, 5)),  # dim 400
    ts("bn.weight", (4,)),
    ts("bn.running_mean", (4,), "buffer"),
    ts("bn.num_batches_tracked", (), "buffer", "int64"),
    ts("fc1.weight", (5, 10)),  # dim 50
    ts("fc2.weight", (10, 100)),  # dim 1000
    ts("head.weight", (2, 100), "head"),  # dim 200
    ts("head.bias", (2,), "head"),
)
KERNELS = ("conv1.weight", "conv2.weight", "fc1.weight", "fc2.weight", "head.weight")
FIXED = ("conv1.bias", "bn.weight", "bn.running_mean", "bn.num_batches_tracked", "head.bias")
HAND_NAMES = [t.name for t in HAND]
DIMS = {"conv1.weight": 100, "conv2.weight": 400, "fc1.weight": 50, "fc2.weight": 1000, "head.weight": 200}
# d chosen so that d·dim is 60, 10, 100, 10, 20 (total Σ d·dim = 200; Σ dim = 1750)
D = {"conv1.weight": 0.6, "conv2.weight": 0.025, "fc1.weight": 2.0, "fc2.weight": 0.01, "head.weight": 0.1}
DIGITS = ModelSpec("digits-cnn", 10, "atoms").full().tensors
COEFFS = ("conv1.coefficients", "conv2.coefficients")


def run(policy: IntervalPolicy, d_rows: list[dict[str, float]], start: int = 1) -> list[tuple]:
    """Drive ``policy`` like the round coordinator: due(r), aggregate, observe(r) with d of the due tensors."""
    log = []
    for r, row in enumerate(d_rows, start=start):
        due = policy.due(r)
        changed = policy.observe(r, {n: row[n] for n in due if n in row})
        log.append((r, due, changed, policy.intervals()))
    return log


# -- Algorithm 2 ----------------------------------------------------------------------------------


def test_hand_computed_crossing() -> None:
    trace = lama_trace(D, DIMS)
    # ascending d: fc2 (0.01), conv2 (0.025), head (0.1), conv1 (0.6), fc1 (2.0)
    assert trace.order == ("fc2.weight", "conv2.weight", "head.weight", "conv1.weight", "fc1.weight")
    # δ_l = cumulative d·dim / 200:  10/200, 20/200, 40/200, 100/200, 200/200
    assert trace.delta == pytest.approx([0.05, 0.10, 0.20, 0.50, 1.0])
    # λ_l = cumulative dim / 1750:  1000, 1400, 1600, 1700, 1750  →  4/7, 4/5, 32/35, 34/35, 1
    assert trace.lam == pytest.approx([4 / 7, 0.8, 32 / 35, 34 / 35, 1.0])
    # 1 − λ_l = 0.4286, 0.2, 0.0857, 0.0286, 0
    # l=1: 0.05 > 0.4286? no.   l=2: 0.10 > 0.2? no.   l=3: 0.20 > 0.0857? yes → crossing at l=3
    assert trace.crossing == 2  # 0-based position of head.weight, which is itself relaxed
    assert trace.relaxed == ("fc2.weight", "conv2.weight", "head.weight")
    intervals = lama_adjust(D, DIMS, tau_base=2, phi=3)
    assert intervals == {"conv1.weight": 2, "conv2.weight": 6, "fc1.weight": 2, "fc2.weight": 6, "head.weight": 6}
    assert list(intervals) == list(DIMS)  # spec order
    # The printed rule `δ_l < λ_l` (0.05<0.57, 0.1<0.8, 0.2<0.91, 0.5<0.97, but not 1<1) relaxes four tensors:
    # every one but the largest-d tensor, i.e. 1700/1750 = 97% of the parameters instead of 1600/1750 = 91%.
    literal = {n for n, delta, lam in zip(trace.order, trace.delta, trace.lam, strict=True) if delta < lam}
    assert literal == {"fc2.weight", "conv2.weight", "head.weight", "conv1.weight"}
    assert literal > set(trace.relaxed)


def test_tie_does_not_cross_and_is_decided_exactly() -> None:
    # all d equal → δ_l = λ_l exactly; dims 3, 2, 1 give λ_1 = 1/2, so l=1 is a tie δ_1 = 1 − λ_1 (no crossing);
    # l=2: δ = 5/6 > 1/6 crosses. In floats 0.1·3 / (0.1·3 + 0.1·2 + 0.1·1) = 0.5000000000000001 would cross at l=1.
    dims = {"a": 3, "b": 2, "c": 1}
    d = dict.fromkeys(dims, 0.1)
    naive = (0.1 * 3) / (0.1 * 3 + 0.1 * 2 + 0.1 * 1)
    assert naive > 1 - 3 / 6  # what rounding would have decided
    trace = lama_trace(d, dims)
    assert trace.order == ("a", "b", "c")  # ties keep spec order
    assert trace.crossing == 1
    assert trace.relaxed == ("a", "b")
    # equal dims: λ hits 1/2 at l=2 (tie), crossing at l=3
    assert lama_trace(dict.fromkeys("wxyz", 0.3), dict.fromkeys("wxyz", 1)).relaxed == ("w", "x", "y")


def test_zero_discrepancy_relaxes_nothing() -> None:
    trace = lama_trace(dict.fromkeys(DIMS, 0.0), DIMS)
    assert trace.crossing is None and trace.relaxed == ()
    assert lama_adjust(dict.fromkeys(DIMS, 0.0), DIMS, 3, 4) == dict.fromkeys(DIMS, 3)
    assert lama_adjust({}, {}, 1, 2) == {}


def test_lama_adjust_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no discrepancy"):
        lama_adjust({"fc1.weight": 1.0}, DIMS, 1, 2)
    with pytest.raises(ValueError, match="finite number ≥ 0"):
        lama_adjust({**D, "fc1.weight": -1.0}, DIMS, 1, 2)
    with pytest.raises(ValueError, match="phi must be an integer ≥ 1"):
        lama_adjust(D, DIMS, 1, 0)


def test_relaxable_tensors() -> None:
    assert [t.name for t in HAND if is_relaxable(t)] == list(KERNELS)
    digits = [t.name for t in DIGITS if is_relaxable(t)]
    assert digits == [
        "conv1.atoms",
        "conv1.coefficients",
        "conv2.atoms",
        "conv2.coefficients",
        "fc1.weight",
        "head.weight",
    ]


# -- FedLAMA policy -------------------------------------------------------------------------------


def test_fedlama_applies_hand_example_from_next_round() -> None:
    policy = FedLAMA(HAND, tau_base=2, phi=3)
    assert policy.sync_period == 6 and policy.intervals() == dict.fromkeys(HAND_NAMES, 2)
    # the never-relaxable tensors get the smallest d of all, and still stay at τ'
    row = {**D, **dict.fromkeys(FIXED, 0.0)}
    log = run(policy, [row] * 6)
    assert [due for _, due, _, _ in log] == [[], HAND_NAMES, [], HAND_NAMES, [], HAND_NAMES]
    assert [changed is None for _, _, changed, _ in log] == [True] * 5 + [False]
    expected = {n: 6 if n in ("conv2.weight", "fc2.weight", "head.weight") else 2 for n in HAND_NAMES}
    assert log[-1][2] == expected and policy.intervals() == expected
    assert policy.due(7) == []
    assert policy.due(8) == [n for n in HAND_NAMES if expected[n] == 2]
    assert policy.due(12) == HAND_NAMES


def test_only_multiples_of_period_after_warmup_adjust() -> None:
    policy = FedLAMA(HAND, tau_base=1, phi=2, warmup_rounds=4)
    row = {**D, **dict.fromkeys(FIXED, 1.0)}
    log = run(policy, [row] * 5)
    assert all(changed is None for _, _, changed, _ in log)  # rounds 2 and 4 are inside the warm-up
    assert all(due == HAND_NAMES for _, due, _, _ in log)
    assert policy.due(6) == HAND_NAMES  # planned before round 6 closes
    changed = policy.observe(6, row)
    assert changed is not None and {n for n, tau in changed.items() if tau == 2} == {
        "fc2.weight",
        "conv2.weight",
        "head.weight",
    }
    assert policy.due(7) == [n for n in HAND_NAMES if changed[n] == 1]  # in force from round 7
    assert policy.due(8) == HAND_NAMES
    # the same d again: nothing changes at round 8, and round 7 (odd) never adjusts
    assert policy.observe(7, {n: 50.0 for n in policy.due(7)}) is None
    assert policy.observe(8, row) is None


def test_no_memory_between_adjustments() -> None:
    policy = FedLAMA(HAND, tau_base=1, phi=2)
    assert policy.observe(1, D) is None
    first = policy.observe(2, D)
    assert first is not None and {n for n, tau in first.items() if tau == 2} == {
        "fc2.weight",
        "conv2.weight",
        "head.weight",
    }
    # new ranking: d·dim = fc1 0.5, conv1 2, fc2 60, head 20, conv2 80 (total 162.5)
    # ascending d: fc1, conv1, fc2 | head, conv2; at fc2 δ = 62.5/162.5 = 0.385 > 1 − 1150/1750 = 0.343 → cut
    # (fc2 holds 57% of the parameters: the LCL always covers > 50%, since δ_l ≤ λ_l, so fc2 is always relaxed)
    second_d = {"conv1.weight": 0.02, "conv2.weight": 0.2, "fc1.weight": 0.01, "fc2.weight": 0.06, "head.weight": 0.1}
    policy.observe(3, {n: second_d[n] for n in policy.due(3) if n in second_d})
    second = policy.observe(4, second_d)
    relaxed = {"fc1.weight", "conv1.weight", "fc2.weight"}
    assert second == {n: 2 if n in relaxed else 1 for n in HAND_NAMES}  # conv2 and head are back at τ'


def test_missing_discrepancy_keeps_base_interval() -> None:
    policy = FedLAMA(HAND, tau_base=1, phi=2)
    assert policy.observe(1, {}) is None and policy.observe(2, {}) is None  # nothing measured: all stay at τ'
    # only fc1 and fc2 measured (say the others are personal and never aggregated): Alg. 2 runs on those two
    # ascending d: fc2 (0.5·1000 = 500), fc1 (1.0·50 = 50); at fc2 δ = 500/550 = 0.91 > 1 − 1000/1050 = 0.048
    changed = policy.observe(4, {"fc1.weight": 1.0, "fc2.weight": 0.5})
    assert changed == {n: 2 if n == "fc2.weight" else 1 for n in HAND_NAMES}
    assert policy.observed == {"fc1.weight": 1.0, "fc2.weight": 0.5}


d_value = st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=1e3, allow_nan=False, allow_subnormal=False))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    tau_base=st.integers(1, 4),
    phi=st.integers(1, 4),
    warmup=st.integers(0, 12),
    rows=st.lists(st.lists(d_value, min_size=len(HAND), max_size=len(HAND)), min_size=60, max_size=60),
)
def test_full_sync_every_period(tau_base: int, phi: int, warmup: int, rows: list[list[float]]) -> None:
    policy = FedLAMA(HAND, tau_base=tau_base, phi=phi, warmup_rounds=warmup)
    period = phi * tau_base
    assert policy.sync_period == period
    before = policy.intervals()
    for r, row in enumerate(rows, 1):
        due = policy.due(r)
        if r % period == 0:
            assert due == HAND_NAMES
        changed = policy.observe(r, {n: v for n, v in zip(HAND_NAMES, row, strict=True) if n in due})
        after = policy.intervals()
        assert set(after.values()) <= {tau_base, period}
        assert all(after[n] == tau_base for n in FIXED)
        if r % period or r <= warmup:
            assert changed is None and after == before
        else:  # re-decided from scratch from the d measured at this full sync
            expected = dict.fromkeys(HAND_NAMES, tau_base)
            expected.update(lama_adjust(dict(zip(HAND_NAMES, row, strict=True)), DIMS, tau_base, phi))
            assert after == expected
            assert changed == (None if after == before else after)
        before = after


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_phi_one_is_every_round(seed: int) -> None:
    rng = random.Random(seed)
    rows = [{n: rng.choice([0.0, rng.expovariate(1.0)]) for n in HAND_NAMES} for _ in range(50)]
    lama, fedavg = run(FedLAMA(HAND, tau_base=1, phi=1), rows), run(EveryRound(HAND), rows)
    assert [due for _, due, _, _ in lama] == [due for _, due, _, _ in fedavg] == [HAND_NAMES] * 50
    assert all(changed is None for _, _, changed, _ in lama)


# -- fixed fast/slow schedule ---------------------------------------------------------------------


def test_fixed_beta_one_is_every_round() -> None:
    fixed, fedavg = FixedSchedule(DIGITS, beta=1), EveryRound(DIGITS)
    assert fixed.sync_period == fedavg.sync_period == 1
    assert all(fixed.due(r) == fedavg.due(r) == [t.name for t in DIGITS] for r in range(1, 31))


def test_fixed_one_fifth_slows_coefficients() -> None:
    policy = FixedSchedule(DIGITS, beta=0.2)
    assert policy.sync_period == 5
    assert policy.intervals() == {t.name: 5 if t.name in COEFFS else 1 for t in DIGITS}
    for r in range(1, 31):
        due = policy.due(r)
        assert all(n in due for n in ("conv1.atoms", "conv2.atoms", "head.weight", "head.bias", "fc1.weight"))
        assert (COEFFS[0] in due) == (COEFFS[1] in due) == (r in (5, 10, 15, 20, 25, 30))
        assert policy.observe(r, dict.fromkeys(due, 1.0)) is None
    assert FixedSchedule(DIGITS, beta=1 / 3).interval("conv2.coefficients") == 3


@pytest.mark.parametrize("beta", [0, 1.5, 0.3, -0.2, math.nan, math.inf, True, "0.2"])
def test_fixed_rejects_bad_beta(beta: object) -> None:
    with pytest.raises(ValueError, match="beta"):
        FixedSchedule(DIGITS, beta=beta)  # type: ignore[arg-type]


def test_fixed_slow_roles() -> None:
    tier = [
        ts("c.coefficients_u", (8, 2), "coefficients_u"),
        ts("c.coefficients_v", (2, 9), "coefficients_v"),
        ts("c.atoms", (9, 3, 3), "atoms"),
    ]
    assert FixedSchedule(tier, beta=0.25).intervals() == {"c.coefficients_u": 4, "c.coefficients_v": 4, "c.atoms": 1}
    atoms_slow = FixedSchedule(DIGITS, beta=0.5, slow_roles="atoms")
    assert {n for n, tau in atoms_slow.intervals().items() if tau == 2} == {"conv1.atoms", "conv2.atoms"}
    assert FixedSchedule(DIGITS, beta=0.5, slow_roles=()).sync_period == 1
    with pytest.raises(ValueError, match="unknown slow roles"):
        FixedSchedule(DIGITS, beta=0.5, slow_roles=("coefficient",))


# -- persistence ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("fedlama", {"tau_base": 2, "phi": 3, "warmup_rounds": 5}),
        ("fedlama", {"tau_base": 1, "phi": 4}),
        ("fixed", {"beta": 0.25}),
        ("every_round", {}),
    ],
)
def test_restart_mid_run_resumes_identically(name: str, params: dict) -> None:
    rng = random.Random(7)
    rows = [{n: rng.choice([0.0, rng.lognormvariate(0, 2)]) for n in HAND_NAMES} for _ in range(60)]
    reference = build_policy(name, HAND, **params)
    expected = run(reference, rows)
    crashed = build_policy(name, HAND, **params)
    head = run(crashed, rows[:23])
    saved = json.dumps(crashed.state_dict())  # what the service persists with round 23
    restarted = build_policy(name, HAND, **params)
    restarted.load_state_dict(json.loads(saved))
    assert restarted.state_dict() == json.loads(saved)
    assert head + run(restarted, rows[23:], start=24) == expected
    if name == "fedlama":
        assert len({tuple(i.values()) for *_, i in expected}) > 1  # the run really did change intervals


def test_load_state_rejects_mismatches_without_changing_anything() -> None:
    policy = FedLAMA(HAND, tau_base=1, phi=2)
    run(policy, [D] * 2)
    state = policy.state_dict()
    other = FedLAMA(HAND, tau_base=1, phi=2)
    bad_states = [
        {**state, "policy": "fixed"},
        {**state, "format": 99},
        {**state, "params": {**state["params"], "phi": 4}},
        {**state, "intervals": {n: 1 for n in HAND_NAMES[:-1]}},
        {**state, "intervals": {**state["intervals"], "conv1.bias": 2}},  # biases are never relaxed
        {**state, "intervals": {**state["intervals"], "fc1.weight": 3}},  # not τ' or φτ'
        {**state, "discrepancy": {"nope": 1.0}},
        {**state, "discrepancy": {"fc1.weight": -1.0}},
        {**state, "last_observed": -1},
    ]
    for bad in bad_states:
        with pytest.raises(ValueError):
            other.load_state_dict(bad)
        assert other.state_dict() == FedLAMA(HAND, tau_base=1, phi=2).state_dict()
    with pytest.raises(ValueError, match="parameters"):
        FixedSchedule(HAND, beta=0.5).load_state_dict(FixedSchedule(HAND, beta=0.25).state_dict())
    with pytest.raises(ValueError, match="exactly"):
        EveryRound(HAND).load_state_dict(EveryRound(DIGITS).state_dict())


# -- validation, factory, formula -----------------------------------------------------------------


def test_observe_and_due_validation() -> None:
    policy = FedLAMA(HAND)
    with pytest.raises(ValueError, match="not in this policy"):
        policy.observe(1, {"fc9.weight": 1.0})
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite number ≥ 0"):
            policy.observe(1, {"fc1.weight": bad})
    for r in (0, -3, 1.0, True):
        with pytest.raises(ValueError, match="rounds are integers"):
            policy.due(r)  # type: ignore[arg-type]
    policy.observe(3, {})
    with pytest.raises(ValueError, match="observed after round 3"):
        policy.observe(3, {})
    with pytest.raises(KeyError, match=r"fc9\.weight"):
        policy.interval("fc9.weight")
    with pytest.raises(ValueError, match="duplicate"):
        EveryRound([*HAND, HAND[0]])


def test_build_policy() -> None:
    assert set(POLICIES) == {"every_round", "fixed", "fedlama"}
    assert type(build_policy("every_round", DIGITS)) is EveryRound
    assert build_policy("fixed", DIGITS, beta=0.1).sync_period == 10
    lama = build_policy("fedlama", DIGITS, tau_base=2, phi=2.0, warmup_rounds=3)
    assert isinstance(lama, FedLAMA) and (lama.tau_base, lama.phi, lama.warmup_rounds, lama.sync_period) == (2, 2, 3, 4)
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("fedavg", {}, "unknown interval policy 'fedavg'; choose one of every_round, fixed, fedlama"),
        ("fixed", {}, "needs beta"),
        ("fixed", {"beta": 0.5, "phi": 2}, "unexpected phi"),
        ("every_round", {"beta": 0.5}, "takes no parameters"),
        ("fedlama", {"phi": 0}, "phi must be an integer ≥ 1"),
        ("fedlama", {"phi": 2.5}, "phi must be an integer ≥ 1"),
        ("fedlama", {"tau_base": 0}, "tau_base must be an integer ≥ 1"),
        ("fedlama", {"warmup_rounds": -1}, "warmup_rounds must be an integer ≥ 0"),
        ("fixed", {"beta": 0.3}, "1/beta must be a whole number"),
    ]
    for name, params, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            build_policy(name, DIGITS, **params)


def test_discrepancy_formula() -> None:
    # two clients x¹ = (1, 2), x² = (3, 6) with p = (1/4, 3/4) → u = (2.5, 5)
    # ‖u − x¹‖² = 1.5² + 3² = 11.25, ‖u − x²‖² = 0.5² + 1² = 1.25; Σ p‖u − x‖² = 2.8125 + 0.9375 = 3.75
    # d = 3.75 / (τ = 3 · dim = 2) = 0.625
    assert discrepancy(3.75, 3, 2) == pytest.approx(0.625)
    assert discrepancy(3.75, 1, 2) == pytest.approx(1.875)
    assert discrepancy(-1e-12, 2, 10) == 0.0  # streamed variance rounding below zero
    assert discrepancy(0.0, 1, 0) == 0.0  # an empty tensor (a 0-element buffer): nothing to disagree on
    for args in ((1.0, 0, 2), (1.0, 1, -1), (math.nan, 1, 2), (math.inf, 1, 2)):
        with pytest.raises(ValueError):
            discrepancy(*args)
