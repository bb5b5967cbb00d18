from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.data import (
    DATASETS,
    NUM_CLASSES,
    SCHEMES,
    ArrayDataset,
    DatasetNotFoundError,
    load_dataset,
    local_test_splits,
    partition,
)


@pytest.fixture(scope="module")
def digits() -> tuple[ArrayDataset, ArrayDataset]:
    return load_dataset("digits")


def _synthetic(n: int = 50000, classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(n) % classes).astype(np.int64)


def _classes(labels: np.ndarray, parts: list[np.ndarray]) -> list[set[int]]:
    return [set(np.unique(labels[p]).tolist()) for p in parts]


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    assert sum(len(p) for p in parts) == n
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == n and allidx.min() == 0 and allidx.max() == n - 1
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0)  # sorted, no repeats


# ----------------------------------------------------------------------------- datasets


def test_digits_shapes_and_normalization(digits: tuple[ArrayDataset, ArrayDataset]) -> None:
    train, test = digits
    assert (len(train), len(test)) == (1437, 360)
    assert train.x.shape == (1437, 1, 8, 8) and train.x.dtype == torch.float32
    assert test.x.shape == (360, 1, 8, 8) and test.y.dtype == torch.int64
    assert train.num_classes == test.num_classes == NUM_CLASSES["digits"] == 10
    assert train.name == "digits"
    assert abs(float(train.x.mean())) < 1e-4 and abs(float(train.x.std()) - 1) < 1e-3
    assert abs(float(test.x.mean())) < 0.1  # standardized with the *train* statistics


def test_digits_split_is_fixed_and_stratified(digits: tuple[ArrayDataset, ArrayDataset]) -> None:
    train, test = digits
    train2, test2 = load_dataset("digits")
    assert torch.equal(train.x, train2.x) and torch.equal(test.y, test2.y)
    tr = np.bincount(train.labels_numpy(), minlength=10) / len(train)
    te = np.bincount(test.labels_numpy(), minlength=10) / len(test)
    assert np.abs(tr - te).max() < 0.01


def test_array_dataset_subset_and_labels(digits: tuple[ArrayDataset, ArrayDataset]) -> None:
    train, _ = digits
    sub = train.subset(np.array([5, 0, 7]))
    assert len(sub) == 3 and sub.name == "digits" and sub.num_classes == 10
    assert torch.equal(sub.x[1], train.x[0]) and int(sub.y[2]) == int(train.y[7])
    labels = train.labels_numpy()
    labels[:] = -1  # a copy: the dataset is untouched
    assert int(train.y.min()) >= 0
    assert len(train.subset(np.zeros(0, dtype=np.int64))) == 0
    with pytest.raises(ValueError):
        ArrayDataset(torch.zeros(2, 8, 8), torch.zeros(2, dtype=torch.int64), 10, "bad")


