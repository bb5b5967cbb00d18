"""FedProx's server against FedAvg's, and the proximal weight it sends clients."""

from __future__ import annotations

import pytest
import torch
from strategy_helpers import DIGITS, random_tensors, run_round, update

from aggregator_service.config import FederationConfig
from aggregator_service.strategies import FedAvg, FedProx, build_strategy


def test_fedprox_server_is_fedavg() -> None:
    gen = torch.Generator().manual_seed(8)
    global_tensors = random_tensors(DIGITS, gen)
    updates = [update(DIGITS, random_tensors(DIGITS, gen), n, f"c{n}") for n in (5, 9)]
    a, b = run_round(FedAvg(), global_tensors, updates), run_round(FedProx(0.1), global_tensors, updates)
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    assert FedProx(0.1).client_config() == {"prox_mu": 0.1}
    assert FedAvg().client_config() == {}
    with pytest.raises(ValueError, match="mu"):
        FedProx(-1.0)


class ProxWithAudit(FedProx):
    """A user's FedProx: a subclass, named by reference (``strategy_helpers`` is not it: a test module is)."""


@pytest.mark.parametrize(
    "strategy",
    ["fedprox", "aggregator_service.strategies.fedprox:FedProx", "test_fedprox:ProxWithAudit"],
)
def test_fedprox_by_name_reference_or_subclass_gives_clients_the_proximal_term(strategy: str) -> None:
    """Clients train with μ from the train config; before, only the registry name ``fedprox`` set it, and
    FedProx named any other way trained as FedAvg."""
    config = FederationConfig(model="digits-cnn", strategy=strategy, mu=0.5)
    assert config.train_config().prox_mu == 0.5
    assert build_strategy(strategy, **config.strategy_params(num_clients_total=4)).client_config() == {"prox_mu": 0.5}


@pytest.mark.parametrize(("strategy", "key"), [("fedavg", "mu"), ("feddc", "global_lr"), ("fedprox", "global_lr")])
def test_a_key_the_strategy_would_ignore_is_refused_at_start(strategy: str, key: str) -> None:
    with pytest.raises(ValueError, match=f"{key} = 0.5 is not used by strategy '{strategy}'"):
        FederationConfig(model="digits-cnn", strategy=strategy, **{key: 0.5})
    assert FederationConfig(model="digits-cnn", strategy="fedavg").train_config().prox_mu == 0.0
