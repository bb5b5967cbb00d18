"""The magnitude bound judges a low-rank update by its product U·V, the values the server folds.

Factors chosen by hand: large factors whose product is zero pass (the bound must not refuse on the
factors' size), and factors whose product is large are refused, whatever the factors' own size.
"""

from __future__ import annotations

import pytest
import torch

from aggregator_service.errors import InvalidArgument
from aggregator_service.update_bounds import UpdateBounds
from fedcore.spec import ModelSpec

FULL = ModelSpec("digits-cnn", 10, "lowrank")
TIER = FULL.at_tier(0.25)


def _pair(u: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    tensors = dict(TIER.build().state_dict())
    tensors["fc1.lowrank_u"], tensors["fc1.lowrank_v"] = u, v
    return tensors


def test_large_factors_whose_product_is_small_pass() -> None:
    shapes = TIER.build().state_dict()
    u, v = torch.zeros_like(shapes["fc1.lowrank_u"]), torch.zeros_like(shapes["fc1.lowrank_v"])
    u[:, 0] = 1e6  # U's first column meets only V's first row, which is zero: U·V = 0
    v[1, :] = 1e6
    assert torch.count_nonzero(u @ v) == 0
    UpdateBounds(max_value=1e9).check(TIER, _pair(u, v), FULL.build().state_dict(), {})


def test_factors_whose_product_is_large_are_refused() -> None:
    shapes = TIER.build().state_dict()
    u = torch.full_like(shapes["fc1.lowrank_u"], 1e5)
    v = torch.full_like(shapes["fc1.lowrank_v"], 1e5)
    peak = float((u.double() @ v.double()).abs().max())  # r · 1e10
    assert peak > 1e9
    with pytest.raises(InvalidArgument, match=r"'fc1.weight'.*moves a value by .*max_update_value = 1e\+09"):
        UpdateBounds(max_value=1e9).check(TIER, _pair(u, v), FULL.build().state_dict(), {})
    UpdateBounds(max_value=peak * 1.001).check(TIER, _pair(u, v), FULL.build().state_dict(), {})  # just under: taken
