"""The walker's rules and the FLOP-counter MACs, against hand counts and hand-picked layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedcore.convert import Factorization, factorize, full_rank_layers, head_name
from fedcore.layers import AtomConv2d, LowRankConv2d, LowRankLinear
from fedcore.macs import count_macs
from fedcore.models import build_model
from fedcore.spec import ModelSpec


class Small(nn.Module):
    """conv 3→4 (3×3, pad 1) on 8×8, BN, linear 256→5."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.out = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.conv(x))).flatten(1))


class Mixed(nn.Module):
    """A stem, a depthwise stride-2 conv, a 1×1 conv and two linears on 4×6×6."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.dw = nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=4)
        self.pw = nn.Conv2d(4, 8, 1)
        self.fc = nn.Linear(72, 6)
        self.cls = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pw(self.dw(self.stem(x)))
        return self.cls(torch.relu(self.fc(x.flatten(1))))


def test_macs_of_a_conv_bn_linear_model_by_hand() -> None:
    # conv: 4 outputs × 3 inputs × 9 taps × 64 positions; linear: 256 × 5; BN is not a MAC
    assert count_macs(Small(), (3, 8, 8)) == 4 * 3 * 9 * 64 + 256 * 5


def test_macs_of_depthwise_pointwise_and_a_low_rank_linear_by_hand() -> None:
    model = factorize(Mixed(), Factorization("lowrank", rank_ratio=0.5), full_rank=["stem"])
    assert isinstance(model.fc, LowRankLinear) and model.fc.rank == 3
    stem = 4 * 4 * 9 * 36  # full rank by the pattern
    depthwise = 4 * 1 * 9 * 9  # one input channel per filter, 3×3 outputs
    pointwise = 8 * 4 * 9
    low_rank_fc = 3 * (72 + 6)  # V then U
    head = 6 * 3
    assert count_macs(model, (4, 6, 6)) == stem + depthwise + pointwise + low_rank_fc + head


def test_macs_on_the_meta_device_equal_those_on_the_cpu() -> None:
    with torch.device("meta"):
        meta = Small()
    assert count_macs(meta, (3, 8, 8)) == count_macs(Small(), (3, 8, 8))


def test_walker_keeps_depthwise_1x1_head_and_stem_plain_and_factorizes_the_rest() -> None:
    model = factorize(Mixed(), Factorization("atoms-lowrank", num_atoms=5, rank_ratio=0.5))
    assert isinstance(model.stem, AtomConv2d) and model.stem.rank is None  # the stem: atoms, full rank
    assert type(model.dw) is nn.Conv2d and type(model.pw) is nn.Conv2d
    assert isinstance(model.fc, LowRankLinear) and type(model.cls) is nn.Linear
    lowrank = factorize(Mixed(), Factorization("lowrank", rank_ratio=0.5), full_rank=[])
    assert isinstance(lowrank.stem, LowRankConv2d)  # no full-rank layer when the patterns name none


def test_head_is_the_last_linear_or_the_configured_one() -> None:
    assert head_name(Mixed()) == "cls"
    assert head_name(Mixed(), "fc") == "fc"
    with pytest.raises(ValueError, match=r"not an nn\.Linear"):
        head_name(Mixed(), "pw")
    model = factorize(Mixed(), Factorization("lowrank", rank_ratio=0.5), head="fc")
    assert type(model.fc) is nn.Linear  # the configured head stays plain


def test_full_rank_patterns_override_the_models_own_and_unmatched_ones_are_refused() -> None:
    resnet = build_model("resnet18")
    assert full_rank_layers(resnet) == {"conv1", "layer1.0.conv1", "layer1.0.conv2"}  # FedHM Table 5
    assert full_rank_layers(resnet, ["layer4.*"]) >= {"layer4.0.conv1", "layer4.1.conv2"}
    assert "conv1" not in full_rank_layers(resnet, ["layer4.*"])
    with pytest.raises(ValueError, match="match no conv or linear"):
        full_rank_layers(resnet, ["nope.*"])


class Ladder(nn.Module):
    """Factorizable weights 36 (conv1), 288 (conv2), 4,608 (fc) and a head: 4,932 in the body, by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)  # 10×10 → 8×8
        self.pw = nn.Conv2d(4, 4, 1)  # 1×1: never factorized, not counted
        self.conv2 = nn.Conv2d(4, 8, 3)  # → 6×6
        self.fc = nn.Linear(8 * 6 * 6, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(self.pw(torch.relu(self.conv1(x)))))
        return self.head(torch.relu(self.fc(x.flatten(1))))


