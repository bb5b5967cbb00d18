"""Tests for fedcore.models: the zoo, the factorization rules and FedHM's parameter counts.

Structure and parameter counts do not depend on parameter values, so those tests build on
the ``meta`` device: that skips the SVD initialization of the big low-rank ResNet-18 layers,
which makes a real ``lowrank`` ResNet-18 build take seconds per tier. Forward passes use real
builds (the ``lowrank`` ResNet-18 one materializes a meta build with random factors instead),
and the ResNet-18 ones are limited to a few combinations.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedcore.layers import AtomConv2d, LowRankConv2d, LowRankLinear, rank_for
from fedcore.models import FACTORIZATIONS, MODELS, Factorization, build_model, model_info

TIERS = (1.0, 0.5, 0.25, 0.125)
SMALL_MODELS = [name for name in MODELS if name != "resnet18"]
FACTORIZED_TYPES = (AtomConv2d, LowRankConv2d, LowRankLinear)
RESNET18_FULL_RANK_PREFIX = {"conv1", "layer1.0.conv1", "layer1.0.conv2"}


def build_on_meta(name: str, factorization: str = "none", rank_ratio: float = 1.0, **kwargs) -> nn.Module:
    """Structure-only build (no values, no SVD initialization)."""
    with torch.device("meta"):
        return build_model(name, factorization=factorization, rank_ratio=rank_ratio, **kwargs)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def full_rank_prefix(name: str) -> set[str]:
    return RESNET18_FULL_RANK_PREFIX if name == "resnet18" else {"conv1"}


# --------------------------------------------------------------------------- registry


def test_registry_names_and_shapes():
    assert set(MODELS) == {"digits-cnn", "mnist-cnn", "lenet-cifar10", "lenet-cifar100", "resnet18"}
    assert FACTORIZATIONS == ("none", "atoms", "lowrank", "atoms-lowrank")
    for name, info in MODELS.items():
        assert info.name == name
        assert model_info(name) is info
    assert MODELS["digits-cnn"].input_shape == (1, 8, 8)
    assert MODELS["mnist-cnn"].input_shape == (1, 28, 28)
    assert MODELS["lenet-cifar10"].input_shape == (3, 32, 32)
    assert MODELS["lenet-cifar100"].default_classes == 100
    assert MODELS["resnet18"].input_shape == (3, 32, 32)


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="unknown model 'vgg16'") as excinfo:
        build_model("vgg16")
    for name in MODELS:
        assert name in str(excinfo.value)
    with pytest.raises(ValueError, match="unknown model"):
        model_info("")


def test_unknown_factorization_names_the_choices():
    with pytest.raises(ValueError, match="unknown factorization 'svd'") as excinfo:
        build_model("lenet-cifar10", factorization="svd")
    for kind in FACTORIZATIONS:
        assert kind in str(excinfo.value)
    with pytest.raises(ValueError, match="unknown factorization"):
        Factorization("low-rank")


@pytest.mark.parametrize("rank_ratio", [0.0, -0.5, 1.0000001, 1.5, 8.0, math.nan, math.inf])
@pytest.mark.parametrize("factorization", FACTORIZATIONS)
def test_rank_ratio_outside_unit_interval_is_rejected(factorization, rank_ratio):
    with pytest.raises(ValueError, match="rank_ratio"):
        build_model("digits-cnn", factorization=factorization, rank_ratio=rank_ratio)


def test_num_atoms_must_be_positive():
    with pytest.raises(ValueError, match="num_atoms"):
        build_model("digits-cnn", factorization="atoms", num_atoms=0)


def test_factorization_low_rank_flag():
    assert not Factorization("none", rank_ratio=0.5).low_rank
    assert not Factorization("atoms", rank_ratio=0.5).low_rank
    assert not Factorization("lowrank", rank_ratio=1.0).low_rank
    assert Factorization("lowrank", rank_ratio=0.5).low_rank
    assert Factorization("atoms-lowrank", rank_ratio=0.125).low_rank


# --------------------------------------------------------------------------- forward passes


@pytest.mark.parametrize("rank_ratio", TIERS)
@pytest.mark.parametrize("factorization", FACTORIZATIONS)
@pytest.mark.parametrize("name", SMALL_MODELS)
def test_small_models_build_and_run(name, factorization, rank_ratio):
    info = MODELS[name]
    torch.manual_seed(0)
    model = build_model(name, factorization=factorization, rank_ratio=rank_ratio)
    out = model(torch.randn(2, *info.input_shape))
    assert out.shape == (2, info.default_classes)
    assert torch.isfinite(out).all()
    # every parameter takes part in the forward pass
    out.square().mean().backward()
    unused = [n for n, p in model.named_parameters() if p.grad is None]
    assert not unused


@pytest.mark.parametrize(
    ("factorization", "rank_ratio"),
    [("none", 1.0), ("atoms", 0.5), ("atoms-lowrank", 1.0), ("atoms-lowrank", 0.25)],
)
def test_resnet18_build_and_run(factorization, rank_ratio):
    torch.manual_seed(0)
    model = build_model("resnet18", factorization=factorization, rank_ratio=rank_ratio)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("rank_ratio", [0.5, 0.125])
def test_resnet18_lowrank_runs(rank_ratio):
    """A real lowrank build spends seconds on SVD initialization; random factors test the same network."""
    model = build_on_meta("resnet18", "lowrank", rank_ratio).to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.reset_parameters()
            elif isinstance(module, (nn.Conv2d, nn.Linear, *FACTORIZED_TYPES)):
                for p in module.parameters(recurse=False):
                    p.normal_(0.0, 0.05)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", MODELS)
def test_num_classes_overrides_the_default(name):
    model = build_on_meta(name, num_classes=7)
    assert model.head.out_features == 7


def test_num_classes_override_runs():
    out = build_model("lenet-cifar100", num_classes=3, factorization="atoms-lowrank", rank_ratio=0.5)(
        torch.randn(2, 3, 32, 32)
    )
    assert out.shape == (2, 3)


# --------------------------------------------------------------------------- FedHM counts


@pytest.mark.parametrize(
    ("rank_ratio", "expected"),
    [(1.0, 11_173_962), (0.5, 4_157_514), (0.25, 2_209_866), (0.125, 1_236_042)],
)
def test_resnet18_lowrank_parameter_counts(rank_ratio, expected):
    """specs/fedhm.md §3.3 / §9: the paper's reported sizes, exactly."""
    assert num_parameters(build_on_meta("resnet18", "lowrank", rank_ratio)) == expected


