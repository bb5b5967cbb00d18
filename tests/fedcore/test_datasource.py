"""`--data` read as a user means it: ImageFolders (splits, labels), references, and images fitted to the model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from image_folders import digits_images, write_folder
from PIL import Image

from fedcore.data import ArrayDataset, labels_of
from fedcore.datasource import HOLDOUT_FRACTION, DataSourceError, open_data
from fedcore.model_input import Normalization, channel_stats, fit_to_model
from fedcore.spec import ModelSpec
from fedcore.training import TrainConfig, local_update


@pytest.fixture(scope="module")
def rgb_folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("rgb"), channels=3, size=13, count=300)


def test_plain_folder_holds_out_a_fifth_of_every_class(rgb_folder: Path) -> None:
    train, test = open_data(str(rgb_folder))
    _, labels = digits_images(1, 8)
    y = labels[:300]
    assert len(train) + len(test) == 300
    yt, ys = labels_of(train), labels_of(test)
    for cl in range(10):
        n = int((y == cl).sum())
        assert int((ys == cl).sum()) == round(HOLDOUT_FRACTION * n)  # the rule, per class
        assert int((yt == cl).sum()) == n - round(HOLDOUT_FRACTION * n)
    assert not set(train.indices) & set(test.indices)
    again_train, _ = open_data(str(rgb_folder))
    assert again_train.indices == train.indices  # the same on every machine


def test_numbered_class_folders_are_their_labels_even_when_a_class_is_missing(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "d", channels=1, size=8, count=200)
    for png in (root / "3").iterdir():
        png.unlink()
    (root / "3").rmdir()
    train, test = open_data(str(root))
    _, labels = digits_images(1, 8)
    kept = labels[:200][labels[:200] != 3]
    assert sorted(np.concatenate([labels_of(train), labels_of(test)]).tolist()) == sorted(kept.tolist())
    img, label = train[0]
    assert isinstance(img, Image.Image) and label in set(kept.tolist())


def test_hidden_folders_are_no_class(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "d", channels=1, size=8, count=50)
    (root / ".ipynb_checkpoints").mkdir()
    Image.new("L", (8, 8)).save(root / ".ipynb_checkpoints" / "x.png")
    train, test = open_data(str(root))
    assert len(train) + len(test) == 50


def test_named_classes_follow_sorted_names_and_train_test_layout(tmp_path: Path) -> None:
    write_folder(tmp_path / "d" / "train", channels=1, size=8, count=100, classes="named")
    write_folder(tmp_path / "d" / "val", channels=1, size=8, count=40, start=100, classes="named")
    train, test = open_data(str(tmp_path / "d"))
    assert len(train) == 100 and len(test) == 40
    _, labels = digits_images(1, 8)
    assert labels_of(train).tolist() == sorted(labels[:100].tolist())  # digit-0 … digit-9 sort as 0 … 9
    assert train.classes == [f"digit-{i}" for i in range(10)]


def test_channel_stats_match_numpy_over_pil_resized_images(rgb_folder: Path) -> None:
    train, _ = open_data(str(rgb_folder))
    # independent oracle: PIL converts and resizes, numpy averages every pixel of every image at once
    for channels, mode in ((1, "L"), (3, "RGB")):
        arrays = []
        for i in range(len(train)):
            img, _ = train[i]
            arrays.append(np.asarray(img.convert(mode).resize((10, 7), Image.Resampling.BILINEAR), dtype=np.float64))
        x = np.stack(arrays) / 255.0
        x = x.reshape(len(arrays), 7, 10, channels)
        got = channel_stats(train, (channels, 7, 10), batch_size=17)
        np.testing.assert_allclose(got.mean, x.mean(axis=(0, 1, 2)), atol=1e-6)
        np.testing.assert_allclose(got.std, x.std(axis=(0, 1, 2)), atol=1e-6)


def test_fitted_images_have_the_model_input_and_the_given_normalization(rgb_folder: Path) -> None:
    train, test = open_data(str(rgb_folder))
    norm = Normalization((0.25,), (0.5,))
    _, ftest, used = fit_to_model(train, test, (1, 8, 8), norm)
    assert used == norm
    x, y = ftest[3]
    img, label = test[3]
    expected = np.asarray(img.convert("L").resize((8, 8), Image.Resampling.BILINEAR), dtype=np.float32) / 255.0
    assert x.shape == (1, 8, 8) and y == label
    np.testing.assert_allclose(x.numpy()[0], (expected - 0.25) / 0.5, atol=1e-6)


def test_streamed_training_equals_in_memory_training() -> None:
    """The DataLoader path visits the samples in the in-memory path's seeded order: bit-identical tensors."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(57, 1, 8, 8, generator=g), torch.randint(0, 10, (57,), generator=g)

    class Plain(torch.utils.data.Dataset):  # no .x/.y: streamed
        def __len__(self) -> int:
            return len(y)

        def __getitem__(self, i: int):
            return x[i], int(y[i])

    spec = ModelSpec("digits-cnn", 10, "atoms")
    config = TrainConfig(local_epochs=2, batch_size=10, lr=0.05, device="cpu")
    results = []
    for data in (ArrayDataset(x, y, 10, "t"), Plain()):
        model = spec.initial_model(seed=3)
        results.append(local_update(model, data, config, seed=11))
    a, b = results
    assert a.num_samples == b.num_samples == 57
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name]), name
    assert a.metrics["train_loss"] == b.metrics["train_loss"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("/no/such/dir", "is not a directory, not a bundled dataset"),
        ("no_such_module_xyz:load", "cannot import 'no_such_module_xyz'"),
        ("json:no_such_function", "module 'json' has no attribute 'no_such_function'"),
        ("json:__doc__", "is not callable"),
        ("json:dumps", "the call failed"),
        ("os:getcwd", "not a (train, test) pair"),
    ],
)
def test_bad_data_is_one_clear_line(text: str, needle: str) -> None:
    with pytest.raises(DataSourceError) as info:
        open_data(text)
    message = str(info.value)
    assert needle in message and message.startswith("--data") and "\n" not in message


