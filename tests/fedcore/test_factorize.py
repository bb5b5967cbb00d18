"""Every factorization of one seed starts from the same function (issue: a fair baseline).

Oracles: the plain model's own filters (atoms must rebuild them exactly when ``m ≥ k²``, the default), and
the Eckart–Young bound computed from ``torch.linalg.svdvals`` (a rank-``r`` fit can be no closer
than the energy of the discarded singular values, and truncated SVD reaches it).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aggregator_service.config import FederationConfig
from fedcore.factorize import load_from_plain
from fedcore.layers import AtomConv2d, LowRankConv2d, LowRankLinear, conv_weight_to_matrix
from fedcore.spec import ModelSpec


def _plain_filters(model: str, seed: int) -> dict[str, torch.Tensor]:
    return ModelSpec(model, 10, "none").initial_model(seed).state_dict()


@pytest.mark.parametrize("model", ["digits-cnn", "resnet18", "mnist-cnn", "lenet-cifar10"])
@pytest.mark.parametrize("factorization", ["atoms", "atoms-lowrank", "lowrank"])
def test_round_zero_effective_filters_equal_the_plain_model(model: str, factorization: str) -> None:
    plain = _plain_filters(model, seed=7)
    net = ModelSpec(model, 10, factorization).initial_model(seed=7)  # the γ = 1 model the server keeps
    state = net.state_dict()
    atom_layers = [(p, m) for p, m in net.named_modules() if isinstance(m, AtomConv2d)]
    assert bool(atom_layers) == factorization.startswith("atoms")
    for path, layer in atom_layers:  # k² atoms per k×k conv by default (3×3 and 5×5 here): an exact fit
        assert layer.num_atoms == layer.kernel_size**2
        torch.testing.assert_close(layer.weight, plain[f"{path}.weight"], rtol=0, atol=1e-6)
    for name, tensor in state.items():  # BatchNorm, heads, biases, 1×1 shortcuts: copied as they are
        if name in plain:
            assert torch.equal(tensor, plain[name]), name


def test_the_papers_nine_atoms_on_a_5x5_conv_are_the_best_rank_9_fit_of_its_filters() -> None:
    plain = _plain_filters("mnist-cnn", seed=7)
    net = ModelSpec("mnist-cnn", 10, "atoms", num_atoms=9).initial_model(seed=7)
    for path in ("conv1", "conv2"):
        layer = net.get_submodule(path)
        assert isinstance(layer, AtomConv2d) and layer.num_atoms == 9
        stack = plain[f"{path}.weight"].double().flatten(0, 1).flatten(1)  # (c_out·c_in, 25) filters
        bound = torch.linalg.svdvals(stack)[9:].square().sum().sqrt()  # Eckart–Young: no 9 atoms fit closer
        error = (layer.weight.detach().double().flatten(0, 1).flatten(1) - stack).norm()
        assert bound > 0.1 * stack.norm() and error.item() == pytest.approx(bound.item(), rel=1e-5)


def test_the_federation_starts_atoms_and_plain_convs_from_one_model() -> None:
    common = dict(model="digits-cnn", seed=3)
    plain = FederationConfig(factorization="none", **common).build_federation(num_clients_total=2).global_tensors
    atoms = FederationConfig(factorization="atoms", **common).build_federation(num_clients_total=2).global_tensors
    for conv in ("conv1", "conv2"):
        rebuilt = torch.einsum("oim,mkl->oikl", atoms[f"{conv}.coefficients"], atoms[f"{conv}.atoms"])
        torch.testing.assert_close(rebuilt, plain[f"{conv}.weight"], rtol=0, atol=1e-6)
    assert torch.equal(atoms["head.weight"], plain["head.weight"])
    assert torch.equal(atoms["fc1.weight"], plain["fc1.weight"])


@pytest.mark.parametrize("rank_ratio", [0.5, 0.125])
def test_low_rank_tiers_are_the_best_rank_r_fit(rank_ratio: float) -> None:
    plain = _plain_filters("digits-cnn", seed=5)
    tier = load_from_plain(
        ModelSpec("digits-cnn", 10, "lowrank", rank_ratio=rank_ratio).build(), _plain("digits-cnn", 5)
    )
    for path, layer in tier.named_modules():
        if isinstance(layer, LowRankConv2d):
            target = conv_weight_to_matrix(plain[f"{path}.weight"])
            got = conv_weight_to_matrix(layer.weight.detach())
        elif isinstance(layer, LowRankLinear):
            target, got = plain[f"{path}.weight"], layer.weight.detach()
        else:
            continue
        s = torch.linalg.svdvals(target.double())
        bound = s[layer.rank :].square().sum().sqrt()  # Eckart–Young: no rank-r matrix is closer
        assert torch.linalg.matrix_rank(got.double(), rtol=1e-5) <= layer.rank  # float32 rounding aside
        assert (got.double() - target.double()).norm() == pytest.approx(bound.item(), rel=1e-5)


def _plain(model: str, seed: int) -> nn.Module:
    return ModelSpec(model, 10, "none").initial_model(seed)


def test_a_layer_without_a_plain_counterpart_is_refused() -> None:
    wrong = ModelSpec("digits-cnn", 10, "atoms").build()
    other = ModelSpec("mnist-cnn", 10, "none").build()
    with pytest.raises(ValueError, match="conv"):
        load_from_plain(wrong, other)
