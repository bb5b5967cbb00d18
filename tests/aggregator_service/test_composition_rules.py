"""The rules that make atoms, tiers and FedLAMA compose, each against a hand-derived case.

- ``lama_protect = "head_and_first"``: the head and the first kernel's layer never get the long interval;
- ``hold_cohort = "while_relaxed"``: a period cohort is kept only while some tensor is relaxed;
- plain FedAvg's record is the same whichever cohort rule or tier cut is configured.
"""

from __future__ import annotations

import re

import pytest

from aggregator_service.intervals import FedLAMA, protected_modules
from fedatoms.simulate import SimulationConfig, run_simulation
from fedcore.spec import ModelSpec, TensorSpec


def ts(name: str, shape: tuple[int, ...], role: str = "body") -> TensorSpec:
    return TensorSpec(name, shape, "float32", role)


# dims: conv1 100, conv2 400, fc1 50, fc2 1000, head 200 (as in test_intervals.py)
HAND = (
    ts("conv1.weight", (4, 1, 5, 5)),
    ts("conv1.bias", (4,)),
    ts("conv2.weight", (4, 4, 5, 5)),
    ts("bn.running_mean", (4,), "buffer"),
    ts("fc1.weight", (5, 10)),
    ts("fc2.weight", (10, 100)),
    ts("head.weight", (2, 100), "head"),
    ts("head.bias", (2,), "head"),
)
NAMES = [t.name for t in HAND]
# d·dim: conv1 60, conv2 10, fc1 100, fc2 10, head 20
D = {"conv1.weight": 0.6, "conv2.weight": 0.025, "fc1.weight": 2.0, "fc2.weight": 0.01, "head.weight": 0.1}
ROW = {**D, "conv1.bias": 1.0, "bn.running_mean": 1.0, "head.bias": 1.0}


def test_protected_modules_are_the_head_and_the_first_kernel() -> None:
    assert protected_modules(HAND, "head_and_first") == {"head", "conv1"}
    assert protected_modules(HAND, "none") == frozenset()
    atoms = ModelSpec("digits-cnn", 10, "atoms").full().tensors  # conv1.atoms comes first: its module is conv1
    assert protected_modules(atoms, "head_and_first") == {"head", "conv1"}
    with pytest.raises(ValueError, match="protect"):
        protected_modules(HAND, "first")


def test_protection_keeps_the_head_at_the_base_interval() -> None:
    # the paper's rule: ascending d fc2 (0.01), conv2, head, conv1, fc1; Σd·dim = 200, Σdim = 1750;
    # at head δ = 40/200 = 0.2 > 1 − 1600/1750 = 0.086: fc2, conv2 and head are relaxed
    paper = FedLAMA(HAND, tau_base=1, phi=2)
    paper.observe(1, ROW)
    assert {n for n, tau in paper.observe(2, ROW).items() if tau == 2} == {"fc2.weight", "conv2.weight", "head.weight"}
    # protected: candidates fc2, conv2, fc1 (Σd·dim = 120, Σdim = 1450); fc2: δ = 10/120 = 0.083 ≤ 1 − 1000/1450
    # = 0.31, go on; conv2: δ = 20/120 = 0.167 > 1 − 1400/1450 = 0.034, cut there (conv2 included)
    kept = FedLAMA(HAND, tau_base=1, phi=2, protect="head_and_first")
    kept.observe(1, ROW)
    assert kept.observe(2, ROW) == {n: 2 if n in ("fc2.weight", "conv2.weight") else 1 for n in NAMES}
    assert kept.params()["protect"] == "head_and_first"


def test_cohort_is_held_only_while_something_is_relaxed() -> None:
    held = FedLAMA(HAND, tau_base=1, phi=2, warmup_rounds=2, hold_cohort="while_relaxed")
    paper = FedLAMA(HAND, tau_base=1, phi=2, warmup_rounds=2)
    periods = []
    for r in range(1, 7):
        periods.append((held.cohort_period, paper.cohort_period))
        # rounds 2 (warm-up) and 4 relax nothing / something; round 6 sees every d equal: nothing... see below
        d = ROW if r != 6 else dict.fromkeys(NAMES, 0.0)
        held.observe(r, {n: v for n, v in d.items() if n in held.due(r)})
        paper.observe(r, {n: v for n, v in d.items() if n in paper.due(r)})
    # rounds 1–4: all intervals 1 (no adjustment in the warm-up, round 4's applies from round 5);
    # rounds 5–6: fc2, conv2 and head at 2; from round 7 all back at 1 (all d = 0 at round 6 relax nothing)
    assert periods == [(1, 2), (1, 2), (1, 2), (1, 2), (2, 2), (2, 2)]
    assert held.cohort_period == 1 and paper.cohort_period == 2