def test_a_folder_without_images_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cats").mkdir()
    with pytest.raises(DataSourceError, match="no images"):
        open_data(str(tmp_path))
    with pytest.raises(DataSourceError, match="no class subfolders"):
        open_data(str(tmp_path / "cats"))


def test_a_numbered_class_only_in_the_test_folder_keeps_its_number(tmp_path: Path) -> None:
    """Numbered folders are their labels: a test split holding a class training lacks agrees with every device."""
    write_folder(tmp_path / "d" / "train", channels=1, size=8, count=120)
    write_folder(tmp_path / "d" / "test", channels=1, size=8, count=60, start=120)
    for png in (tmp_path / "d" / "train" / "7").iterdir():
        png.unlink()
    (tmp_path / "d" / "train" / "7").rmdir()
    train, test = open_data(str(tmp_path / "d"))
    _, labels = digits_images(1, 8)
    assert 7 not in labels_of(train).tolist()
    assert sorted(labels_of(test).tolist()) == sorted(labels[120:180].tolist())  # 7 among them, as 7
    (tmp_path / "d" / "test" / "cats").mkdir()  # a named class the training folder lacks: no number to go by
    Image.new("L", (8, 8)).save(tmp_path / "d" / "test" / "cats" / "x.png")
    with pytest.raises(DataSourceError, match=r"classes \['7', 'cats'\] are not in the training folder"):
        open_data(str(tmp_path / "d"))


def test_evaluation_data_the_model_cannot_score_is_refused_before_any_round(tmp_path: Path) -> None:
    """The server's ``eval_data``, checked as a device's data is: a label past the model's classes failed every
    close (IndexError in cross-entropy); named folders lacking a class were numbered differently, and the
    server's accuracy was wrong, silently."""
    from fedcore.datasource import evaluation_set

    numbered = write_folder(tmp_path / "numbered", channels=1, size=8, count=100)
    assert len(evaluation_set(str(numbered), (1, 8, 8), 10)) == 20  # the holdout of every class
    with pytest.raises(DataSourceError, match=r"eval_data '.*numbered': the data has labels 0..9 but the model has 5"):
        evaluation_set(str(numbered), (1, 8, 8), 5)
    named = write_folder(tmp_path / "named", channels=1, size=8, count=100, classes="named")
    for png in (named / "digit-4").iterdir():
        png.unlink()
    (named / "digit-4").rmdir()
    with pytest.raises(DataSourceError, match=r"the data has 9 class folders \(digit-0, .*\) but the model has 10"):
        evaluation_set(str(named), (1, 8, 8), 10)


class _Items(torch.utils.data.Dataset):
    def __init__(self, make) -> None:
        self.make = make

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return self.make(i)


@pytest.mark.parametrize(
    ("item", "said"),
    [
        (lambda i: {"image": torch.zeros(1, 8, 8), "label": 0}, r"dataset items are dict, not \(image, label\) pairs"),
        (lambda i: (torch.zeros(1, 8, 8, dtype=torch.uint8), 0), "the training inputs are torch.uint8 tensors"),
        (lambda i: (torch.zeros(3, 8, 8), 0), r"inputs have shape \(3, 8, 8\) but the model takes \(1, 8, 8\)"),
    ],
    ids=["dicts", "uint8", "shape"],
)
def test_items_the_model_cannot_take_are_refused_in_one_line(item, said: str) -> None:
    with pytest.raises(ValueError, match=said) as refused:
        fit_to_model(_Items(item), None, (1, 8, 8), Normalization((0.0,), (1.0,)))
    assert "\n" not in str(refused.value)


def test_a_benchmark_dataset_of_another_shape_is_named(tmp_path: Path) -> None:
    train, _ = open_data("digits")
    with pytest.raises(ValueError, match=r"the digits dataset's images do not fit this federation's model"):
        fit_to_model(train, None, (3, 32, 32), None)


def test_evaluation_data_of_another_shape_is_named_as_such(tmp_path: Path) -> None:
    from fedcore.datasource import evaluation_set

    with pytest.raises(DataSourceError, match=r"eval_data 'digits': the evaluation inputs have shape \(1, 8, 8\)"):
        evaluation_set("digits", (3, 32, 32), 10)
