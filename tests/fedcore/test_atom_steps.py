"""Atom step sizes: the filters of ``α × D`` move like a plain conv's under one SGD step.

Oracle: the gradient ``G`` of the same loss with respect to a plain ``nn.Conv2d`` holding the
same filters (autograd on another module), and the top singular value from ``torch.linalg.svdvals``.
Plain SGD moves the filters by exactly ``η‖G‖``; the derivation in fedcore.training.atom_steps
says ``shared`` moves them by about ``(1 + ‖A‖₂²)·η‖G‖`` in the top direction and ``scaled`` by at
most ``2η‖G‖``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedcore.factorize import load_from_plain
from fedcore.layers import AtomConv2d
from fedcore.training import TrainConfig
from fedcore.training.atom_steps import AtomSteps


def _layer(scale: float) -> tuple[AtomConv2d, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    plain = nn.Conv2d(8, 16, 3, padding=1, bias=False)
    with torch.no_grad():
        plain.weight.mul_(scale)  # larger coefficients: a larger ‖A‖₂
    layer = load_from_plain(_Wrap(AtomConv2d(8, 16, 3, padding=1, bias=False)), _Wrap(plain)).conv
    x = torch.randn(4, 8, 6, 6)
    target = torch.randn(4, 16, 6, 6)
    w = plain.weight.detach().clone().requires_grad_(True)
    F.mse_loss(F.conv2d(x, w, padding=1), target).backward()
    return layer, x, (w.grad, target)  # type: ignore[return-value]


class _Wrap(nn.Module):
    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.conv = conv


def _filter_step(rule: str, scale: float, lr: float = 1e-4) -> tuple[float, float, float]:
    """(‖ΔW‖ after one step, η‖G‖ of the plain conv, ‖A‖₂²)."""
    layer, x, (grad, target) = _layer(scale)
    model = _Wrap(layer)
    params = dict(model.named_parameters())
    steps = AtomSteps(model, params, lr, rule)
    optimizer = torch.optim.SGD(steps.param_groups, lr=lr, momentum=0.0)
    before = layer.weight.detach().clone()
    F.mse_loss(model.conv(x), target).backward()
    steps.rescale(optimizer)
    optimizer.step()
    a = layer.coefficients.detach().reshape(-1, layer.num_atoms)
    top = float(torch.linalg.svdvals(a.double())[0]) ** 2
    return float((layer.weight.detach() - before).norm()), lr * float(grad.norm()), top


@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_scaled_steps_move_the_filters_at_most_twice_as_far_as_plain_sgd(scale: float) -> None:
    moved, plain, top = _filter_step("scaled", scale)
    assert plain <= moved <= 2.0 * plain * 1.001, (moved / plain, top)


def test_a_shared_rate_amplifies_the_step_by_the_coefficients_energy() -> None:
    moved, plain, top = _filter_step("shared", 10.0)
    assert top > 50  # the case the rule is for
    assert moved > 10 * plain  # what made atoms diverge where plain convs learned


def test_parameters_outside_atom_layers_keep_the_base_rate() -> None:
    model = nn.Sequential(AtomConv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(1, 3, 5, 5))
    steps = AtomSteps(model, dict(model.named_parameters()), 0.05, "scaled")
    optimizer = torch.optim.SGD(steps.param_groups, lr=0.05)
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {
        id(model[0].bias),
        id(model[2].weight),
        id(model[2].bias),
    }
    assert optimizer.param_groups[0]["lr"] == 0.05


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="atom_lr"):
        TrainConfig(atom_lr="adaptive")


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_fedhm_factor_pairs_get_the_other_factors_energy_as_divisor(layer: str) -> None:
    """U's rate is η / max(1, ‖V‖₂²), V's η / max(1, ‖U‖₂²); ``shared`` leaves both at η (hand-set factors)."""
    from fedcore.layers import LowRankConv2d, LowRankLinear

    module = LowRankLinear(6, 4, 2) if layer == "linear" else LowRankConv2d(3, 4, 3, 2, padding=1)
    with torch.no_grad():
        module.lowrank_u.zero_()
        module.lowrank_v.zero_()
        module.lowrank_u[0, 0], module.lowrank_u[1, 1] = 2.0, 0.5  # ‖U‖₂² = 4
        module.lowrank_v[0, 0], module.lowrank_v[1, 2] = 0.1, 3.0  # ‖V‖₂² = 9
    model = _Wrap(module)
    params = dict(model.named_parameters())
    for rule, expected in (("scaled", {"u": 0.1 / 9, "v": 0.1 / 4}), ("shared", {"u": 0.1, "v": 0.1})):
        steps = AtomSteps(model, params, 0.1, rule)
        optimizer = torch.optim.SGD(steps.param_groups, lr=0.1)
        steps.rescale(optimizer)
        rate = {
            factor: next(
                g["lr"]
                for g in optimizer.param_groups
                if any(p is params[f"conv.lowrank_{factor}"] for p in g["params"])
            )
            for factor in ("u", "v")
        }
        assert rate == pytest.approx(expected), rule


def _pair_step(rule: str, u: torch.Tensor, v: torch.Tensor, grad_w: torch.Tensor, lr: float = 0.1) -> torch.Tensor:
    """The first-order change of ``W = U V`` after one step of ``rule`` (no momentum), given ``∂L/∂W``."""
    from fedcore.layers import LowRankLinear

    module = LowRankLinear(v.shape[1], u.shape[0], u.shape[1])
    with torch.no_grad():
        module.lowrank_u.copy_(u)
        module.lowrank_v.copy_(v)
    model = _Wrap(module)
    params = dict(model.named_parameters())
    steps = AtomSteps(model, params, lr, rule)
    optimizer = torch.optim.SGD(steps.param_groups, lr=lr)
    module.lowrank_u.grad = grad_w @ v.T  # the chain rule for a loss whose gradient in W is grad_w
    module.lowrank_v.grad = u.T @ grad_w
    module.bias.grad = torch.zeros_like(module.bias)
    steps.rescale(optimizer)
    rates = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    delta_u = -rates[id(module.lowrank_u)] * module.lowrank_u.grad
    delta_v = -rates[id(module.lowrank_v)] * module.lowrank_v.grad
    return delta_u @ v + u @ delta_v


def test_a_preconditioned_pair_moves_like_sgd_projected_on_its_tangent_space() -> None:
    """Hand-set factors with ``UᵀU = 4 I`` and ``V Vᵀ = 9 I``: ScaledGD divides ``∇U`` by ``9 (1 + λ)`` and
    ``∇V`` by ``4 (1 + λ)``, so ``ΔW = −η (G P_V + P_U G) / (1 + λ)``, ``P`` the projections (from ``pinv``)."""
    from fedcore.training.atom_steps import DAMPING

    u = torch.zeros(5, 2, dtype=torch.float64)
    u[0, 0], u[3, 1] = 2.0, -2.0
    v = torch.zeros(2, 7, dtype=torch.float64)
    v[0, 1], v[1, 4] = 3.0, 3.0
    g = torch.randn(5, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    p_u, p_v = u @ torch.linalg.pinv(u), torch.linalg.pinv(v) @ v
    expected = -0.1 * (g @ p_v + p_u @ g) / (1 + DAMPING)
    moved = _pair_step("preconditioned", u.float(), v.float(), g.float())
    torch.testing.assert_close(moved.double(), expected, rtol=1e-5, atol=1e-6)
    # scaled: U at η/9 and V at η/4 on the raw gradients, so the product moves by −η (G VᵀV/9 + U Uᵀ G/4)
    torch.testing.assert_close(
        _pair_step("scaled", u.float(), v.float(), g.float()).double(), -0.1 * (g @ p_v + p_u @ g), rtol=1e-5, atol=1e-6
    )


def test_a_preconditioned_step_does_not_depend_on_how_the_singular_values_are_split() -> None:
    """``(c U, V / c)`` is the same ``W``: ScaledGD moves it the same way for any ``c``; ``scaled`` does not."""
    gen = torch.Generator().manual_seed(1)
    u, v, g = torch.randn(6, 3, generator=gen), torch.randn(3, 8, generator=gen), torch.randn(6, 8, generator=gen)
    for rule, same in (("preconditioned", True), ("scaled", False)):
        a = _pair_step(rule, u, v, g)
        b = _pair_step(rule, 5.0 * u, v / 5.0, g)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6) == same, rule


def test_preconditioned_atoms_step_as_scaled_ones() -> None:
    """The rule differs from ``scaled`` only on rank-deficient pairs: a full atom layer takes the same step."""
    assert _filter_step("preconditioned", 10.0) == _filter_step("scaled", 10.0)
