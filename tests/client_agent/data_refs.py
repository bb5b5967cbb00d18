"""Data references a test's clients name with ``--data data_refs:NAME`` (this folder is on their PYTHONPATH)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from image_folders import digits_images


class Pictures(torch.utils.data.Dataset):
    """PIL images and their labels: fedatoms resizes and normalizes them."""

    def __init__(self, start: int, stop: int) -> None:
        images, labels = digits_images(1, 11)
        self.images, self.targets = images[start:stop], labels[start:stop].tolist()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.images[i], self.targets[i]


def load():
    """Digits 800 … 1199 as 11×11 grayscale pictures: 320 to train, 80 to test."""
    return Pictures(800, 1120), Pictures(1120, 1200)


def not_a_pair():
    return Pictures(0, 10)


def labels_past_the_classes():
    """Tensors of the model's shape, labels 0 … 11 for a 10-class model (a TensorDataset: no ``targets``)."""
    x = torch.zeros(24, 1, 8, 8)
    y = torch.arange(24) % 12
    return torch.utils.data.TensorDataset(x, y), torch.utils.data.TensorDataset(x[:4], y[:4])


def uint8_images():
    """Images as uint8 tensors, as decoded, not scaled: a conv takes floating-point inputs."""
    x = torch.zeros(24, 1, 8, 8, dtype=torch.uint8)
    y = torch.arange(24) % 10
    return torch.utils.data.TensorDataset(x, y), torch.utils.data.TensorDataset(x[:4], y[:4])


class _Records(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return {"image": torch.zeros(1, 8, 8), "label": i % 10}


def dict_items():
    """Items as dicts (a Hugging Face habit): the loop takes (image, label) pairs."""
    return _Records(), _Records()
