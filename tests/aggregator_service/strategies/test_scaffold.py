"""SCAFFOLD against FedAvg and controls updated by hand."""

from __future__ import annotations

import pytest
import torch
from strategy_helpers import DIGITS, LENET, random_tensors, run_round, update

from aggregator_service.strategies import FedAvg, Scaffold
from fedcore.spec import ModelSpec


def trainable(spec: ModelSpec) -> list[str]:
    return [t.name for t in spec.tensors if t.role != "buffer"]


def test_scaffold_with_zero_controls_is_fedavg_and_updates_controls_by_hand() -> None:
    gen = torch.Generator().manual_seed(9)
    global_tensors = random_tensors(DIGITS, gen)
    deltas = [{n: torch.randn(DIGITS.tensor(n).shape, generator=gen) for n in trainable(DIGITS)} for _ in range(3)]
    updates = [
        update(DIGITS, random_tensors(DIGITS, gen), n, f"c{i}", d)
        for i, (n, d) in enumerate(zip((5, 9, 3), deltas, strict=True))
    ]
    scaffold = Scaffold(num_clients_total=10, global_lr=1.0)
    assert scaffold.client_config() == {"scaffold": True}
    assert FedAvg().server_control() is None
    with pytest.raises(ValueError, match="spec"):
        scaffold.server_control()  # zeros of unknown shapes
    eager = Scaffold(num_clients_total=10, spec=LENET.at_tier(0.5)).server_control()
    assert eager is not None and set(eager) == set(trainable(LENET))  # the full model's trainables
    zeros = scaffold.server_control(DIGITS)
    assert set(zeros) == set(trainable(DIGITS)) and all(not c.any() for c in zeros.values())

    due = ["conv2.weight", "fc1.bias"]
    fedavg = run_round(FedAvg(), global_tensors, updates, due)
    result = run_round(scaffold, global_tensors, updates, due)
    assert result.tensors.keys() == fedavg.tensors.keys()
    assert all(torch.equal(result.tensors[n], fedavg.tensors[n]) for n in due)

    # c ← c + |S|/N · mean_k Δc_k, over every trainable tensor (due or not)
    control = scaffold.server_control(DIGITS)
    for name in trainable(DIGITS):
        expected = 0.3 * (deltas[0][name] + deltas[1][name] + deltas[2][name]) / 3
        torch.testing.assert_close(control[name], expected, rtol=1e-6, atol=1e-7)
    # a second round with two clients adds 2/10 of their mean
    run_round(scaffold, global_tensors, updates[:2], due)
    again = scaffold.server_control()
    name = "head.weight"
    expected = control[name] + 0.2 * (deltas[0][name] + deltas[1][name]) / 2
    torch.testing.assert_close(again[name], expected, rtol=1e-6, atol=1e-7)

    # state survives a restart
    restored = Scaffold(num_clients_total=10, spec=DIGITS)
    restored.load_state_dict(scaffold.state_dict())
    assert all(torch.equal(restored.server_control()[n], again[n]) for n in again)
    with pytest.raises(ValueError, match="does not fit"):
        restored.load_state_dict({"server_control": {"head.weight": torch.zeros(3)}})


def test_scaffold_server_learning_rate() -> None:
    gen = torch.Generator().manual_seed(11)
    global_tensors = random_tensors(DIGITS, gen)
    deltas = {n: torch.zeros(DIGITS.tensor(n).shape) for n in trainable(DIGITS)}
    updates = [update(DIGITS, random_tensors(DIGITS, gen), n, f"c{n}", deltas) for n in (4, 6)]
    fedavg = run_round(FedAvg(), global_tensors, updates)
    result = run_round(Scaffold(5, global_lr=0.5), global_tensors, updates)
    for name in global_tensors:
        expected = global_tensors[name] + 0.5 * (fedavg.tensors[name] - global_tensors[name])
        torch.testing.assert_close(result.tensors[name], expected)


def test_scaffold_rejects_low_rank_and_missing_controls() -> None:
    low = LENET.at_tier(0.5)
    scaffold = Scaffold(4)
    acc = scaffold.begin({}, [])
    with pytest.raises(ValueError, match="γ = 1"):
        scaffold.fold(acc, update(low, {}, 5, "a", {}))
    with pytest.raises(ValueError, match="control delta"):
        scaffold.fold(acc, update(DIGITS, {}, 5, "b"))
    with pytest.raises(ValueError, match="not a trainable"):
        scaffold.fold(acc, update(DIGITS, {}, 5, "c", {"bogus": torch.zeros(1)}))
    with pytest.raises(ValueError, match="num_clients_total"):
        Scaffold(0)


def test_scaffold_with_per_factor_step_sizes_is_refused_at_start() -> None:
    """c_i⁺ = c_i − c + (w_start − w_end)/(K·lr) assumes one lr; scaled atom steps break it, so the config says so."""
    from aggregator_service.config import FederationConfig

    with pytest.raises(ValueError, match="atom_lr = shared"):
        FederationConfig(strategy="scaffold", factorization="atoms")
    FederationConfig(strategy="scaffold", factorization="atoms", atom_lr="shared")
    FederationConfig(strategy="scaffold", factorization="none")


@pytest.mark.slow
def test_scaffold_learns_at_least_as_fast_as_fedavg_on_two_class_shards() -> None:
    """Issue 21's bar: under the papers' momentum 0.9 SCAFFOLD stayed at 10% while FedAvg climbed.

    Two classes per client, 10 clients, half of them a round, 8 rounds: SCAFFOLD's mean test accuracy
    over the rounds is at least FedAvg's (0.30 against 0.24 at seed 0; the old control stayed at 0.10).
    """
    from fedatoms.simulate import SimulationConfig, run_simulation

    common = dict(dataset="digits", clients=10, fraction=0.5, partition="shards", classes_per_client=2, rounds=8)

    def mean_accuracy(strategy: str) -> float:
        rounds = run_simulation(SimulationConfig(**common, strategy=strategy, seed=0))["rounds"]
        return sum(r["test_accuracy"] for r in rounds) / len(rounds)

    fedavg, scaffold = mean_accuracy("fedavg"), mean_accuracy("scaffold")
    assert scaffold >= fedavg > 0.15, (scaffold, fedavg)
