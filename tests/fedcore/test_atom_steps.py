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