def test_the_leading_layers_within_the_share_keep_full_rank_with_the_stem() -> None:
    model = Ladder()
    assert full_rank_layers(model) == {"conv1"}  # share 0: the stem alone, the rule before the share
    assert full_rank_layers(model, share=0.066) == {"conv1", "conv2"}  # together 324 / 4,932 = 6.57 %
    assert full_rank_layers(model, share=0.065) == {"conv1"}  # conv2 alone is 5.8 %: the sum counts
    assert full_rank_layers(model, share=0.99) == {"conv1", "conv2"}  # the fc would bring 100 %; a prefix only
    lowrank = factorize(Ladder(), Factorization("lowrank", rank_ratio=0.125), full_rank_share=0.99)
    assert type(lowrank.conv2) is nn.Conv2d and isinstance(lowrank.fc, LowRankLinear)
    assert type(lowrank.head) is nn.Linear
    # patterns and a model's own layers override the share
    assert full_rank_layers(model, ["fc"], share=0.99) == {"fc"}
    assert full_rank_layers(build_model("resnet18"), share=0.5) == {"conv1", "layer1.0.conv1", "layer1.0.conv2"}
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"full_rank_share must be in \[0, 1\)"):
            full_rank_layers(model, share=bad)


def test_the_default_share_keeps_the_narrow_convs_of_mcmahans_cnn_and_not_the_digits_cnns_conv2() -> None:
    from aggregator_service.config import FederationConfig

    # mnist-cnn: conv1 800 and conv2 51,200 of 1,657,632 body weights (3.1 %) against fc1's 1,605,632
    mnist = FederationConfig(model="mnist-cnn", factorization="atoms-lowrank", tiers=[1.0, 0.125])
    eighth = mnist.spec.at_tier(0.125)
    assert "conv2.coefficients" in eighth.names and "conv2.coefficients_u" not in eighth.names
    assert "fc1.lowrank_u" in eighth.names
    # digits-cnn: conv2's 18,432 of 149,792 bring the prefix to 12.5 %, past 1/16: rank 8 at ⅛ as before
    digits = FederationConfig(model="digits-cnn", factorization="atoms-lowrank", tiers=[1.0, 0.125])
    assert digits.spec.at_tier(0.125).tensor("conv2.coefficients_u").shape == (64, 8)
    with pytest.raises(ValueError, match="full_rank_share"):
        FederationConfig(model="mnist-cnn", full_rank_share=1.5)


def test_a_widening_linear_stays_full_rank_where_its_factors_would_be_larger() -> None:
    wide = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    model = factorize(wide, Factorization("lowrank", rank_ratio=0.5))
    # rank 16 factors of 32×8 hold 16·40 = 640 numbers, the matrix 256: it stays a plain Linear
    assert type(model[0]) is nn.Linear


def test_a_reference_needs_an_input_shape_and_the_right_number_of_classes() -> None:
    with pytest.raises(ValueError, match="input_shape"):
        ModelSpec("torchvision.models:resnet18", 10, model_args={"num_classes": 10})
    spec = ModelSpec("torchvision.models:resnet18", 10, input_shape=(3, 32, 32))  # builds 1000 classes
    with pytest.raises(ValueError, match="num_classes"):
        spec.check_forward()  # where a federation takes the model (the shapes alone need no forward pass)
    with pytest.raises(ValueError, match="import reference"):
        ModelSpec("not a reference", 10, input_shape=(3, 32, 32))


class TiedConvs(nn.Module):
    """``c3`` applies ``c2``'s weight (one Parameter) with a bias of its own, on 3×8×8."""

    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3.weight = self.c2.weight
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.c3(torch.relu(self.c2(torch.relu(self.c1(x)))))).mean((2, 3)))


class ReusedBlock(nn.Module):
    """One conv module at two paths, ``block.0`` and ``block.2`` (the usual weight-sharing idiom), on 3×8×8."""

    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        shared = nn.Conv2d(8, 8, 3, padding=1)
        self.block = nn.Sequential(shared, nn.ReLU(), shared)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(torch.relu(self.stem(x)))).mean((2, 3)))


