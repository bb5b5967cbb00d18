"""Datasets and client partitions, deterministic by seed.

Every experiment compares methods on the *same* clients, so a partition must be a pure
function of ``(labels, num_clients, scheme, parameters, seed)``. Datasets are converted
to one normalized float32 tensor up front: federated simulation touches every sample
thousands of times, and per-sample PIL transforms would dominate the run time.

Only ``digits`` (bundled with scikit-learn) works offline; the torchvision datasets are
read from a data directory and downloaded only when asked to.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Subset, TensorDataset

__all__ = [
    "DATASETS",
    "DEFAULT_DATA_DIR",
    "INPUT_SHAPES",
    "NUM_CLASSES",
    "SCHEMES",
    "ArrayDataset",
    "DatasetNotFoundError",
    "benchmark_normalization",
    "check_labels",
    "known_labels",
    "labels_of",
    "load_dataset",
    "local_test_splits",
    "num_classes_of",
    "partition",
    "take",
]

DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "cifar100")
NUM_CLASSES: dict[str, int] = {"digits": 10, "mnist": 10, "fashion-mnist": 10, "cifar10": 10, "cifar100": 100}
INPUT_SHAPES: dict[str, tuple[int, int, int]] = {
    "digits": (1, 8, 8),
    "mnist": (1, 28, 28),
    "fashion-mnist": (1, 28, 28),
    "cifar10": (3, 32, 32),
    "cifar100": (3, 32, 32),
}
SCHEMES = ("iid", "shards", "dirichlet")

# Where torchvision datasets live when no data_dir is given; FEDATOMS_DATA_DIR overrides it.
DEFAULT_DATA_DIR = Path(os.environ.get("FEDATOMS_DATA_DIR", "~/.cache/fedatoms/data")).expanduser()

# Per-channel mean/std of each training set (the standard published constants).
_NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    # digits: its training split's own (tests/fedcore/test_data.py recomputes them from sklearn's images)
    "digits": ((0.3053833842277527,), (0.3761191666126251,)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
# torchvision class name and the folder (under data_dir) that holds its files, for error messages.
_TORCHVISION: dict[str, tuple[str, str]] = {
    "mnist": ("MNIST", "MNIST/raw"),
    "fashion-mnist": ("FashionMNIST", "FashionMNIST/raw"),
    "cifar10": ("CIFAR10", "cifar-10-batches-py"),
    "cifar100": ("CIFAR100", "cifar-100-python"),
}


class DatasetNotFoundError(FileNotFoundError):
    """The dataset's files are not where we looked and downloading was not allowed."""


@dataclass
class ArrayDataset:
    """A whole dataset in memory: ``x`` float32 ``N×C×H×W`` (normalized), ``y`` int64 ``N``."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        if self.x.dtype != torch.float32 or self.x.dim() != 4:
            raise ValueError(f"x must be float32 N×C×H×W, got {self.x.dtype} {tuple(self.x.shape)}")
        if self.y.dtype != torch.int64 or self.y.dim() != 1 or len(self.y) != len(self.x):
            raise ValueError(f"y must be int64 of length {len(self.x)}, got {self.y.dtype} {tuple(self.y.shape)}")

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, indices: np.ndarray | Sequence[int]) -> ArrayDataset:
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        return ArrayDataset(self.x[idx], self.y[idx], self.num_classes, self.name)

    def labels_numpy(self) -> np.ndarray:
        """A copy of the labels as an int64 array (what partitions take)."""
        return self.y.cpu().numpy().copy()


def load_dataset(
    name: str, data_dir: str | Path | None = None, download: bool = False
) -> tuple[ArrayDataset, ArrayDataset]:
    """Load ``(train, test)``; torchvision sets come from ``data_dir`` (default :data:`DEFAULT_DATA_DIR`)."""
    key = name.lower()
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
    if key == "digits":
        return _load_digits()
    return _load_torchvision(key, Path(data_dir).expanduser() if data_dir is not None else DEFAULT_DATA_DIR, download)


def benchmark_normalization(name: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The per-channel ``(mean, std)`` a bundled benchmark's loader normalizes its [0, 1] pixels with: what a
    model trained on it expects of an image, so a model file must carry it (``fedatoms predict`` reads it)."""
    key = name.lower()
    if key not in _NORMALIZATION:
        raise ValueError(f"{name!r} is not a bundled benchmark; choose one of {', '.join(_NORMALIZATION)}")
    return _NORMALIZATION[key]


