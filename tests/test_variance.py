"""The papers' variance (fedatoms.variance): the estimator by hand, and a small real run against oracles."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fedatoms.cli import main
from fedatoms.simulate import SimulationConfig
from fedatoms.variance import aggregate_variance, compare, conv_filters, format_table, repeated_aggregates
from fedcore.data import load_dataset


def test_aggregate_variance_by_hand() -> None:
    # two repetitions of a 2-element "filter": mean (2, 1); each lies (1, 1) away → ‖·‖² = 2 each; mean 2
    samples = [{"conv": torch.tensor([1.0, 0.0])}, {"conv": torch.tensor([3.0, 2.0])}]
    assert aggregate_variance(samples) == {"conv": pytest.approx(2.0)}
    # three repetitions of a scalar 0, 3, 6: mean 3, squared deviations 9, 0, 9 → 6
    assert aggregate_variance([{"x": torch.tensor(v)} for v in (0.0, 3.0, 6.0)]) == {"x": pytest.approx(6.0)}
    assert aggregate_variance([{"x": torch.ones(2, 3)}] * 4) == {"x": 0.0}


def test_conv_filters_rebuild_atoms_and_take_plain_weights() -> None:
    alpha = torch.zeros(1, 1, 2)
    alpha[0, 0] = torch.tensor([2.0, -1.0])
    atoms = torch.stack([torch.eye(2), torch.ones(2, 2)])  # W = 2·I − 1·ones
    weight = torch.arange(4.0).reshape(1, 1, 2, 2)
    got = conv_filters(
        {
            "a.atoms": atoms,
            "a.coefficients": alpha,
            "b.weight": weight,
            "fc.weight": torch.ones(3, 4),  # not a conv: left out
        }
    )
    assert list(got) == ["a", "b"]
    assert torch.equal(got["a"][0, 0], torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64))
    assert torch.equal(got["b"], weight.double())


@pytest.fixture(scope="module")
def small() -> tuple[SimulationConfig, list]:
    config = SimulationConfig(dataset="digits", clients=5, fraction=1.0, local_epochs=1, lr=0.005, seed=3)
    train, test = load_dataset("digits")
    return config, config.population().clients(train, test)


def test_identical_seeds_give_zero_variance(small: tuple[SimulationConfig, list]) -> None:
    config, clients = small
    results = compare(config, clients, 0, ("none", "atoms"), repetition_seeds=[7, 7])
    for f in ("none", "atoms"):
        r = results[f]
        assert set(r.variance) == {"conv1", "conv2"}
        assert r.variance == {"conv1": 0.0, "conv2": 0.0}  # same data order ⇒ bit-identical aggregates
        assert r.product_variance == {"conv1": 0.0, "conv2": 0.0}
        assert all(m > 0 for m in r.movement.values())  # yet the clients did train


def test_real_run_structure(small: tuple[SimulationConfig, list]) -> None:
    config, clients = small
    results = compare(config, clients, 3, ("none", "atoms"))
    assert list(results) == ["none", "atoms"]
    for r in results.values():
        assert r.repetitions == 3
        assert set(r.variance) == set(r.movement) == set(r.product_variance) == {"conv1", "conv2"}
        assert all(v > 0 for v in r.variance.values())
        assert r.total_variance == pytest.approx(sum(r.variance.values()))
    # without atoms the federation's aggregate is the samples-weighted mean of the clients' weights:
    # recomputed outside the strategy in float64, it has the same variance up to the server's float32 sums
    none = results["none"]
    for layer in none.variance:
        assert none.product_variance[layer] == pytest.approx(none.variance[layer], rel=1e-4)  # float32 sums
    table = format_table(results)
    assert "atoms/none" in table and table.splitlines()[-1].startswith("total")


def test_same_start_for_both(small: tuple[SimulationConfig, list]) -> None:
    config, _ = small
    plain = conv_filters(replace(config, factorization="none").build_federation(5).global_tensors)
    atoms = conv_filters(replace(config, factorization="atoms").build_federation(5).global_tensors)
    for layer in plain:
        torch.testing.assert_close(atoms[layer], plain[layer], rtol=1e-5, atol=1e-6)


def test_plain_model_starts_where_fewer_atoms_do(small: tuple[SimulationConfig, list]) -> None:
    config, clients = small
    fewer = conv_filters(
        replace(config, factorization="atoms", num_atoms=4).spec.initial_model(config.seed).state_dict()
    )
    plain = replace(config, factorization="none")
    own, _, _ = repeated_aggregates(plain, clients, [0])
    start, _, _ = repeated_aggregates(plain, clients, [0], start_filters=fewer)
    for layer in fewer:
        torch.testing.assert_close(start[layer], fewer[layer], rtol=1e-6, atol=1e-7)
        assert not torch.allclose(own[layer], fewer[layer], atol=1e-3)  # a rank-4 approximation of 3×3 filters


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["analyze", "variance", "--clients", "5", "--repetitions", "2", "--local-epochs", "1", "--lr", "0.005"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "atoms/none" in out.out and "conv2" in out.out
    assert "repetition 2/2" in out.err
