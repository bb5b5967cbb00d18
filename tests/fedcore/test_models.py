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

from fedcore.layers import AtomConv2d, LowRankConv2d, LowRankLinear
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


# Every conv/linear of the small models, written out by hand from the rules of specs/fedhm.md §1.3–1.4
# and models.Factorization: conv1 (the full-rank prefix) and the head are never low rank, a k×k conv
# is atoms under "atoms*", ranks are round(γ·c_out): at γ = ¼, 64 → 16, 128 → 32, 120 → 30, 256 → 64,
# 512 → 128; at γ = ⅛ (lenet-cifar10), 64 → 8, 120 → 15.
LAYOUTS = {
    ("digits-cnn", 0.25): {
        "none": "conv1 Conv2d, conv2 Conv2d, fc1 Linear, head Linear",
        "atoms": "conv1 AtomConv2d, conv2 AtomConv2d, fc1 Linear, head Linear",
        "lowrank": "conv1 Conv2d, conv2 LowRankConv2d/16, fc1 LowRankLinear/32, head Linear",
        "atoms-lowrank": "conv1 AtomConv2d, conv2 AtomConv2d/16, fc1 LowRankLinear/32, head Linear",
    },
    ("mnist-cnn", 0.25): {
        "none": "conv1 Conv2d, conv2 Conv2d, fc1 Linear, head Linear",
        "atoms": "conv1 AtomConv2d, conv2 AtomConv2d, fc1 Linear, head Linear",
        "lowrank": "conv1 Conv2d, conv2 LowRankConv2d/16, fc1 LowRankLinear/128, head Linear",
        "atoms-lowrank": "conv1 AtomConv2d, conv2 AtomConv2d/16, fc1 LowRankLinear/128, head Linear",
    },
    ("lenet-cifar10", 0.25): {
        "none": "conv1 Conv2d, conv2 Conv2d, fc1 Linear, fc2 Linear, head Linear",
        "atoms": "conv1 AtomConv2d, conv2 AtomConv2d, fc1 Linear, fc2 Linear, head Linear",
        "lowrank": "conv1 Conv2d, conv2 LowRankConv2d/16, fc1 LowRankLinear/30, fc2 LowRankLinear/16, head Linear",
        "atoms-lowrank": (
            "conv1 AtomConv2d, conv2 AtomConv2d/16, fc1 LowRankLinear/30, fc2 LowRankLinear/16, head Linear"
        ),
    },
    ("lenet-cifar10", 0.125): {
        "lowrank": "conv1 Conv2d, conv2 LowRankConv2d/8, fc1 LowRankLinear/15, fc2 LowRankLinear/8, head Linear",
        "atoms-lowrank": "conv1 AtomConv2d, conv2 AtomConv2d/8, fc1 LowRankLinear/15, fc2 LowRankLinear/8, head Linear",
    },
    ("lenet-cifar100", 0.25): {
        "none": "conv1 Conv2d, conv2 Conv2d, fc1 Linear, fc2 Linear, head Linear",
        "atoms": "conv1 AtomConv2d, conv2 AtomConv2d, fc1 Linear, fc2 Linear, head Linear",
        "lowrank": "conv1 Conv2d, conv2 LowRankConv2d/32, fc1 LowRankLinear/64, fc2 LowRankLinear/32, head Linear",
        "atoms-lowrank": (
            "conv1 AtomConv2d, conv2 AtomConv2d/32, fc1 LowRankLinear/64, fc2 LowRankLinear/32, head Linear"
        ),
    },
}


def layout(model: nn.Module) -> str:
    """``"<module> <type>[/<rank>]"`` for every conv and linear, in definition order."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Linear, *FACTORIZED_TYPES)):
            rank = getattr(module, "rank", None)
            out.append(f"{name} {type(module).__name__}" + (f"/{rank}" if rank is not None else ""))
    return ", ".join(out)


@pytest.mark.parametrize(
    ("name", "rank_ratio", "factorization"),
    [(name, gamma, kind) for (name, gamma), kinds in LAYOUTS.items() for kind in kinds],
)
def test_every_layer_follows_the_factorization_rules(name, rank_ratio, factorization):
    assert layout(build_on_meta(name, factorization, rank_ratio)) == LAYOUTS[name, rank_ratio][factorization]


def hand_filter(layer: nn.Module) -> torch.Tensor:
    """The dense ``(o, i, k, k)`` filter a factorized conv stands for, rebuilt from its parameters by hand."""
    if isinstance(layer, nn.Conv2d):
        return layer.weight
    if isinstance(layer, LowRankConv2d):  # FedHM's unrolled M = U V with rows (o, kh) and columns (i, kw)
        o, i, k = layer.out_channels, layer.in_channels, layer.kernel_size
        u = layer.lowrank_u.reshape(o, k, layer.rank)
        v = layer.lowrank_v.reshape(layer.rank, i, k)
        return torch.einsum("oxr,riy->oixy", u, v)
    assert isinstance(layer, AtomConv2d)
    if layer.rank is None:
        alpha = layer.coefficients
    else:  # the (o, i·m) coefficient matrix = coefficients_u coefficients_v
        cv = layer.coefficients_v.reshape(layer.rank, layer.in_channels, layer.num_atoms)
        alpha = torch.einsum("or,riq->oiq", layer.coefficients_u, cv)
    return (alpha[:, :, :, None, None] * layer.atoms[None, None]).sum(dim=2)  # W[o,i] = Σ_q α[o,i,q] D_q


@pytest.mark.parametrize(
    ("kind", "keep_full_rank", "expected_type"),
    [
        ("none", False, nn.Conv2d),
        ("atoms", False, AtomConv2d),
        ("lowrank", False, LowRankConv2d),
        ("lowrank", True, nn.Conv2d),
        ("atoms-lowrank", False, AtomConv2d),
        ("atoms-lowrank", True, AtomConv2d),
    ],
)
def test_factorized_conv_computes_a_plain_conv_with_its_reconstructed_filter(kind, keep_full_rank, expected_type):
    """Factorization.conv(3 → 4, k=3, stride 2, padding 1) at γ = ½ (rank 2) is F.conv2d with the hand-built filter."""
    torch.manual_seed(0)
    layer = Factorization(kind, num_atoms=5, rank_ratio=0.5).conv(
        3, 4, 3, stride=2, padding=1, keep_full_rank=keep_full_rank
    )
    layer = layer.double()
    assert type(layer) is expected_type
    low = kind in ("lowrank", "atoms-lowrank") and not keep_full_rank
    assert getattr(layer, "rank", None) == (2 if low else None)  # round(½ · 4)
    with torch.no_grad():
        for p in layer.parameters():  # nonzero everywhere, bias included
            p.copy_(torch.randn_like(p))
    x = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    expected = F.conv2d(x, hand_filter(layer), layer.bias, stride=2, padding=1)
    assert expected.shape == (2, 4, 4, 3)
    torch.testing.assert_close(layer(x), expected, rtol=1e-10, atol=1e-10)


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
                k = module.kernel_size  # k² atoms by default: a complete basis of the k×k filters
                assert tuple(module.atoms.shape) == (k * k, k, k)
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
