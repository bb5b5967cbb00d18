"""FedProx's server against FedAvg's, and the proximal weight it sends clients."""

from __future__ import annotations

import pytest
import torch
from strategy_helpers import DIGITS, random_tensors, run_round, update

from aggregator_service.strategies import FedAvg, FedProx


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
