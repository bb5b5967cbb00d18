"""FedAvgM and the FedOpt family against two clients over two rounds derived by hand, their limits, restarts."""

from __future__ import annotations

import math

import pytest
import torch
from strategy_helpers import DIGITS, random_tensors, run_round, update

from aggregator_service.strategies import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedYogi, Scaffold, Strategy
from fedcore.spec import ModelSpec

NAME = "head.bias"


def two_rounds(strategy: Strategy, x0: float = 1.0) -> list[float]:
    """x = 1; round 1 clients push 2 and 4 (mean 3), round 2 they push x' + 0 and x' + 2 (mean x' + 1)."""
    out = []
    x = torch.full((10,), x0)
    for offsets in ((1.0, 3.0), (0.0, 2.0)):
        ups = [update(DIGITS, {NAME: x + o}, 10, f"c{i}") for i, o in enumerate(offsets)]
        x = run_round(strategy, {NAME: x}, ups).tensors[NAME]
        out.append(float(x[0]))
    return out


def test_fedavgm_by_hand() -> None:
    # Δ₁ = 2: v = 2, x = 1 + 2 = 3; Δ₂ = 1: v = 0.5·2 + 1 = 2, x = 3 + 2 = 5
    assert two_rounds(FedAvgM(server_learning_rate=1.0, server_momentum=0.5)) == pytest.approx([3.0, 5.0])
    # η = 0.5: x = 1 + 1 = 2; Δ₂ = 1: v = 2, x = 2 + 1 = 3
    assert two_rounds(FedAvgM(server_learning_rate=0.5, server_momentum=0.5)) == pytest.approx([2.0, 3.0])


def test_fedadam_fedyogi_fedadagrad_by_hand() -> None:
    eta, tau = 0.1, 1e-9
    # Adam: m₁ = 0.1·2 = 0.2, v₁ = 0.01·4 = 0.04 → x = 1 + 0.1·0.2/0.2 = 1.1;
    #       m₂ = 0.9·0.2 + 0.1·1 = 0.28, v₂ = 0.99·0.04 + 0.01 = 0.0496 → x = 1.1 + 0.1·0.28/√0.0496
    adam = two_rounds(FedAdam(eta=eta, beta_1=0.9, beta_2=0.99, tau=tau))
    assert adam == pytest.approx([1.1, 1.1 + 0.1 * 0.28 / math.sqrt(0.0496)], rel=1e-6)
    # Yogi: v₁ = 0 − 0.01·4·sign(0 − 4) = 0.04 (as Adam); v₂ = 0.04 − 0.01·1·sign(0.04 − 1) = 0.05
    yogi = two_rounds(FedYogi(eta=eta, beta_1=0.9, beta_2=0.99, tau=tau))
    assert yogi == pytest.approx([1.1, 1.1 + 0.1 * 0.28 / math.sqrt(0.05)], rel=1e-6)
    # Adagrad (β₁ = 0): v₁ = 4 → x = 1 + 0.1·2/2 = 1.1; v₂ = 5 → x = 1.1 + 0.1·1/√5
    adagrad = two_rounds(FedAdagrad(eta=eta, tau=tau))
    assert adagrad == pytest.approx([1.1, 1.1 + 0.1 / math.sqrt(5.0)], rel=1e-6)


def test_flowers_defaults() -> None:
    adam, yogi, adagrad, avgm = FedAdam(), FedYogi(), FedAdagrad(), FedAvgM(server_momentum=0.0)
    assert (adam.eta, adam.beta_1, adam.beta_2, adam.tau) == (1e-1, 0.9, 0.99, 1e-9)
    assert (yogi.eta, yogi.beta_1, yogi.beta_2, yogi.tau) == (1e-2, 0.9, 0.99, 1e-3)
    assert (adagrad.eta, adagrad.beta_1, adagrad.tau) == (1e-1, 0.0, 1e-9)
    assert avgm.server_learning_rate == 1.0