@pytest.mark.parametrize(
    ("key", "values"),
    [
        ("cohort", ("per_round", "period")),
    ],
)
def test_plain_fedavg_record_is_the_same_under_either_rule(key: str, values: tuple[str, str]) -> None:
    """Cohort rules change nothing for plain FedAvg, to the bit (the tier and FedLAMA rules cannot be set for it:
    the next test)."""
    common = {"rounds": 2, "clients": 6, "fraction": 0.5, "local_epochs": 1, "seed": 4}
    a, b = (run_simulation(SimulationConfig(**common, **{key: v}))["rounds"] for v in values)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rs]  # noqa: E731
    assert strip(a) == strip(b)


@pytest.mark.parametrize(
    ("phi", "periods", "rounds"),
    # hand-derived: the official code's 6 rounds are 3 adjustment periods of φ = 2 rounds; "periods" keeps
    # 3 periods of φ·τ' (τ' = 1) rounds at every φ, "rounds" keeps 6 rounds at every φ
    [(1, 3, 6), (2, 6, 6), (3, 9, 6), (4, 12, 6)],
)
def test_fedlama_warms_up_for_three_adjustment_periods_at_any_phi(phi: int, periods: int, rounds: int) -> None:
    for rule, expected in (("periods", periods), ("rounds", rounds)):
        config = SimulationConfig(interval_policy="fedlama", phi=phi, lama_warmup=rule)
        policy = config.build_federation(num_clients_total=10).policy
        assert policy.warmup_rounds == expected, (phi, rule)


def test_fedlama_relaxes_nothing_in_its_warmup_at_phi_4() -> None:
    """φ = 4: under "periods" every tensor syncs every round through round 12 (the warm-up) and the first
    adjustment (round 16) relaxes something; under "rounds" (6) the one at round 8 does (digits, seed 0)."""
    common = {"clients": 6, "fraction": 1.0, "local_epochs": 1, "seed": 0, "lr": 0.05}
    common |= {"factorization": "atoms", "interval_policy": "fedlama", "phi": 4}
    for rule, rounds in (("periods", 18), ("rounds", 10)):  # each run just past its first adjustment
        records = run_simulation(SimulationConfig(**common, rounds=rounds, lama_warmup=rule))["rounds"]
        # a record shows the intervals its round's close set: the first adjustment's round, 16 or 8
        relaxed = [r["round"] for r in records if any(t["interval"] > 1 for t in r["tensors"].values())]
        assert relaxed and (min(relaxed) > 12 if rule == "periods" else min(relaxed) <= 12), (rule, relaxed)


@pytest.mark.parametrize(
    ("method", "key", "value", "why"),
    [
        ({}, "beta", 0.5, "only the fixed interval policy reads it, and interval_policy is 'every_round'"),
        ({}, "phi", 4, "only the fedlama interval policy reads it"),
        ({}, "warmup_rounds", 0, "only the fedlama interval policy reads it"),
        ({}, "lama_warmup", "rounds", "only the fedlama interval policy reads it"),
        ({}, "lama_protect", "none", "only the fedlama interval policy reads it"),
        ({}, "slow_tensors", "all_but_atoms", "only the fixed interval policy reads it"),
        ({"interval_policy": "fedlama"}, "hold_cohort", "sync_period", "cohort is 'per_round': a new one every round"),
        ({"interval_policy": "fedlama"}, "beta", 0.5, "only the fixed interval policy reads it"),
        ({"factorization": "atoms", "interval_policy": "fixed"}, "tau", 2, "only the fedlama interval policy"),
        ({}, "tier_init", "truncated", "it cuts tiers below 1, and every tier is 1"),
        ({"factorization": "lowrank", "tiers": [0.125]}, "tier_average", "aligned", "every client is at tier 0.125"),
        ({"factorization": "lowrank", "tiers": [0.5]}, "tier_training", "own", "how mixed tiers train together"),
    ],
)
def test_a_key_the_method_never_reads_is_refused(method: dict, key: str, value: object, why: str) -> None:
    """Set away from its default, a key the chosen method does not read would run without a word and change
    nothing (``--beta`` under FedLAMA, a mixed tiers' rule with one tier): refused, saying why."""
    with pytest.raises(ValueError, match=rf"{key} = {value!r} would change nothing: .*{re.escape(why)}"):
        SimulationConfig(**method, **{key: value})
    SimulationConfig(**method)  # the method itself is fine


