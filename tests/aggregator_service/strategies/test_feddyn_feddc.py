"""FedDyn and FedDC: server and client halves by hand (two clients, two rounds or steps), α = 0, restarts, refusals."""

from __future__ import annotations

import math

import pytest
import torch
from strategy_helpers import DIGITS, random_tensors, run_round, update
from torch import Tensor, nn

from aggregator_service.strategies import FedAvg, FedDC, FedDyn, Scaffold, Setting, Strategy
from fedcore.training import TrainConfig, local_update
from fedcore.training.terms import LocalTerms

NAME = "head.bias"
TRAINABLE = [t.name for t in DIGITS.tensors if t.role != "buffer"]


def two_rounds(strategy: Strategy, controls: bool = False) -> list[float]:
    """x = 1; round 1 clients push 2 and 4, round 2 they push x' and x' + 2 (each with zero Δc when ``controls``)."""
    out = []
    x = torch.full((10,), 1.0)
    for offsets in ((1.0, 3.0), (0.0, 2.0)):
        delta = {NAME: torch.zeros(10)} if controls else None
        ups = [update(DIGITS, {NAME: x + o}, 10, f"c{i}", delta) for i, o in enumerate(offsets)]
        x = run_round(strategy, {NAME: x}, ups).tensors[NAME]
        out.append(float(x[0]))
    return out


def test_feddyn_server_by_hand() -> None:
    # N = 4, α = 0.5. Round 1: (1/N)Σ(y − x) = (1 + 3)/4 = 1, h = −0.5·1, x = 3 − h/α = 4.
    # Round 2 from 4: pushes 4 and 6, drift (0 + 2)/4 = 0.5, h = −0.5 − 0.25 = −0.75, x = 5 + 1.5 = 6.5
    strategy = FedDyn(num_clients_total=4, alpha=0.5)
    assert two_rounds(strategy) == pytest.approx([4.0, 6.5])
    assert float(strategy.state_dict()["h"][NAME][0]) == pytest.approx(-0.75)
    assert strategy.client_config() == {"feddyn_alpha": 0.5}


def test_feddc_server_by_hand() -> None:
    # the mean drift of all N = 4 clients: H = 1 after round 1 (x = 3 + 1), H = 1.5 after round 2 (x = 5 + 1.5)
    strategy = FedDC(num_clients_total=4, alpha=0.1)
    assert two_rounds(strategy, controls=True) == pytest.approx([4.0, 6.5])
    assert float(strategy.state_dict()["drift"][NAME][0]) == pytest.approx(1.5)
    assert strategy.client_config() == {"scaffold": True, "feddc_alpha": 0.1}


@pytest.mark.parametrize(
    ("make", "controls", "uniform", "by_samples"),
    [
        # N = 2, both report, x = 0 → 1 (10 samples) and 3 (30): the mean is 2 uniformly, 2.5 by samples
        (lambda w: FedAvg(weighting=w), False, 2.0, 2.5),
        # Karimireddy et al.: x + η_g (1/|S|) Σ (y − x), η_g = 1
        (lambda w: Scaffold(2, weighting=w, spec=DIGITS), True, 2.0, 2.5),
        # Acar et al.: h = −α (1/m) Σ (y − x) = −2α, x = (1/|P|) Σ y − h/α = 2 + 2
        (lambda w: FedDyn(2, alpha=0.5, weighting=w), False, 4.0, 4.5),
        # Gao et al.: H = (1/N) Σ (y − x) = 2, x = mean + H
        (lambda w: FedDC(2, alpha=0.5, weighting=w), True, 4.0, 4.5),
    ],
)
def test_uniform_weighting_is_the_papers_mean_over_the_cohort(make, controls, uniform, by_samples) -> None:
    """SCAFFOLD, FedDyn and FedDC average the clients' models uniformly in their papers (and their official code);
    the federation's default weighs by samples, as FedAvg does. ``weighting = "uniform"`` gives the papers' mean."""
    x = torch.zeros(10)
    delta = {NAME: torch.zeros(10)} if controls else None
    ups = [update(DIGITS, {NAME: x + y}, n, f"c{n}", delta) for y, n in ((1.0, 10), (3.0, 30))]
    for weighting, expected in (("uniform", uniform), ("samples", by_samples)):
        got = run_round(make(weighting), {NAME: x}, ups).tensors[NAME]
        torch.testing.assert_close(got, torch.full((10,), expected))


def test_feddyn_without_alpha_is_fedavg_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(4)
    x = random_tensors(DIGITS, gen)
    dyn = FedDyn(num_clients_total=5, alpha=0.0)
    assert dyn.client_config() == {}
    for _ in range(2):
        ups = [update(DIGITS, random_tensors(DIGITS, gen), n, f"c{n}") for n in (3, 8)]
        ref, got = run_round(FedAvg(), x, ups).tensors, run_round(dyn, x, ups).tensors
        assert ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref)
        x = {**x, **ref}


@pytest.mark.parametrize("make", [lambda: FedDyn(4, alpha=0.3, spec=DIGITS), lambda: FedDC(4, alpha=0.3, spec=DIGITS)])
def test_server_state_survives_a_restart(make) -> None:
    gen = torch.Generator().manual_seed(8)
    x = random_tensors(DIGITS, gen)

    def ups() -> list:
        deltas = {n: torch.randn(DIGITS.tensor(n).shape, generator=gen) for n in TRAINABLE}
        return [update(DIGITS, random_tensors(DIGITS, gen), n, f"c{n}", deltas) for n in (4, 9)]

    rounds = [ups() for _ in range(3)]
    kept = make()
    for r in rounds[:2]:
        x = {**x, **run_round(kept, x, r).tensors}
    restarted = make()
    restarted.load_state_dict(kept.state_dict())
    a, b = run_round(kept, x, rounds[2]).tensors, run_round(restarted, x, rounds[2]).tensors
    assert all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(ValueError, match="does not fit"):
        restarted.load_state_dict({**kept.state_dict(), type(kept).state_tensors[-1]: {NAME: torch.zeros(3)}})