def _load_digits() -> tuple[ArrayDataset, ArrayDataset]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (np.asarray(bunch.images, dtype=np.float32) / 16.0)[:, None, :, :]
    y = np.asarray(bunch.target, dtype=np.int64)
    train_idx, test_idx = train_test_split(np.arange(len(y)), test_size=0.2, stratify=y, random_state=0)
    train_idx, test_idx = np.sort(train_idx), np.sort(test_idx)
    (mean,), (std,) = _NORMALIZATION["digits"]
    x = (x - mean) / std

    def make(idx: np.ndarray) -> ArrayDataset:
        return ArrayDataset(torch.from_numpy(x[idx].copy()), torch.from_numpy(y[idx].copy()), 10, "digits")

    return make(train_idx), make(test_idx)


def _load_torchvision(key: str, root: Path, download: bool) -> tuple[ArrayDataset, ArrayDataset]:
    cls_name, folder = _TORCHVISION[key]

    def not_found() -> DatasetNotFoundError:
        return DatasetNotFoundError(
            f"dataset {key!r} not found in {root} (looked for {root / folder}). Pass --data-dir pointing at the "
            f"directory that holds {folder.split('/')[0]!r}, or allow downloading (--download / download=True)."
        )

    if not download and not (root / folder.split("/")[0]).is_dir():
        raise not_found()  # without paying for the torchvision import
    import torchvision.datasets as tvd

    cls: Any = getattr(tvd, cls_name)
    try:
        if download:
            root.mkdir(parents=True, exist_ok=True)
        sets = [cls(root=str(root), train=train, download=download) for train in (True, False)]
    except RuntimeError as exc:
        if "not found" not in str(exc).lower():
            raise
        raise not_found() from exc
    mean, std = _NORMALIZATION[key]
    return tuple(_to_array_dataset(ds, key, mean, std) for ds in sets)  # type: ignore[return-value]


def _to_array_dataset(ds: Any, key: str, mean: tuple[float, ...], std: tuple[float, ...]) -> ArrayDataset:
    data = torch.as_tensor(np.asarray(ds.data))
    if data.dim() == 3:  # MNIST-like: N×H×W
        data = data.unsqueeze(1)
    else:  # CIFAR: N×H×W×C
        data = data.permute(0, 3, 1, 2)
    x = data.to(torch.float32).div_(255.0)
    x.sub_(torch.tensor(mean).view(1, -1, 1, 1)).div_(torch.tensor(std).view(1, -1, 1, 1))
    y = torch.as_tensor(np.asarray(ds.targets), dtype=torch.int64)
    return ArrayDataset(x.contiguous(), y, NUM_CLASSES[key], key)


# --------------------------------------------------------------------------- any dataset, as partitions see it


def known_labels(data: Any) -> np.ndarray | None:
    """Every label as int64 when the dataset knows its targets (no image decoded); else ``None``."""
    if isinstance(data, ArrayDataset):
        return data.labels_numpy()
    if isinstance(data, Subset):
        base = known_labels(data.dataset)
        return None if base is None else base[np.asarray(data.indices, dtype=np.int64)]
    if isinstance(data, TensorDataset) and len(data.tensors) == 2 and data.tensors[1].dim() == 1:
        return np.asarray(data.tensors[1].cpu(), dtype=np.int64)  # (inputs, labels), as returned by a reference
    targets = getattr(data, "targets", None)
    if targets is not None and len(targets) == len(data):
        return np.asarray(targets.cpu() if isinstance(targets, torch.Tensor) else targets, dtype=np.int64)
    return None


def labels_of(data: Any) -> np.ndarray:
    """Every label as int64: the dataset's targets, or (once) read item by item."""
    known = known_labels(data)
    if known is not None:
        return known
    return np.asarray([int(data[i][1]) for i in range(len(data))], dtype=np.int64)


def check_labels(data: Any, num_classes: int) -> None:
    """Labels the model cannot predict fail here, in words, instead of mid-training in cross-entropy; and a
    folder of named classes that lacks some, whose labels (numbered in sorted order) would silently shift."""
    named = _class_to_idx(data)
    if named and not all(name.isdigit() for name in named) and len(named) != num_classes:
        raise ValueError(
            f"the data has {len(named)} class folders ({', '.join(sorted(named))}) but the model has {num_classes} "
            "classes: named folders are numbered in sorted order, so every device needs the same class folders "
            f"(empty ones allowed), or folders named 0..{num_classes - 1}"
        )
    y = known_labels(data)
    if y is None or not len(y):
        return
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= num_classes:
        hint = (
            "an ImageFolder needs the same class folders on every device (empty ones allowed), or folders named "
            f"0..{num_classes - 1}"
            if named is not None
            else f"labels are the federation's class indices 0..{num_classes - 1}"
        )
        raise ValueError(f"the data has labels {low}..{high} but the model has {num_classes} classes: {hint}")


