"""Model zoo: one builder per architecture, one :class:`Factorization` deciding every layer.

Builders never pick layer classes themselves; they ask the factorization for a conv or a
linear and say whether the layer belongs to FedHM's full-rank prefix (``keep_full_rank``).
So ``none``, ``atoms``, ``lowrank`` and ``atoms-lowrank`` are the same network code, and
the last ``nn.Linear`` is always called ``head`` so its role is read from its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedcore.layers import AtomConv2d, LowRankConv2d, LowRankLinear, rank_for

__all__ = [
    "FACTORIZATIONS",
    "MODELS",
    "Factorization",
    "ModelInfo",
    "build_model",
    "model_info",
]

FACTORIZATIONS = ("none", "atoms", "lowrank", "atoms-lowrank")


@dataclass(frozen=True)
class Factorization:
    """How every conv and body linear of a model is parameterized for one tier.

    - ``none``: plain layers.
    - ``atoms``: every ``k×k`` conv (``k > 1``) is an :class:`AtomConv2d`; 1×1 convs stay plain
      because a 1×1 atom is a scalar and adds nothing.
    - ``lowrank``: FedHM; for ``rank_ratio < 1`` every conv and body linear outside the
      full-rank prefix becomes :class:`LowRankConv2d` / :class:`LowRankLinear`.
    - ``atoms-lowrank``: atoms everywhere, and outside the prefix the coefficients are low-rank
      at ``rank_ratio``; body linears are low-rank as in ``lowrank``.

    The head and 1×1 shortcut convs are never factorized (FedHM's counts need exactly that).
    """

    kind: str = "none"
    num_atoms: int = 9
    rank_ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in FACTORIZATIONS:
            raise ValueError(f"unknown factorization {self.kind!r}; choose one of {', '.join(FACTORIZATIONS)}")
        rank_for(self.rank_ratio, 1)  # validates the ratio
        if self.num_atoms < 1:
            raise ValueError(f"num_atoms must be ≥ 1, got {self.num_atoms}")

    @property
    def low_rank(self) -> bool:
        return self.kind in ("lowrank", "atoms-lowrank") and self.rank_ratio < 1.0

    def conv(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        bias: bool = True,
        keep_full_rank: bool = False,
    ) -> nn.Module:
        reduce = self.low_rank and not keep_full_rank
        if self.kind in ("atoms", "atoms-lowrank") and kernel_size > 1:
            return AtomConv2d(
                in_channels,
                out_channels,
                kernel_size,
                num_atoms=self.num_atoms,
                stride=stride,
                padding=padding,
                bias=bias,
                rank=rank_for(self.rank_ratio, out_channels) if reduce else None,
            )
        if self.kind == "lowrank" and reduce and kernel_size > 1:
            return LowRankConv2d(
                in_channels,
                out_channels,
                kernel_size,
                rank_for(self.rank_ratio, out_channels),
                stride=stride,
                padding=padding,
                bias=bias,
            )
        return nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=bias)

    def linear(self, in_features: int, out_features: int, keep_full_rank: bool = False) -> nn.Module:
        if self.low_rank and not keep_full_rank:
            return LowRankLinear(in_features, out_features, rank_for(self.rank_ratio, out_features))
        return nn.Linear(in_features, out_features)


# --------------------------------------------------------------------------- small CNNs


class DigitsCNN(nn.Module):
    """For sklearn's 8×8 digits: small enough that a 20-client federation trains in seconds."""

    def __init__(self, num_classes: int, f: Factorization) -> None:
        super().__init__()
        self.conv1 = f.conv(1, 32, 3, padding=1, keep_full_rank=True)
        self.conv2 = f.conv(32, 64, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = f.linear(64 * 4 * 4, 128)
        self.head = nn.Linear(128, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.conv1(x))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.head(x)


class MnistCNN(nn.Module):
    """McMahan et al.'s MNIST CNN: two 5×5 'same' convs, 512-unit FC, 1,663,370 parameters."""

    def __init__(self, num_classes: int, f: Factorization) -> None:
        super().__init__()
        self.conv1 = f.conv(1, 32, 5, padding=2, keep_full_rank=True)
        self.conv2 = f.conv(32, 64, 5, padding=2)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = f.linear(64 * 7 * 7, 512)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.head(x)


class LeNetCifar(nn.Module):
    """FedRep's CIFAR CNNs (``CNNCifar`` / ``CNNCifar100``), specs/filter-decomposition.md §4.1."""

    def __init__(self, num_classes: int, f: Factorization, width: tuple[int, int, int, int]) -> None:
        super().__init__()
        c2, h1, h2 = width[1], width[2], width[3]
        self.conv1 = f.conv(3, width[0], 5, keep_full_rank=True)
        self.conv2 = f.conv(width[0], c2, 5)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = f.linear(c2 * 5 * 5, h1)
        self.fc2 = f.linear(h1, h2)
        self.dropout = nn.Dropout(0.6)
        self.head = nn.Linear(h2, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(x.flatten(1)))
        x = torch.relu(self.fc2(x))
        return self.head(self.dropout(x))


# --------------------------------------------------------------------------- ResNet-18


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(
        self, in_planes: int, planes: int, stride: int, f: Factorization, keep_full_rank: bool = False
    ) -> None:
        super().__init__()
        self.conv1 = f.conv(in_planes, planes, 3, stride=stride, padding=1, bias=False, keep_full_rank=keep_full_rank)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = f.conv(planes, planes, 3, padding=1, bias=False, keep_full_rank=keep_full_rank)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Sequential()
        if stride != 1 or in_planes != planes:
            # 1×1 shortcuts are never factorized (FedHM's parameter counts require it)
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR ResNet-18 (3×3 stem, no max-pool); ``conv1`` and ``layer1.0`` stay full rank (FedHM Table 5)."""

    def __init__(self, num_classes: int, f: Factorization) -> None:
        super().__init__()
        self.conv1 = f.conv(3, 64, 3, padding=1, bias=False, keep_full_rank=True)
        self.bn1 = nn.BatchNorm2d(64)
        layers: list[nn.Sequential] = []
        in_planes = 64
        for stage, planes in enumerate((64, 128, 256, 512)):
            blocks = []
            for b in range(2):
                stride = 2 if stage > 0 and b == 0 else 1
                blocks.append(BasicBlock(in_planes, planes, stride, f, keep_full_rank=stage == 0 and b == 0))
                in_planes = planes
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.head(self.pool(x).flatten(1))


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the system needs to know about an architecture without building it."""

    name: str
    input_shape: tuple[int, int, int]
    default_classes: int
    builder: Callable[[int, Factorization], nn.Module]


MODELS: dict[str, ModelInfo] = {
    info.name: info
    for info in (
        ModelInfo("digits-cnn", (1, 8, 8), 10, DigitsCNN),
        ModelInfo("mnist-cnn", (1, 28, 28), 10, MnistCNN),
        ModelInfo("lenet-cifar10", (3, 32, 32), 10, lambda n, f: LeNetCifar(n, f, (64, 64, 120, 64))),
        ModelInfo("lenet-cifar100", (3, 32, 32), 100, lambda n, f: LeNetCifar(n, f, (64, 128, 256, 128))),
        ModelInfo("resnet18", (3, 32, 32), 10, ResNet18),
    )
}


def model_info(name: str) -> ModelInfo:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None


def build_model(
    name: str,
    num_classes: int | None = None,
    factorization: str = "none",
    num_atoms: int = 9,
    rank_ratio: float = 1.0,
) -> nn.Module:
    """Build ``name`` with every layer parameterized by ``factorization`` at tier ``rank_ratio``."""
    info = model_info(name)
    f = Factorization(factorization, num_atoms, rank_ratio)
    return info.builder(num_classes or info.default_classes, f)
