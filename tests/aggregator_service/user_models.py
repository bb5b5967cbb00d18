"""Models a user would bring, importable by reference (``user_models:UserCNN``) from the tests' path."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor, nn
from torchvision.models.vgg import cfgs, make_layers

# A process importing this module leaves its pid here: the allow-list test reads it to know who imported it.
_MARKER = os.environ.get("FEDATOMS_TEST_IMPORT_MARKER")
if _MARKER:
    with Path(_MARKER).open("a") as f:
        f.write(f"{os.getpid()}\n")


class UserCNN(nn.Module):
    """A user's own CNN: a 5×5 stem, a dilated 3×3 conv, a depthwise conv, a 1×1 conv and two linears."""

    def __init__(self, num_classes: int = 10, width: int = 8, in_channels: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 5, padding=2),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=2, dilation=2, bias=False),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1, groups=2 * width),  # depthwise: stays plain
            nn.Conv2d(2 * width, 2 * width, 1),  # 1×1: stays plain
            nn.AdaptiveAvgPool2d(2),
        )
        self.fc = nn.Linear(8 * width, 4 * width)
        self.classifier = nn.Linear(4 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.relu(self.fc(self.features(x).flatten(1))))


def cifar_vgg11_bn(num_classes: int = 10, width: int = 64) -> nn.Module:
    """torchvision's ``vgg11_bn`` features (its ``make_layers``, its init) with the usual CIFAR classifier.

    At 32×32 torchvision's ImageNet classifier is 25088→4096→4096 (123M parameters), too large to
    federate in a test, and ``VGG()`` builds and initializes it before it could be replaced (most
    of a build's time): the convs and BatchNorms, the part fedatoms factorizes, are torchvision's own.
    ``width`` is the first conv's channels (64 in VGG-11; every later width scales with it), as
    CIFAR users narrow VGG for small devices.
    """
    layers = [v if v == "M" else int(v) * width // 64 for v in cfgs["A"]]
    net = nn.Sequential()
    net.features = make_layers(layers, batch_norm=True)
    net.avgpool = nn.AdaptiveAvgPool2d(1)
    net.flatten = nn.Flatten()
    net.classifier = nn.Sequential(nn.Linear(8 * width, 128), nn.ReLU(), nn.Linear(128, num_classes))
    for m in net.features.modules():  # as torchvision.models.VGG initializes them
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return net
