"""A user's strategy by reference: docs/strategies.md's example, run as written, and the refusals."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch
from strategy_helpers import DIGITS, run_round, update

from aggregator_service.config import FederationConfig
from aggregator_service.strategies import build_strategy, strategy_class
from fedatoms.simulate import SimulationConfig, run_simulation

DOC = Path(__file__).resolve().parents[3] / "docs" / "strategies.md"


@pytest.fixture
def user_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The doc's example saved as ``my_strategies/decaying.py`` on the import path."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1 and len(blocks[0].splitlines()) <= 40
    package = tmp_path / "my_strategies"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "decaying.py").write_text(blocks[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_strategies.decaying:DecayingFedAvg"
    for name in [m for m in sys.modules if m.startswith("my_strategies")]:
        del sys.modules[name]


def test_the_docs_example_steps_as_derived_by_hand(user_package: str) -> None:
    strategy = build_strategy(user_package, eta=1.0)
    name = "head.bias"
    x = torch.full((10,), 1.0)
    # round 1 (step 1/√1): clients at 2 and 4 → 3; round 2 (step 1/√2): clients at 3 and 5 → 3 + (4 − 3)/√2
    expected = [3.0, 3.0 + 1 / math.sqrt(2)]
    for offsets, want in zip(((1.0, 3.0), (0.0, 2.0)), expected, strict=True):
        ups = [update(DIGITS, {name: x + o}, 10, f"c{i}") for i, o in enumerate(offsets)]
        x = run_round(strategy, {name: x}, ups).tensors[name]
        assert float(x[0]) == pytest.approx(want)
    restarted = build_strategy(user_package, eta=1.0)
    restarted.load_state_dict(strategy.state_dict())
    assert restarted.state_dict() == {"rounds": 2}


def test_a_federation_runs_the_docs_example_by_reference(user_package: str) -> None:
    config = dict(dataset="digits", clients=5, fraction=1.0, rounds=2, batch_size=32, seed=1)
    fedavg = run_simulation(SimulationConfig(**config))["rounds"]
    mine = run_simulation(SimulationConfig(**config, strategy=user_package, strategy_args={"eta": 1.0}))["rounds"]
    assert mine[0]["test_loss"] == pytest.approx(fedavg[0]["test_loss"], rel=1e-5)  # step 1 is FedAvg's
    assert mine[1]["test_loss"] != fedavg[1]["test_loss"]  # step 1/√2 is not
    with pytest.raises(ValueError, match="bad parameters"):
        SimulationConfig(**config, strategy=user_package, strategy_args={"etta": 1.0})


def test_references_that_are_not_strategies_are_refused(user_package: str) -> None:
    with pytest.raises(ValueError, match="cannot import"):
        strategy_class("no_such_package.mod:Thing")
    with pytest.raises(ValueError, match="no attribute"):
        strategy_class("my_strategies.decaying:Nope")
    with pytest.raises(ValueError, match="not a subclass"):
        strategy_class("my_strategies.decaying:FedAvg.__init__")
    with pytest.raises(ValueError, match="not a subclass"):
        strategy_class("math:sqrt")
    with pytest.raises(ValueError, match="unknown strategy"):
        FederationConfig(strategy="my strategy")
    with pytest.raises(ValueError, match="federation's own keys"):
        FederationConfig(strategy="feddyn", strategy_args={"num_clients_total": 3})