def _class_to_idx(data: Any) -> dict[str, int] | None:
    """An ImageFolder's class map under the subsets and fitting wrappers (``base``) around it."""
    while isinstance(data, Subset) or hasattr(data, "base"):
        data = data.dataset if isinstance(data, Subset) else data.base
    return getattr(data, "class_to_idx", None)


def num_classes_of(data: Any) -> int:
    """The number of classes the data names (an ImageFolder's folders), else the largest label + 1."""
    while isinstance(data, Subset):
        data = data.dataset
    if isinstance(data, ArrayDataset):
        return data.num_classes
    classes = getattr(data, "class_to_idx", None)
    if classes:
        return max(classes.values()) + 1
    classes = getattr(data, "classes", None)
    if classes:
        return len(classes)
    return int(labels_of(data).max()) + 1


def take(data: Any, indices: np.ndarray | Sequence[int]) -> Any:
    """The samples at ``indices``: an in-memory subset of an ArrayDataset, a lazy Subset of anything else."""
    if isinstance(data, ArrayDataset):
        return data.subset(indices)
    return Subset(data, np.asarray(indices, dtype=np.int64).tolist())


# --------------------------------------------------------------------------- partitions


def partition(
    labels: np.ndarray,
    num_clients: int,
    scheme: str,
    *,
    classes_per_client: int = 2,
    alpha: float = 0.5,
    seed: int = 0,
    min_size: int = 2,
) -> list[np.ndarray]:
    """Split sample indices among clients; returns one sorted int64 index array per client.

    - ``iid``: a seeded permutation cut into near-equal parts.
    - ``shards``: McMahan's ``(M, K′)`` rule with FedRep's guarantee that every client holds
      exactly ``K′ = classes_per_client`` *distinct* classes (see :func:`_shards`).
    - ``dirichlet``: per class, proportions ``~ Dir(alpha)`` over clients (Yurochkin et al.), with
      NIID-Bench's balancing; resampled until every client has at least ``min_size`` samples.

    Every sample lands in exactly one client under every scheme.
    """
    y = np.asarray(labels)
    if y.ndim != 1 or (y.size and not np.issubdtype(y.dtype, np.integer)):
        raise ValueError(f"labels must be a 1-d integer array, got {y.dtype} {y.shape}")
    if num_clients < 1:
        raise ValueError(f"num_clients must be ≥ 1, got {num_clients}")
    if num_clients > len(y):
        raise ValueError(f"cannot split {len(y)} samples among {num_clients} clients")
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = np.array_split(rng.permutation(len(y)), num_clients)
    elif scheme == "shards":
        parts = _shards(y, num_clients, classes_per_client, rng)
    elif scheme == "dirichlet":
        parts = _dirichlet(y, num_clients, alpha, min_size, rng)
    else:
        raise ValueError(f"unknown partition scheme {scheme!r}; known schemes: {', '.join(SCHEMES)}")
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _class_assignment(num_clients: int, k: int, classes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``num_clients × k`` class table: distinct classes per row, each class used ⌊M·K′/C⌋ or ⌈M·K′/C⌉ times.

    The slots ``0 .. M·K′-1`` are filled from consecutive seeded permutations of the classes, row by
    row. A row can straddle two permutations; then the next permutation starts with classes the row
    does not hold yet (possible because ``K′ ≤ C``), so no row repeats a class.
    """
    c = len(classes)
    slots: list[int] = []
    total = num_clients * k
    while len(slots) < total:
        held = slots[len(slots) - len(slots) % k :]  # classes already in the row being filled
        perm = list(rng.permutation(c))
        if held:
            fresh = [i for i in perm if i not in held]
            head = fresh[: k - len(held)]
            perm = head + [i for i in perm if i not in head]
        slots.extend(perm)
    return classes[np.asarray(slots[:total]).reshape(num_clients, k)]


def _shards(y: np.ndarray, num_clients: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """McMahan's shards with exactly ``k`` distinct classes per client.

    Classes are assigned per client by :func:`_class_assignment`; then each class's samples
    (shuffled) are cut into as many near-equal shards as clients it was assigned to. When
    ``M·K′`` is a multiple of the number of classes ``C`` every class goes to the same number of
    clients, so with balanced classes all shards have ``N/(M·K′)`` samples, as in the paper.
    Otherwise some classes go to one client more than others and their shards are smaller; every
    sample is still assigned, so client sizes always sum to ``N`` (sizes then differ slightly).
    """
    classes = np.unique(y)
    c = len(classes)
    if k < 1 or k > c:
        raise ValueError(f"classes_per_client must be between 1 and the number of classes ({c}), got {k}")
    if num_clients * k < c:
        raise ValueError(
            f"shards need num_clients × classes_per_client ≥ number of classes so every class is used: "
            f"{num_clients} × {k} < {c}"
        )
    table = _class_assignment(num_clients, k, classes, rng)
    owners: dict[int, list[int]] = {int(cl): [] for cl in classes}
    for client, row in enumerate(table):
        for cl in row:
            owners[int(cl)].append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for cl in classes:
        idx = rng.permutation(np.flatnonzero(y == cl))
        holders = owners[int(cl)]
        if len(idx) < len(holders):
            raise ValueError(f"class {cl} has {len(idx)} samples but must be shared among {len(holders)} clients")
        for client, shard in zip(holders, np.array_split(idx, len(holders)), strict=True):
            parts[client].append(shard)
    return [np.concatenate(p) for p in parts]


def _dirichlet(
    y: np.ndarray, num_clients: int, alpha: float, min_size: int, rng: np.random.Generator, max_tries: int = 1000
) -> list[np.ndarray]:
    if alpha <= 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
    n = len(y)
    if num_clients * min_size > n:
        raise ValueError(f"cannot give each of {num_clients} clients {min_size} samples out of {n}")
    by_class = [np.flatnonzero(y == cl) for cl in np.unique(y)]
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            # NIID-Bench balancing: a client that already holds its fair share gets no more.
            balanced = p * np.array([len(part) < n / num_clients for part in parts])
            p = balanced / balanced.sum() if balanced.sum() > 0 else p / p.sum()  # tiny alpha can underflow to 0
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for part, piece in zip(parts, np.split(idx, cuts), strict=True):
                part.extend(piece.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.asarray(p, dtype=np.int64) for p in parts]
    raise ValueError(
        f"dirichlet partition with alpha={alpha} left a client with fewer than {min_size} samples after "
        f"{max_tries} tries; use fewer clients, a larger alpha or a smaller min_size"
    )


def local_test_splits(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    client_indices: list[np.ndarray],
    *,
    seed: int = 0,
    samples_per_client: int | None = None,
) -> list[np.ndarray]:
    """For each client, test-set indices that follow its own training label distribution.

    Personalized accuracy must be measured on the classes a client actually sees, in the
    proportions it sees them (as FedRep does). Per class the client holds, the share of test
    samples is proportional to its training count (largest-remainder rounding, at least one
    per held class when the test set has one, never more than the test set has); classes it does
    not hold get none. Default size: ``len(train indices) // 4`` capped at what the test set holds
    for those classes. Draws are without replacement within a client; different clients may
    share test samples. Client ``i``'s split depends only on ``(seed, i)`` and its own indices.
    """
    train_y = np.asarray(train_labels)
    test_y = np.asarray(test_labels)
    pools = {int(cl): np.flatnonzero(test_y == cl) for cl in np.unique(test_y)}
    out: list[np.ndarray] = []
    for i, idx in enumerate(client_indices):
        rng = np.random.default_rng([seed, i])
        classes, counts = np.unique(train_y[np.asarray(idx, dtype=np.int64)], return_counts=True)
        avail = np.array([len(pools.get(int(cl), ())) for cl in classes], dtype=np.int64)
        quota = _quotas(counts, avail, len(idx) // 4 if samples_per_client is None else samples_per_client)
        picks = [rng.choice(pools[int(cl)], size=q, replace=False) for cl, q in zip(classes, quota, strict=True) if q]
        out.append(np.sort(np.concatenate(picks)) if picks else np.zeros(0, dtype=np.int64))
    return out


def _quotas(counts: np.ndarray, avail: np.ndarray, size: int) -> np.ndarray:
    """Split ``size`` over classes ∝ ``counts``: ≥ 1 per class with test samples, ≤ ``avail``."""
    floor = np.minimum(avail, 1)
    size = int(min(max(size, int(floor.sum())), int(avail.sum())))
    quota = floor.copy()
    while quota.sum() < size:
        room = avail - quota
        want = counts * size / counts.sum() - quota
        want[room <= 0] = -np.inf
        remaining = size - int(quota.sum())
        grow = np.clip(np.floor(want), 0, room).astype(np.int64)
        if grow.sum() == 0 or grow.sum() > remaining:  # hand out one at a time, largest shortfall first
            grow = np.zeros_like(quota)
            grow[int(np.argmax(want))] = 1
        quota += grow
    return quota
