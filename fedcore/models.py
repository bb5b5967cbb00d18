"""Model zoo: the five architectures of the papers' experiments, as plain PyTorch networks.

The zoo is no different from a user's model: each net is written with ``nn.Conv2d`` and
``nn.Linear`` only, and :func:`fedcore.convert.factorize` turns it into any factorization and
tier. A zoo name is a short reference (:data:`MODELS`); its builder takes ``num_classes``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedcore.convert import FACTORIZATIONS, Factorization, factorize

__all__ = [
    "FACTORIZATIONS",
    "MODELS",
    "Factorization",
    "ModelInfo",
    "build_model",
    "model_info",
]

# --------------------------------------------------------------------------- small CNNs


class DigitsCNN(nn.Module):
    """For sklearn's 8×8 digits: small enough that a 20-client federation trains in seconds."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.head = nn.Linear(128, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.conv1(x))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.head(x)


class MnistCNN(nn.Module):
    """McMahan et al.'s MNIST CNN: two 5×5 'same' convs, 512-unit FC, 1,663,370 parameters."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(64 * 7 * 7, 512)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.head(x)


class LeNetCifar(nn.Module):
    """FedRep's CIFAR CNNs (``CNNCifar`` / ``CNNCifar100``), specs/filter-decomposition.md §4.1."""

    def __init__(self, num_classes: int, width: tuple[int, int, int, int]) -> None:
        super().__init__()
        c2, h1, h2 = width[1], width[2], width[3]
        self.conv1 = nn.Conv2d(3, width[0], 5)
        self.conv2 = nn.Conv2d(width[0], c2, 5)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(c2 * 5 * 5, h1)
        self.fc2 = nn.Linear(h1, h2)
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

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
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

    fedatoms_full_rank = ("conv1", "layer1.0.*")

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers: list[nn.Sequential] = []
        in_planes = 64
        for stage, planes in enumerate((64, 128, 256, 512)):
            blocks = []
            for b in range(2):
                stride = 2 if stage > 0 and b == 0 else 1
                blocks.append(BasicBlock(in_planes, planes, stride))
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


def digits_cnn(num_classes: int = 10) -> DigitsCNN:
    return DigitsCNN(num_classes)


def mnist_cnn(num_classes: int = 10) -> MnistCNN:
    return MnistCNN(num_classes)


def lenet_cifar10(num_classes: int = 10) -> LeNetCifar:
    return LeNetCifar(num_classes, (64, 64, 120, 64))


def lenet_cifar100(num_classes: int = 100) -> LeNetCifar:
    return LeNetCifar(num_classes, (64, 128, 256, 128))


def resnet18(num_classes: int = 10) -> ResNet18:
    return ResNet18(num_classes)


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the system needs to know about a zoo architecture without building it."""

    name: str
    input_shape: tuple[int, int, int]
    default_classes: int
    builder: Callable[[int], nn.Module]

    @property
    def reference(self) -> str:
        """The import reference this zoo name stands for."""
        return f"{__name__}:{self.builder.__name__}"


MODELS: dict[str, ModelInfo] = {
    info.name: info
    for info in (
        ModelInfo("digits-cnn", (1, 8, 8), 10, digits_cnn),
        ModelInfo("mnist-cnn", (1, 28, 28), 10, mnist_cnn),
        ModelInfo("lenet-cifar10", (3, 32, 32), 10, lenet_cifar10),
        ModelInfo("lenet-cifar100", (3, 32, 32), 100, lenet_cifar100),
        ModelInfo("resnet18", (3, 32, 32), 10, resnet18),
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
    num_atoms: int | None = None,
    rank_ratio: float = 1.0,
) -> nn.Module:
    """Build zoo model ``name`` with every layer parameterized by ``factorization`` at tier ``rank_ratio``."""
    info = model_info(name)
    f = Factorization(factorization, num_atoms, rank_ratio)
    return factorize(info.builder(num_classes or info.default_classes), f)
