"""State that is a mean over all N clients follows N as clients enroll: the helper-derived case by hand.

Round 1 closes with N = 1: client a moves head.bias by +1 (and reports Δc = 1). Round 2 closes with
N = 4: clients b and c move nothing (Δc = 0). Over the four enrolled, Σ_i c_i = 1 and Σ_i h_i = 1,
so SCAFFOLD's c = (1/4)·1 = 0.25, FedDC's H = 0.25 and FedDyn's h = −α·(1/4)·1 = −0.0025 at α = 0.01.
Dividing each round's increment by the N of its own close instead kept round 1's 1/1: c = 1.
"""

from __future__ import annotations

import pytest
import torch
from strategy_helpers import DIGITS, run_round, update

from aggregator_service.strategies import FedDC, FedDyn, Scaffold, Strategy

NAME = "head.bias"


def two_closes(strategy: Strategy) -> Strategy:
    x = {t.name: torch.zeros(t.shape) for t in DIGITS.tensors}
    ones = torch.ones(10)
    strategy.num_clients_total = 1  # type: ignore[attr-defined]  # as the service sets it before each close
    a = update(DIGITS, {**x, NAME: x[NAME] + 1}, 10, "a", {NAME: ones})
    x = {**x, **run_round(strategy, x, [a], [NAME]).tensors}
    strategy.num_clients_total = 4  # type: ignore[attr-defined]  # b, c and d enrolled meanwhile
    still = [update(DIGITS, dict(x), 10, cid, {NAME: torch.zeros(10)}) for cid in ("b", "c")]
    run_round(strategy, x, still, [NAME])
    return strategy


@pytest.mark.parametrize("make", [lambda: Scaffold(1, spec=DIGITS), lambda: FedDC(1, alpha=0.01, spec=DIGITS)])
def test_scaffold_and_feddc_controls_are_a_mean_over_the_clients_enrolled_now(make) -> None:
    strategy = two_closes(make())
    torch.testing.assert_close(strategy.server_control(DIGITS)[NAME], torch.full((10,), 0.25))
    if isinstance(strategy, FedDC):
        torch.testing.assert_close(strategy.drift.values[NAME], torch.full((10,), 0.25))


def test_feddyn_h_is_a_mean_over_the_clients_enrolled_now() -> None:
    strategy = two_closes(FedDyn(1, alpha=0.01, spec=DIGITS))
    torch.testing.assert_close(strategy.h.values[NAME], torch.full((10,), -0.0025))


def test_the_count_it_was_averaged_over_survives_a_restart() -> None:
    strategy = Scaffold(1, spec=DIGITS)
    x = {t.name: torch.zeros(t.shape) for t in DIGITS.tensors}
    run_round(strategy, x, [update(DIGITS, dict(x), 10, "a", {NAME: torch.ones(10)})], [NAME])
    restarted = Scaffold(4, spec=DIGITS)
    restarted.load_state_dict(strategy.state_dict())
    run_round(restarted, x, [update(DIGITS, dict(x), 10, "b", {NAME: torch.zeros(10)})], [NAME])
    torch.testing.assert_close(restarted.server_control(DIGITS)[NAME], torch.full((10,), 0.25))
