"""Where a device's data comes from: ``--data PATH_OR_REF``.

Three kinds, tried in this order:

- a bundled benchmark name (``digits``, ``mnist``, …): :func:`fedcore.data.load_dataset`, in memory and
  already normalized, exactly as before;
- an ImageFolder directory (one subfolder per class, torchvision's layout). With ``train/`` (and
  ``test/`` or ``val/``) subfolders those are the splits; otherwise a seeded, per-class 20 % holdout
  (the same on every machine) is the test split. Class folders named by integers (``0``, ``1``, …)
  are those labels, so devices that lack a class still agree on the others; otherwise labels follow
  the sorted folder names, as
  in torchvision, and every device must then have every class folder (an empty one is fine);
- an import reference ``module:callable`` whose call returns ``(train, test)`` torch Datasets
  (``test`` may be ``None``). Items are ``(input, label)``: PIL images get fedatoms' default
  transforms (:mod:`fedcore.model_input`), tensors are used as the reference made them.

Nothing is decoded here: images are read one batch at a time when training iterates over them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset, Subset

from fedcore.data import DATASETS, check_labels, labels_of, load_dataset
from fedcore.model_input import Normalization, fit_to_model
from fedcore.reference import import_attribute

__all__ = ["HOLDOUT_FRACTION", "DataSourceError", "describe", "evaluation_set", "open_data"]

#: The share of each class held out as the test split of an ImageFolder without ``test/``.
HOLDOUT_FRACTION = 0.2
_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class DataSourceError(ValueError):
    """``--data`` names nothing usable: a missing folder, an unimportable reference, a wrong return value."""


def describe(text: str, label: str = "--data") -> str:
    """``bundled``, ``folder`` or ``reference``: what :func:`open_data` will read ``text`` as."""
    if text.lower() in DATASETS:
        return "bundled"
    if Path(text).expanduser().exists():
        return "folder"
    if _REFERENCE.match(text):
        return "reference"
    raise DataSourceError(
        f"{label} {text!r} is not a directory, not a bundled dataset ({', '.join(DATASETS)}) and not an import "
        "reference (module:function)"
    )


def open_data(
    text: str, data_dir: str | Path | None = None, *, download: bool = False, label: str = "--data"
) -> tuple[Dataset, Dataset | None]:
    """``(train, test)`` for ``--data text``; ``test`` is ``None`` when a reference returns none.

    Errors are :class:`DataSourceError` (a ``ValueError``) of one line that starts with ``label``.
    """
    kind = describe(text, label)
    if kind == "bundled":
        return load_dataset(text, data_dir, download=download)  # type: ignore[return-value]  # ArrayDataset is a Dataset
    try:
        if kind == "folder":
            return _open_folder(Path(text).expanduser())
        return _call_reference(text)
    except DataSourceError as exc:
        raise DataSourceError(f"{label} {exc}") from None


def evaluation_set(
    text: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    normalization: Normalization | None = None,
    data_dir: str | Path | None = None,
    *,
    input_dtype: str = "float32",
) -> Any:
    """The test split of ``text`` ready for the model: what the server (``eval_data``) evaluates after a round.

    Images are normalized with the federation's ``normalization``, else with this test split's own
    statistics (every party normalizes by its own data). A reference that returns no test set has none.
    Its labels are checked as a device's are, before the first round: a label past the model's classes
    would fail every close, and named class folders missing one would be numbered differently.
    """
    _, test = open_data(text, data_dir, label="eval_data")
    if test is None or len(test) == 0:  # type: ignore[arg-type]  # map-style datasets have a length
        raise DataSourceError(f"eval_data {text!r} has no test split to evaluate on")
    try:
        check_labels(test, num_classes)
        fitted, _, _ = fit_to_model(test, None, input_shape, normalization, first="evaluation", input_dtype=input_dtype)
    except ValueError as exc:
        raise DataSourceError(f"eval_data {text!r}: {exc}") from None
    return fitted


# --------------------------------------------------------------------------- ImageFolder


def _open_folder(root: Path) -> tuple[Dataset, Dataset]:
    if not root.is_dir():
        raise DataSourceError(f"{root}: not a directory (an ImageFolder has one subfolder per class)")
    if (root / "train").is_dir():
        train = _image_folder(root / "train")
        for name in ("test", "val"):
            if (root / name).is_dir():
                return train, _image_folder(root / name, train.class_to_idx)
        return _holdout(train)
    return _holdout(_image_folder(root))


def _image_folder(path: Path, class_to_idx: dict[str, int] | None = None) -> Any:
    from torchvision.datasets import ImageFolder

    classes = sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataSourceError(f"{path}: no class subfolders (an ImageFolder has one subfolder per class)")
    if class_to_idx is None:
        numbered = all(c.isdigit() for c in classes)
        class_to_idx = {c: int(c) for c in classes} if numbered else {c: i for i, c in enumerate(classes)}
    else:
        unknown = sorted(set(classes) - set(class_to_idx))
        if unknown and all(c.isdigit() for c in [*classes, *class_to_idx]):
            class_to_idx = {**class_to_idx, **{c: int(c) for c in unknown}}  # a number is its label
        elif unknown:
            raise DataSourceError(f"{path}: classes {unknown} are not in the training folder")

    try:
        folder = ImageFolder(str(path), loader=_load_image, allow_empty=True)
    except (FileNotFoundError, OSError) as exc:
        raise DataSourceError(f"{path}: {exc}") from None
    # torchvision numbers the folders it found in sorted order; relabel by the map above (a plain
    # ImageFolder still, so it pickles into DataLoader workers)
    # (hidden folders such as .ipynb_checkpoints hold no class: their files are left out)
    relabel = {folder.class_to_idx[c]: class_to_idx[c] for c in folder.classes if c in class_to_idx}
    folder.samples = [(f, relabel[t]) for f, t in folder.samples if t in relabel]
    folder.imgs = folder.samples
    folder.targets = [t for _, t in folder.samples]
    folder.class_to_idx = dict(class_to_idx)
    folder.classes = sorted(class_to_idx, key=class_to_idx.__getitem__)
    if len(folder) == 0:
        raise DataSourceError(f"{path}: no images (.png, .jpg, …) in its class subfolders")
    return folder


def _load_image(path: str) -> Any:
    """torchvision's loader; a file it cannot read (truncated, corrupt, not an image) is the data's error, named."""
    from torchvision.datasets.folder import default_loader

    try:
        return default_loader(path)
    except (OSError, SyntaxError, ValueError) as exc:  # PIL's UnidentifiedImageError and truncation are OSErrors
        raise DataSourceError(f"{path}: cannot read this image ({exc}); fix or remove it") from None


def _holdout(data: Any) -> tuple[Dataset, Dataset]:
    """A per-class split, the same everywhere (seed 0): ``round(HOLDOUT_FRACTION · n_c)`` of each class's
    images, drawn at random, are the test split; so a client, a simulation and the server agree on it."""
    y = labels_of(data)
    rng = np.random.default_rng(0)
    test: list[np.ndarray] = []
    for cl in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == cl))
        test.append(idx[: round(HOLDOUT_FRACTION * len(idx))])
    held = np.sort(np.concatenate(test)) if test else np.zeros(0, dtype=np.int64)
    kept = np.setdiff1d(np.arange(len(y)), held)
    return Subset(data, kept.tolist()), Subset(data, held.tolist())


# --------------------------------------------------------------------------- import references


def _call_reference(text: str) -> tuple[Dataset, Dataset | None]:
    module_name, _, attr = text.partition(":")
    try:
        target = import_attribute(module_name, attr, text)
    except ValueError as exc:
        raise DataSourceError(str(exc)) from None
    if not callable(target):
        raise DataSourceError(f"{text}: {attr!r} is not callable (it should return (train, test) Datasets)")
    try:
        result = target()
    except Exception as exc:
        raise DataSourceError(f"{text}: the call failed ({type(exc).__name__}: {exc})") from None
    if not isinstance(result, tuple | list) or len(result) != 2:
        raise DataSourceError(f"{text}: returned {type(result).__name__}, not a (train, test) pair")
    train, test = result
    for name, ds in (("train", train), ("test", test)):
        if ds is None and name == "test":
            continue
        if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise DataSourceError(
                f"{text}: {name} is a {type(ds).__name__}, not a map-style Dataset (__getitem__ and __len__)"
            )
    if len(train) == 0:
        raise DataSourceError(f"{text}: the training set is empty")
    return train, test