def test_none_ignores_the_tier():
    counts = {g: num_parameters(build_on_meta("resnet18", "none", g)) for g in TIERS}
    assert set(counts.values()) == {11_173_962}


# --------------------------------------------------------------------------- layer rules


def expected_layer(name: str, module_name: str, plain: nn.Module, factorization: str, rank_ratio: float):
    """(type, rank) the factorization rules of models.py / specs/fedhm.md §1.4 give a layer."""
    low = factorization in ("lowrank", "atoms-lowrank") and rank_ratio < 1.0
    prefix = module_name in full_rank_prefix(name)
    if isinstance(plain, nn.Linear):
        if module_name == "head" or not low:
            return nn.Linear, None
        return LowRankLinear, rank_for(rank_ratio, plain.out_features)
    assert isinstance(plain, nn.Conv2d)
    k = plain.kernel_size[0]
    rank = rank_for(rank_ratio, plain.out_channels) if low and not prefix else None
    if k == 1 or factorization == "none":
        return nn.Conv2d, None
    if factorization in ("atoms", "atoms-lowrank"):
        return AtomConv2d, rank
    if factorization == "lowrank" and rank is not None:
        return LowRankConv2d, rank
    return nn.Conv2d, None


@pytest.mark.parametrize("rank_ratio", TIERS)
@pytest.mark.parametrize("factorization", FACTORIZATIONS)
@pytest.mark.parametrize("name", MODELS)
def test_every_layer_follows_the_factorization_rules(name, factorization, rank_ratio):
    plain = build_on_meta(name)
    model = build_on_meta(name, factorization, rank_ratio)
    plain_layers = {n: m for n, m in plain.named_modules() if isinstance(m, nn.Conv2d | nn.Linear)}
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear, *FACTORIZED_TYPES))}
    assert set(layers) == set(plain_layers)
    for module_name, plain_layer in plain_layers.items():
        kind, rank = expected_layer(name, module_name, plain_layer, factorization, rank_ratio)
        layer = layers[module_name]
        assert type(layer) is kind, module_name
        if kind in FACTORIZED_TYPES:
            assert layer.rank == rank, module_name
    # the head is always a plain Linear called "head"
    assert type(model.head) is nn.Linear