def test_an_unknown_policy_is_named_before_the_keys_it_would_read() -> None:
    """A misspelled policy made its own keys look unread: "phi = 4 would change nothing" for ``fedlamma``."""
    with pytest.raises(ValueError, match="unknown interval policy 'fedlamma'"):
        SimulationConfig(interval_policy="fedlamma", phi=4)


def test_a_key_the_method_reads_is_taken() -> None:
    fixed = SimulationConfig(factorization="atoms", interval_policy="fixed", beta=0.5).policy_params()
    assert fixed == {"beta": 0.5, "slow_roles": ("coefficients", "coefficients_u", "coefficients_v")}
    assert SimulationConfig(interval_policy="fedlama", phi=4, warmup_rounds=0).policy_params()["phi"] == 4
    mixed = SimulationConfig(factorization="lowrank", tiers=[1.0, 0.125], tier_average="aligned", tier_training="own")
    assert (mixed.tier_average, mixed.nested_rank_ratio) == ("aligned", None)
    assert SimulationConfig(factorization="lowrank", tiers=[0.125], tier_init="truncated").tier_init == "truncated"


def test_the_papers_whole_model_fast_slow_moves_the_atoms_alone_between_syncs() -> None:
    """The decomposition paper's §6.4: atoms every round, the whole model every 1/β rounds. Digits CNN with
    atoms, β = ½, 3 clients a round: round 1 pushes and re-fetches two convs' 9 atoms of 3 × 3 in fp32,
    2 · 9 · 9 · 4 = 648 bytes a client, and round 2 the whole model (605,872 bytes a client, as FedAvg's);
    with the coefficients slow (§4.2) round 1 also moves the biases, fc1 and the head."""
    common = {"factorization": "atoms", "interval_policy": "fixed", "beta": 0.5, "rounds": 2, "clients": 6}
    common |= {"fraction": 0.5, "local_epochs": 1}
    whole = run_simulation(SimulationConfig(**common, slow_tensors="all_but_atoms"))["rounds"]
    assert [(r["bytes_push"], r["bytes_eval_fetch"]) for r in whole] == [(3 * 648, 3 * 648), (3 * 605_872,) * 2]
    coefficients = run_simulation(SimulationConfig(**common))["rounds"]
    assert coefficients[0]["bytes_push"] > 3 * (4 * 128 * 1024)  # fc1 goes every round
    with pytest.raises(ValueError, match="slow_tensors must be one of coefficients, all_but_atoms"):
        SimulationConfig(**common, slow_tensors="atoms")


def test_an_unknown_lama_warmup_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="lama_warmup must be one of periods, rounds"):
        SimulationConfig(interval_policy="fedlama", lama_warmup="epochs")


def test_an_unknown_tier_init_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="tier_init must be one of energy, truncated"):
        SimulationConfig(tier_init="svd")


def test_fedlama_tau_above_1_needs_the_cohort_kept_for_the_period() -> None:
    """τ' = 3 syncs every tensor every third round; with a new cohort each round the clients of rounds 1 and 2
    restart from the global model and their training is never aggregated (0 bytes pushed, accuracy flat)."""
    with pytest.raises(ValueError, match=r'tau = 3 syncs every tensor only every 3 rounds.*cohort = "period"'):
        SimulationConfig(factorization="atoms", interval_policy="fedlama", tau=3)
    kept = SimulationConfig(factorization="atoms", interval_policy="fedlama", tau=3, cohort="period", rounds=3)
    record = run_simulation(kept)["rounds"]
    assert [r["bytes_push"] > 0 for r in record] == [False, False, True]  # local rounds, then the sync
