"""Strategies by name, and the stateless default of the base class."""

from __future__ import annotations

import pytest

from aggregator_service.strategies import STRATEGIES, FedAvg, FedProx, Scaffold, build_strategy


def test_registry() -> None:
    assert set(STRATEGIES) == {
        *("fedavg", "fedprox", "scaffold", "fedavgm", "fedadam", "fedyogi", "fedadagrad"),
        *("fedmedian", "fedtrimmedavg", "feddyn", "feddc"),
    }
    assert isinstance(build_strategy("fedavg", weighting="tier-softmax", temperature=5.0), FedAvg)
    prox = build_strategy("fedprox", mu=0.5)
    assert isinstance(prox, FedProx) and prox.client_config() == {"prox_mu": 0.5}
    assert isinstance(build_strategy("scaffold", num_clients_total=3), Scaffold)
    yogi = build_strategy("fedyogi")  # issue 21: known now, with Flower's defaults
    assert (yogi.eta, yogi.beta_1, yogi.beta_2, yogi.tau) == (1e-2, 0.9, 0.99, 1e-3)
    with pytest.raises(ValueError, match="unknown strategy"):
        build_strategy("fedyogo")
    with pytest.raises(ValueError, match="bad parameters"):
        build_strategy("fedavg", mu=1.0)
    assert FedAvg().state_dict() == {}
    with pytest.raises(ValueError, match="no state"):
        FedAvg().load_state_dict({"x": 1})


def test_a_parameter_of_the_wrong_kind_is_named() -> None:
    """``--strategy-arg eta=abc`` read: "'>' not supported between instances of 'str' and 'int'"."""
    with pytest.raises(ValueError, match=r"^strategy 'fedadam': eta = 'abc' is not a number \(its default is 0\.1\)$"):
        build_strategy("fedadam", eta="abc")
    with pytest.raises(ValueError, match=r"strategy 'fedprox': mu = True is not a number"):
        build_strategy("fedprox", mu=True)
    assert build_strategy("fedadam", eta=1).eta == 1  # an int where the default is a float is a number