def test_refusals_name_the_reason() -> None:
    for cls in (FedDyn, FedDC):
        assert "tiers = [1]" in (cls.refuse(Setting("lowrank", (1.0, 0.25))) or "")
        assert "every_round" in (cls.refuse(Setting("atoms", (1.0,), "fedlama")) or "")
    assert FedDyn.refuse(Setting("atoms", (1.0,), "every_round", "scaled")) is None  # no step size in its math
    assert "atom_lr = shared" in (FedDC.refuse(Setting("atoms", (1.0,), "every_round", "scaled")) or "")
    assert FedDC.refuse(Setting("atoms", (1.0,), "every_round", "shared")) is None


# --------------------------------------------------------------------------- the clients' half


class Logit(nn.Module):
    """Logits ``[w, 0]``: cross-entropy's gradient in ``w`` is ``σ(w) − 1`` for label 0."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.w.expand(len(x), 1), torch.zeros(len(x), 1)], dim=1)


class One:
    x = torch.zeros(1, 1, 1, 1)
    y = torch.tensor([0])

    def __len__(self) -> int:
        return 1


def sigma(w: float) -> float:
    return 1 / (1 + math.exp(-w))


ETA, BETA, ALPHA = 0.5, 0.5, 0.2
CONFIG = TrainConfig(lr=ETA, momentum=BETA, batch_size=1, local_epochs=2, device="cpu")


def two_steps(grad) -> tuple[float, float, float]:
    """Two heavy-ball steps from w = 0 with ``grad(w)``: (w₁, w₂, ((1 + β)·G₁ + G₂)/(2 + β))."""
    g1 = grad(0.0)
    w1 = -ETA * g1
    g2 = grad(w1)
    w2 = w1 - ETA * (BETA * g1 + g2)
    return w1, w2, ((1 + BETA) * g1 + g2) / (2 + BETA)


def test_feddyn_client_by_hand() -> None:
    """Objective L(w) − ⟨∇L_k, w⟩ + α/2 (w − x)² with x = 0, ∇L_k = 0.3; after: ∇L_k − α(y − x)."""
    grad_state = 0.3
    _, w2, _ = two_steps(lambda w: sigma(w) - 1 - grad_state + ALPHA * w)
    r = local_update(
        Logit(),
        One(),
        CONFIG,
        seed=0,
        terms=LocalTerms.from_config({"feddyn_alpha": ALPHA}),
        client_state={"gradient": {"w": torch.tensor([grad_state])}},
    )
    assert r.strategy_state is not None and r.control_delta is None
    assert float(r.tensors["w"]) == pytest.approx(w2, abs=1e-6)
    assert float(r.strategy_state["gradient"]["w"]) == pytest.approx(grad_state - ALPHA * w2, abs=1e-6)


def test_feddc_client_by_hand() -> None:
    """Objective L(w) + α/2 (w + h − x)² + ⟨w, c − c_i⟩; after: h + (y − x), and c_i⁺ is the weighted mean of
    the penalized objective's gradients (the correction c − c_i cancels out of option II's estimate)."""
    h, c, ci = -0.4, 0.1, 0.3
    _, w2, mean_grad = two_steps(lambda w: sigma(w) - 1 + ALPHA * (w + h) + (c - ci))
    r = local_update(
        Logit(),
        One(),
        CONFIG,
        seed=0,
        terms=LocalTerms.from_config({"scaffold": True, "feddc_alpha": ALPHA}),
        server_control={"w": torch.tensor([c])},
        client_state={"drift": {"w": torch.tensor([h])}, "control": {"w": torch.tensor([ci])}},
    )
    assert r.strategy_state is not None and r.control_delta is not None
    assert float(r.tensors["w"]) == pytest.approx(w2, abs=1e-6)
    assert float(r.strategy_state["drift"]["w"]) == pytest.approx(h + w2, abs=1e-6)
    control = float(r.strategy_state["control"]["w"])
    assert control == pytest.approx(mean_grad - (c - ci), abs=1e-6)
    assert float(r.control_delta["w"]) == pytest.approx(control - ci, abs=1e-6)


def test_client_terms_refuse_bad_state() -> None:
    with pytest.raises(ValueError, match="needs scaffold"):
        LocalTerms.from_config({"feddc_alpha": 0.1})
    with pytest.raises(ValueError, match="feddyn_alpha"):
        LocalTerms.from_config({"feddyn_alpha": -1.0})
    terms = LocalTerms.from_config({"feddyn_alpha": 0.1})
    with pytest.raises(ValueError, match="non-finite"):
        local_update(
            Logit(), One(), CONFIG, seed=0, terms=terms, client_state={"gradient": {"w": torch.tensor([math.inf])}}
        )
    with pytest.raises(ValueError, match="shape"):
        local_update(Logit(), One(), CONFIG, seed=0, terms=terms, client_state={"gradient": {"w": torch.zeros(2)}})
    with pytest.raises(ValueError, match="not kept"):
        local_update(Logit(), One(), CONFIG, seed=0, terms=terms, client_state={"drift": {"w": torch.zeros(1)}})