@pytest.mark.parametrize("model", [TiedConvs, ReusedBlock])
def test_a_tied_weight_a_factorization_would_untie_is_refused_and_kept_whole_it_stays_tied(model) -> None:
    """Each layer that is replaced gets factors of its own: a weight two layers shared would train apart, and
    the exported plain model would keep whichever copy loads last. Refused by name; kept whole (FedHM's
    full_rank), the layers still hold one Parameter after a training step."""
    paths = ["c2", "c3"] if model is TiedConvs else ["block.0", "block.2"]
    for kind in ("atoms", "atoms-lowrank", "lowrank"):
        with pytest.raises(ValueError, match=rf"{paths[0]}\.weight and {paths[1]}\.weight are one tied parameter"):
            factorize(model(), Factorization(kind, rank_ratio=0.5))
    net = factorize(model(), Factorization("lowrank", rank_ratio=0.5), full_rank=paths)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.randn(4, 3, 8, 8)).sum().backward()
    optimizer.step()
    assert net.get_parameter(f"{paths[0]}.weight") is net.get_parameter(f"{paths[1]}.weight")


def test_a_module_reused_at_two_paths_has_a_spec_that_names_both() -> None:
    """``state_dict`` keeps both paths of a reused module, so the spec must too (it raised KeyError)."""
    spec = ModelSpec("test_convert:ReusedBlock", 3, input_shape=(3, 8, 8))
    names = {t.name for t in spec.tensors}
    assert names == set(ReusedBlock().state_dict())
    assert {"block.0.weight", "block.2.weight"} <= names
    spec.check_forward()


def test_a_frozen_layer_stays_frozen_in_its_factors() -> None:
    """A layer the model's code froze (``requires_grad_(False)``) gets no gradient in the plain model, and its
    factors must get none either: they trained, so a frozen stem moved once factorized."""

    def frozen() -> nn.Module:
        net = Mixed()
        net.stem.requires_grad_(False)
        net.fc.weight.requires_grad_(False)  # the weight alone: its bias trains
        return net

    x = torch.randn(2, 4, 6, 6)
    plain = frozen()
    plain(x).sum().backward()
    assert plain.stem.weight.grad is None and plain.fc.weight.grad is None and plain.fc.bias.grad is not None
    for kind in ("atoms", "lowrank", "atoms-lowrank"):
        net = factorize(frozen(), Factorization(kind, rank_ratio=0.5), full_rank=[])
        net(x).sum().backward()
        assert isinstance(net.stem, AtomConv2d | LowRankConv2d), kind
        assert all(p.grad is None for p in net.stem.parameters()), kind
        if isinstance(net.fc, LowRankLinear):
            assert net.fc.lowrank_u.grad is None and net.fc.lowrank_v.grad is None and net.fc.bias.grad is not None
        assert net.cls.weight.grad is not None


def test_a_builder_that_reads_tensor_values_gets_its_spec_from_a_cpu_build() -> None:
    """torchvision's RegNets take ``.tolist()`` of a tensor while they build, which the meta device cannot
    answer: every RegNet was refused as unbuildable. The spec now comes from a CPU build, and its tensors are
    the model's own."""
    spec = ModelSpec("torchvision.models:regnet_x_400mf", 3, model_args={"num_classes": 3}, input_shape=(3, 32, 32))
    import torchvision

    reference = torchvision.models.regnet_x_400mf(num_classes=3).state_dict()
    assert {t.name: t.shape for t in spec.tensors} == {name: tuple(t.shape) for name, t in reference.items()}
    spec.check_forward()


def test_atoms_on_a_model_without_a_conv_to_decompose_is_refused() -> None:
    """An MLP under factorization 'atoms' ran plain FedAvg without a word; the user asked for atoms."""
    with pytest.raises(ValueError, match="factorization 'atoms' finds no conv"):
        _ = ModelSpec("test_convert:Perceptron", 3, "atoms", input_shape=(4,)).tensors
    assert {t.role for t in ModelSpec("test_convert:Perceptron", 3, "atoms-lowrank", input_shape=(4,)).tensors} == {
        "body",
        "head",
    }


class Perceptron(nn.Sequential):
    def __init__(self, num_classes: int = 3) -> None:
        super().__init__(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, num_classes))