@pytest.mark.parametrize("name", [n for n in DATASETS if n != "digits"])
def test_missing_torchvision_data_raises(name: str, tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as exc:
        load_dataset(name, data_dir=tmp_path, download=False)
    msg = str(exc.value)
    assert name in msg and str(tmp_path) in msg and "--data-dir" in msg and "download" in msg
    assert isinstance(exc.value, FileNotFoundError)
    assert not any(tmp_path.iterdir())  # nothing was downloaded or created


def test_incomplete_torchvision_folder_raises(tmp_path: Path) -> None:
    (tmp_path / "MNIST" / "raw").mkdir(parents=True)  # the folder is there, the files are not
    with pytest.raises(DatasetNotFoundError, match="'mnist' not found"):
        load_dataset("mnist", data_dir=tmp_path)


def _write_idx(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">I", 0x0800 | array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_mnist_format_files_are_converted_once(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    raw = tmp_path / "MNIST" / "raw"
    images = {p: rng.integers(0, 256, size=(n, 28, 28)) for p, n in (("train", 6), ("t10k", 4))}
    labels = {p: rng.integers(0, 10, size=len(images[p])) for p in images}
    for p in images:
        _write_idx(raw / f"{p}-images-idx3-ubyte", images[p])
        _write_idx(raw / f"{p}-labels-idx1-ubyte", labels[p])
    train, test = load_dataset("mnist", data_dir=tmp_path)
    assert train.x.shape == (6, 1, 28, 28) and test.x.shape == (4, 1, 28, 28)
    assert train.x.dtype == torch.float32 and train.y.dtype == torch.int64
    expected = (images["train"][:, None] / 255.0 - 0.1307) / 0.3081
    np.testing.assert_allclose(train.x.numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(test.labels_numpy(), labels["t10k"])
    assert train.name == "mnist" and train.num_classes == 10


def test_unknown_dataset_lists_known_names() -> None:
    with pytest.raises(ValueError, match="unknown dataset 'svhn'") as exc:
        load_dataset("svhn")
    assert all(n in str(exc.value) for n in DATASETS)


# ----------------------------------------------------------------------------- partitions


@pytest.mark.parametrize(("num_clients", "k", "n"), [(100, 2, 50000), (100, 5, 50000), (7, 3, 1000), (30, 4, 999)])
def test_shards_every_client_holds_exactly_k_classes(num_clients: int, k: int, n: int) -> None:
    y = _synthetic(n)
    parts = partition(y, num_clients, "shards", classes_per_client=k, seed=1)
    assert len(parts) == num_clients
    assert all(len(c) == k for c in _classes(y, parts))
    _assert_exact_cover(parts, n)
    if (num_clients * k) % 10 == 0 and n % (num_clients * k) == 0:
        assert {len(p) for p in parts} == {n // num_clients}  # McMahan's equal shards
        usage = np.bincount([c for cs in _classes(y, parts) for c in cs], minlength=10)
        assert set(usage.tolist()) == {num_clients * k // 10}


def test_shards_on_digits(digits: tuple[ArrayDataset, ArrayDataset]) -> None:
    y = digits[0].labels_numpy()
    parts = partition(y, 20, "shards", classes_per_client=2, seed=0)
    assert all(len(c) == 2 for c in _classes(y, parts))
    _assert_exact_cover(parts, len(y))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 0.1 * len(y) / 20  # ~N/20; digits' classes differ in size by a few samples


def test_shards_class_sets_vary() -> None:
    y = _synthetic(5000)
    sets = {frozenset(c) for c in _classes(y, partition(y, 100, "shards", classes_per_client=2, seed=0))}
    assert len(sets) > 10  # not the same few pairs over and over


def test_shards_requirements() -> None:
    y = _synthetic(1000)
    with pytest.raises(ValueError, match="num_clients × classes_per_client"):
        partition(y, 4, "shards", classes_per_client=2)
    with pytest.raises(ValueError, match="classes_per_client"):
        partition(y, 20, "shards", classes_per_client=11)
    with pytest.raises(ValueError, match="samples but must be shared"):
        partition(np.array([0, 0, 0, 0, 1]), 4, "shards", classes_per_client=1)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_exact_cover_and_determinism(scheme: str) -> None:
    y = _synthetic(3001, seed=3)
    kw = {"classes_per_client": 3, "alpha": 0.3}
    a = partition(y, 17, scheme, seed=5, **kw)  # type: ignore[arg-type]
    b = partition(y, 17, scheme, seed=5, **kw)  # type: ignore[arg-type]
    c = partition(y, 17, scheme, seed=6, **kw)  # type: ignore[arg-type]
    _assert_exact_cover(a, len(y))
    _assert_exact_cover(c, len(y))
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c, strict=True))


def test_iid_sizes_near_equal() -> None:
    parts = partition(_synthetic(1003), 10, "iid")
    assert {len(p) for p in parts} == {100, 101}


def _mean_tv_from_uniform(y: np.ndarray, parts: list[np.ndarray]) -> float:
    dists = [np.bincount(y[p], minlength=10) / len(p) for p in parts]
    return float(np.mean([0.5 * np.abs(d - 0.1).sum() for d in dists]))


def test_dirichlet_alpha_controls_skew() -> None:
    y = _synthetic(20000)
    skewed = _mean_tv_from_uniform(y, partition(y, 20, "dirichlet", alpha=0.1, seed=0))
    mild = _mean_tv_from_uniform(y, partition(y, 20, "dirichlet", alpha=1.0, seed=0))
    uniform = _mean_tv_from_uniform(y, partition(y, 20, "dirichlet", alpha=1000.0, seed=0))
    assert skewed > 0.5 > mild > uniform
    assert uniform < 0.05


def test_dirichlet_min_size_and_failure() -> None:
    y = _synthetic(400)
    parts = partition(y, 20, "dirichlet", alpha=0.1, seed=0, min_size=5)
    assert min(len(p) for p in parts) >= 5
    _assert_exact_cover(parts, 400)
    with pytest.raises(ValueError, match="fewer than 2 samples after"):
        partition(_synthetic(60, classes=2), 30, "dirichlet", alpha=0.01, min_size=2)
    with pytest.raises(ValueError, match="alpha"):
        partition(y, 4, "dirichlet", alpha=0.0)


def test_partition_argument_errors() -> None:
    y = _synthetic(100)
    with pytest.raises(ValueError, match="unknown partition scheme 'pathological'"):
        partition(y, 4, "pathological")
    with pytest.raises(ValueError, match="num_clients"):
        partition(y, 0, "iid")
    with pytest.raises(ValueError, match="cannot split"):
        partition(y, 101, "iid")
    with pytest.raises(ValueError, match="1-d integer"):
        partition(y.astype(float), 4, "iid")


# ----------------------------------------------------------------------------- local test splits


def test_local_test_splits_follow_client_classes(digits: tuple[ArrayDataset, ArrayDataset]) -> None:
    train, test = digits
    ytr, yte = train.labels_numpy(), test.labels_numpy()
    parts = partition(ytr, 20, "shards", classes_per_client=2, seed=0)
    splits = local_test_splits(ytr, yte, parts, seed=0)
    again = local_test_splits(ytr, yte, parts, seed=0)
    other = local_test_splits(ytr, yte, parts, seed=1)
    assert all(np.array_equal(s, t) for s, t in zip(splits, again, strict=True))
    assert not all(np.array_equal(s, t) for s, t in zip(splits, other, strict=True))
    for p, s in zip(parts, splits, strict=True):
        held = set(np.unique(ytr[p]).tolist())
        got = set(np.unique(yte[s]).tolist())
        assert got == held  # only its classes, and every one of them
        assert len(s) == len(p) // 4 and len(np.unique(s)) == len(s) and np.all(np.diff(s) > 0)


def test_local_test_splits_proportional_sizes() -> None:
    ytr = np.array([0] * 300 + [1] * 100 + [2] * 50, dtype=np.int64)
    yte = np.array([0] * 100 + [1] * 100 + [2] * 5 + [3] * 100, dtype=np.int64)
    client = [np.arange(400), np.arange(300, 450)]
    first, second = local_test_splits(ytr, yte, client, samples_per_client=40)
    assert np.bincount(yte[first], minlength=4).tolist() == [30, 10, 0, 0]
    # class 2 has only 5 test samples: capped there, the rest goes to class 1
    assert np.bincount(yte[second], minlength=4).tolist() == [0, 35, 5, 0]
    tiny = local_test_splits(ytr, yte, [np.array([0, 1, 2, 300, 400])], samples_per_client=1)[0]
    assert sorted(np.unique(yte[tiny]).tolist()) == [0, 1, 2]  # at least one per held class
    assert len(local_test_splits(ytr, yte, [np.zeros(0, dtype=np.int64)])[0]) == 0


def test_digits_normalization_is_its_training_splits_own() -> None:
    """The constant the loader and the model file use, recomputed from sklearn's images: the stratified 80 %
    training split (random_state 0), pixels / 16."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from fedcore.data import benchmark_normalization

    bunch = load_digits()
    x = np.asarray(bunch.images, dtype=np.float32) / 16.0
    train_idx, _ = train_test_split(np.arange(len(bunch.target)), test_size=0.2, stratify=bunch.target, random_state=0)
    assert benchmark_normalization("digits") == ((float(x[train_idx].mean()),), (float(x[train_idx].std()),))
