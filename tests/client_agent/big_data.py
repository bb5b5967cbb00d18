"""A generated dataset larger than the memory a test gives the client: ``--data big_data:load``.

Every item is made when it is read (seeded by its index), so the set itself takes no memory;
``BIG_DATA_SAMPLES`` says how many 3×32×32 float32 inputs it holds (12 KiB each). ``StreamNet``
is the federation's model: one 5×5 convolution and a head, so that a pass over hundreds of
megabytes of inputs costs seconds (what is tested is the memory, not the model).
"""

from __future__ import annotations

import os

import torch


class Generated(torch.utils.data.Dataset):
    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        label = (i + self.offset) % 10
        g = torch.Generator().manual_seed(i + self.offset)
        x = torch.rand(3, 32, 32, generator=g) * 0.5
        x[label % 3] += 0.5  # learnable: the label shows in one channel's brightness
        return x, label


class StreamNet(torch.nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 5)
        self.pool = torch.nn.MaxPool2d(4)
        self.head = torch.nn.Linear(8 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.relu(self.conv(x))).flatten(1))


def load():
    n = int(os.environ.get("BIG_DATA_SAMPLES", "2000"))
    return Generated(n), Generated(500, offset=n)