@pytest.mark.parametrize("factorization", ["lowrank", "atoms-lowrank"])
def test_resnet18_full_rank_prefix_and_shortcuts(factorization):
    """conv1 and layer1.0 stay full rank, 1×1 shortcuts and head are never factorized (fedhm §1.4)."""
    model = build_on_meta("resnet18", factorization, 0.25)
    names = set(model.state_dict())
    full_param = "weight" if factorization == "lowrank" else "coefficients"
    for layer in RESNET18_FULL_RANK_PREFIX:
        assert f"{layer}.{full_param}" in names
        assert not any(n.startswith(f"{layer}.") and n.rsplit(".", 1)[1].endswith(("_u", "_v")) for n in names)
    if factorization == "atoms-lowrank":
        for layer in RESNET18_FULL_RANK_PREFIX:
            assert f"{layer}.atoms" in names
            assert model.get_submodule(layer).rank is None
    factorized = sorted({n.rsplit(".", 1)[0] for n in names if n.endswith("_u")})
    expected = sorted(
        {"layer1.1.conv1", "layer1.1.conv2"}
        | {f"layer{s}.{b}.conv{c}" for s in (2, 3, 4) for b in (0, 1) for c in (1, 2)}
    )
    assert factorized == expected  # 14 factorized 3×3 convs
    shortcuts = sorted(n for n in names if ".shortcut.0." in n)
    assert shortcuts == [f"layer{s}.0.shortcut.0.weight" for s in (2, 3, 4)]
    for s, (cin, cout) in zip((2, 3, 4), ((64, 128), (128, 256), (256, 512)), strict=True):
        shortcut = model.get_submodule(f"layer{s}.0.shortcut.0")
        assert type(shortcut) is nn.Conv2d
        assert tuple(shortcut.weight.shape) == (cout, cin, 1, 1)
    assert sorted(n for n in names if n.startswith("head.")) == ["head.bias", "head.weight"]
    assert tuple(model.head.weight.shape) == (10, 512)


def test_resnet18_lowrank_factor_shapes():
    """FedHM's unrolled (o·k, i·k) factors at r = round(γ·c_out) (fedhm §1.2–1.3)."""
    model = build_on_meta("resnet18", "lowrank", 0.125)
    layer = model.get_submodule("layer2.0.conv1")  # 64 → 128, stride 2
    assert isinstance(layer, LowRankConv2d)
    assert tuple(layer.lowrank_u.shape) == (128 * 3, 16)
    assert tuple(layer.lowrank_v.shape) == (16, 64 * 3)
    assert layer.stride == (2, 2)
    layer = model.get_submodule("layer4.1.conv2")
    assert tuple(layer.lowrank_u.shape) == (512 * 3, 64)
    assert tuple(layer.lowrank_v.shape) == (64, 512 * 3)


def test_atoms_turns_every_spatial_conv_into_atoms():
    for name in MODELS:
        model = build_on_meta(name, "atoms", 0.125)
        for module_name, module in model.named_modules():
            if isinstance(module, nn.Conv2d):
                assert module.kernel_size == (1, 1), f"{name}: {module_name} is a plain k>1 conv"
            if isinstance(module, AtomConv2d):
                assert module.rank is None
                assert tuple(module.atoms.shape) == (9, module.kernel_size, module.kernel_size)
            assert not isinstance(module, LowRankConv2d | LowRankLinear)


def test_atoms_honours_num_atoms():
    model = build_on_meta("lenet-cifar10", "atoms-lowrank", 0.5, num_atoms=4)
    assert tuple(model.conv1.atoms.shape) == (4, 5, 5)
    assert tuple(model.conv1.coefficients.shape) == (64, 3, 4)
    assert tuple(model.conv2.coefficients_u.shape) == (64, 32)
    assert tuple(model.conv2.coefficients_v.shape) == (32, 64 * 4)