def fedavg_rounds(strategy: Strategy, rounds: int = 3) -> None:
    """``strategy`` gives FedAvg's model, to float32 rounding, round after round on random clients."""
    gen = torch.Generator().manual_seed(21)
    x_ref = x = random_tensors(DIGITS, gen)
    for r in range(rounds):
        ups = [update(DIGITS, random_tensors(DIGITS, gen), n, f"c{n}") for n in (3, 8, 5)]
        ref = run_round(FedAvg(), x_ref, ups).tensors
        got = run_round(strategy, x, ups).tensors
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=2e-6, atol=2e-6, msg=f"round {r} {name}")
        x_ref, x = {**x_ref, **ref}, {**x, **got}


def test_fedavgm_without_momentum_is_fedavg() -> None:
    fedavg_rounds(FedAvgM(server_learning_rate=1.0, server_momentum=0.0))


def test_fedadam_at_its_limit_is_fedavg() -> None:
    """β₁ = 0 (m = Δ), β₂ = 1 (v stays 0) and η = τ: x + τ·Δ/(0 + τ) = x + Δ, FedAvg's mean."""
    fedavg_rounds(FedAdam(eta=1.0, beta_1=0.0, beta_2=1.0, tau=1.0))


@pytest.mark.parametrize(
    "make",
    [
        lambda: FedAvgM(server_momentum=0.7),
        lambda: FedAdam(),
        lambda: FedYogi(),
        lambda: FedAdagrad(),
    ],
)
def test_server_state_survives_a_restart(make) -> None:
    """Round 3 after a restart (state_dict → a new instance) equals round 3 of the uninterrupted strategy."""
    gen = torch.Generator().manual_seed(5)
    x = random_tensors(DIGITS, gen)
    rounds = [[update(DIGITS, random_tensors(DIGITS, gen), n, f"c{n}") for n in (4, 9)] for _ in range(3)]
    kept = make()
    for ups in rounds[:2]:
        x = {**x, **run_round(kept, x, ups).tensors}
    restarted = make()
    restarted.load_state_dict(kept.state_dict())
    assert set(kept.state_dict()) == set(type(kept).state_tensors)
    a, b = run_round(kept, x, rounds[2]).tensors, run_round(restarted, x, rounds[2]).tensors
    assert all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(ValueError, match="unknown"):
        restarted.load_state_dict({"bogus": {}})


def test_bad_hyper_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="server_momentum"):
        FedAvgM(server_momentum=1.0)
    with pytest.raises(ValueError, match="tau"):
        FedAdam(tau=0.0)
    with pytest.raises(ValueError, match="beta_2"):
        FedYogi(beta_2=1.5)


@pytest.mark.parametrize(
    "strategy",
    [Scaffold(2, global_lr=2.0), FedAvgM(server_learning_rate=0.5, server_momentum=0.9), FedAdam(eta=0.5)],
    ids=["scaffold-2", "fedavgm", "fedadam"],
)
def test_a_server_step_moves_parameters_and_batchnorm_statistics_take_the_mean(strategy: Strategy) -> None:
    """Global running_var 1, both clients measured 0.3 (same running_mean, so the pooled variance is 0.3):
    the new running_var is 0.3, as FedAvg's. A server step past the mean (x + 2·(0.3 − 1) = −0.4 at
    η_g = 2) would make it negative, and every later evaluation NaN."""
    spec = ModelSpec("resnet18", 10, "none")
    names = ["bn1.weight", "bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"]
    x = {
        "bn1.weight": torch.ones(64),
        "bn1.running_mean": torch.zeros(64),
        "bn1.running_var": torch.ones(64),
        "bn1.num_batches_tracked": torch.tensor(7),
    }
    pushed = {**x, "bn1.weight": torch.full((64,), 0.3), "bn1.running_var": torch.full((64,), 0.3)}
    controls = {"bn1.weight": torch.zeros(64)}
    ups = [update(spec, dict(pushed), 10, f"c{i}", controls) for i in range(2)]
    acc = strategy.begin(x, names)
    for u in ups:
        strategy.fold(acc, u)
    result = strategy.finish(acc, x)
    torch.testing.assert_close(result.tensors["bn1.running_var"], torch.full((64,), 0.3))
    torch.testing.assert_close(result.tensors["bn1.running_mean"], torch.zeros(64))
    assert int(result.tensors["bn1.num_batches_tracked"]) == 7
    # the parameter does take the server's step: it does not end at the clients' mean
    assert not torch.allclose(result.tensors["bn1.weight"], torch.full((64,), 0.3))