def test_factorized_tier_one_is_the_plain_network():
    """γ = 1 means "not factorized" (fedhm §1.3): lowrank@1 has exactly none's tensors."""
    for name in MODELS:
        plain = {n: tuple(t.shape) for n, t in build_on_meta(name).state_dict().items()}
        tier1 = {n: tuple(t.shape) for n, t in build_on_meta(name, "lowrank", 1.0).state_dict().items()}
        assert tier1 == plain
        atoms = build_on_meta(name, "atoms", 1.0).state_dict()
        assert {n: tuple(t.shape) for n, t in build_on_meta(name, "atoms-lowrank", 1.0).state_dict().items()} == {
            n: tuple(t.shape) for n, t in atoms.items()
        }


# --------------------------------------------------------------------------- FedRep LeNet


LENET_SHAPES = {
    "lenet-cifar10": {
        "conv1.weight": (64, 3, 5, 5),
        "conv1.bias": (64,),
        "conv2.weight": (64, 64, 5, 5),
        "conv2.bias": (64,),
        "fc1.weight": (120, 1600),
        "fc1.bias": (120,),
        "fc2.weight": (64, 120),
        "fc2.bias": (64,),
        "head.weight": (10, 64),
        "head.bias": (10,),
    },
    "lenet-cifar100": {
        "conv1.weight": (64, 3, 5, 5),
        "conv1.bias": (64,),
        "conv2.weight": (128, 64, 5, 5),
        "conv2.bias": (128,),
        "fc1.weight": (256, 3200),
        "fc1.bias": (256,),
        "fc2.weight": (128, 256),
        "fc2.bias": (128,),
        "head.weight": (100, 128),
        "head.bias": (100,),
    },
}


@pytest.mark.parametrize("name", LENET_SHAPES)
def test_lenet_matches_fedrep_architecture(name):
    """specs/filter-decomposition.md §4.1: CNNCifar / CNNCifar100, computed here op by op."""
    torch.manual_seed(1)
    model = build_model(name).eval()
    sd = model.state_dict()
    assert {n: tuple(t.shape) for n, t in sd.items()} == LENET_SHAPES[name]
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert len(dropouts) == 1 and dropouts[0].p == 0.6
    x = torch.randn(2, 3, 32, 32)
    h = F.max_pool2d(F.relu(F.conv2d(x, sd["conv1.weight"], sd["conv1.bias"])), 2, 2)
    h = F.max_pool2d(F.relu(F.conv2d(h, sd["conv2.weight"], sd["conv2.bias"])), 2, 2)
    h = F.relu(F.linear(h.flatten(1), sd["fc1.weight"], sd["fc1.bias"]))
    h = F.relu(F.linear(h, sd["fc2.weight"], sd["fc2.bias"]))
    expected = F.linear(h, sd["head.weight"], sd["head.bias"])
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)


def test_lenet_dropout_sits_before_the_head():
    """Train mode drops fc2's activations (FedRep: ReLU → Dropout(0.6) → Linear)."""
    torch.manual_seed(2)
    model = build_model("lenet-cifar10").train()
    seen = {}
    model.head.register_forward_hook(lambda m, i, o: seen.setdefault("x", i[0]))
    model(torch.randn(4, 3, 32, 32))
    x = seen["x"]
    assert x.shape == (4, 64)
    assert (x == 0).float().mean() > 0.4  # ReLU zeros plus 60% dropout


def test_lenet_parameter_counts():
    assert num_parameters(build_on_meta("lenet-cifar10")) == 307_842
    # CIFAR-100: 4,864 + 204,928 + 819,456 + 32,896 + 12,900
    assert num_parameters(build_on_meta("lenet-cifar100")) == 1_075_044


def test_mnist_cnn_is_mcmahans_size():
    """McMahan et al.'s CNN ('same' 5×5 convs, 512-unit FC) has 1,663,370 parameters."""
    assert sum(p.numel() for p in build_model("mnist-cnn", 10).parameters()) == 1_663_370
