"""Images as the model takes them: fedatoms' default transforms for a device's own pictures.

An image (PIL) becomes the model's input ``(C, H, W)`` (:attr:`fedcore.spec.ModelSpec.input_shape`):
converted to ``C`` channels (``L`` for 1, ``RGB`` for 3), resized to ``H × W``, turned into a
float tensor in ``[0, 1]`` and normalized per channel. The normalization is the federation's
when it sets one (``normalization = {mean = […], std = […]}``), else the mean and standard
deviation of this party's own training images, computed by streaming over them once
(:func:`channel_stats`: float64 sums, never the whole set in memory).

Datasets whose items are already tensors (bundled benchmarks, a reference that applies its own
transforms) are used as they are; only their shape and dtype are checked against the model. A model of
integer inputs (``input_dtype`` ``int64``/``int32``: token ids for an ``nn.Embedding``) takes tensors of
integers as they are: no images, no normalization.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from fedcore.data import ArrayDataset, known_labels

__all__ = [
    "FittedImages",
    "Normalization",
    "channel_stats",
    "check_input_dtype",
    "fit_to_model",
    "image_transform",
    "needs_fitting",
]


@dataclass(frozen=True)
class Normalization:
    """Per-channel ``(x − mean) / std`` of the model's input."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.mean or len(self.mean) != len(self.std):
            raise ValueError(f"normalization needs mean and std of equal, non-zero length, got {self.mean} {self.std}")
        if not all(s > 0 for s in self.std):
            raise ValueError(f"normalization std must be > 0 per channel, got {list(self.std)}")

    @classmethod
    def from_dict(cls, value: dict[str, Sequence[float]]) -> Normalization:
        unknown = set(value) - {"mean", "std"}
        if unknown or not {"mean", "std"} <= set(value):
            raise ValueError(f"normalization takes exactly the keys mean and std, got {sorted(value)}")
        return cls(tuple(float(v) for v in value["mean"]), tuple(float(v) for v in value["std"]))

    def to_dict(self) -> dict[str, list[float]]:
        return {"mean": list(self.mean), "std": list(self.std)}


class _Channels:
    """A PIL image in ``L`` (1 channel) or ``RGB`` (3 channels)."""

    def __init__(self, channels: int) -> None:
        if channels not in (1, 3):
            raise ValueError(f"images can be fitted to a model of 1 or 3 input channels, not {channels}")
        self.mode = "L" if channels == 1 else "RGB"

    def __call__(self, image: Any) -> Any:
        return image if image.mode == self.mode else image.convert(self.mode)


def image_transform(input_shape: Sequence[int], normalization: Normalization | None) -> Any:
    """The default transform: channels, resize to ``H × W``, ToTensor, then ``normalization`` (if any)."""
    from torchvision import transforms as T

    c, h, w = (int(v) for v in input_shape)
    steps: list[Any] = [_Channels(c), T.Resize((h, w), antialias=True), T.ToTensor()]
    if normalization is not None:
        if len(normalization.mean) != c:
            raise ValueError(f"normalization has {len(normalization.mean)} channels, the model takes {c}")
        steps.append(T.Normalize(normalization.mean, normalization.std))
    return T.Compose(steps)


class FittedImages(Dataset):
    """``(transform(image), label)`` of a dataset of PIL images, decoded one item at a time."""

    def __init__(self, base: Any, transform: Any) -> None:
        self.base = base
        self.transform = transform

    def __len__(self) -> int:
        return len(self.base)

    @property
    def targets(self) -> Any:
        """The base's labels when it knows them without decoding (what partitions and checks read)."""
        return known_labels(self.base)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        image, label = self.base[index]
        return self.transform(image), int(label)


def needs_fitting(data: Any) -> bool:
    """True when the items are images (PIL) for the default transforms; False for tensors used as they are."""
    if data is None or isinstance(data, ArrayDataset | FittedImages):
        return False
    from PIL import Image

    first = data[0]
    if not (isinstance(first, tuple | list) and len(first) == 2):
        raise ValueError(
            f"dataset items are {type(first).__name__}, not (image, label) pairs: a dataset's __getitem__ returns "
            "the image (PIL or tensor) and its integer label, as torchvision's datasets do"
        )
    item = first[0]
    if isinstance(item, Image.Image):
        return True
    if isinstance(item, Tensor):
        return False
    raise ValueError(
        f"dataset items are {type(item).__name__}: give PIL images (fedatoms resizes and normalizes them) "
        "or tensors of the model's input shape (your own transforms)"
    )


def channel_stats(data: Any, input_shape: Sequence[int], *, batch_size: int = 256) -> Normalization:
    """Per-channel mean and (population) std of ``data``'s images as the model sees them, in one streamed pass."""
    loader = DataLoader(FittedImages(data, image_transform(input_shape, None)), batch_size=batch_size)
    c = int(input_shape[0])
    total = torch.zeros(c, dtype=torch.float64)
    squares = torch.zeros(c, dtype=torch.float64)
    count = 0
    for xb, _ in loader:
        x = xb.to(torch.float64).transpose(0, 1).reshape(c, -1)
        total += x.sum(dim=1)
        squares += (x * x).sum(dim=1)
        count += x.shape[1]
    if count == 0:
        raise ValueError("cannot compute a normalization from an empty dataset")
    mean = total / count
    var = (squares / count - mean * mean).clamp_min(0.0)
    # a constant channel (all-black images) would divide by zero: leave its scale alone
    std = torch.where(var > 0, var.sqrt(), torch.ones_like(var))
    return Normalization(tuple(mean.tolist()), tuple(std.tolist()))


#: The integer dtypes a model of integer ``input_dtype`` accepts as its inputs (what ``nn.Embedding`` looks up).
_ID_DTYPES = (torch.int64, torch.int32)


def _check_ready(name: str, data: Any, input_shape: Sequence[int], input_dtype: str = "float32") -> None:
    x = data.x[0] if isinstance(data, ArrayDataset) else data[0][0]
    if tuple(x.shape) != tuple(input_shape):
        hint = (
            f"the {data.name} dataset's images do not fit this federation's model; train on data shaped for it"
            if isinstance(data, ArrayDataset)
            else "return PIL images to have fedatoms resize them, or transform to the model's input shape"
            if input_dtype == "float32"
            else "give every sample the model's input shape (e.g. token ids padded or cut to one length)"
        )
        raise ValueError(
            f"the {name} inputs have shape {tuple(x.shape)} but the model takes {tuple(input_shape)}: {hint}"
        )
    check_input_dtype(name, x.dtype, input_dtype)


def check_input_dtype(name: str, dtype: torch.dtype, input_dtype: str) -> None:
    """Refuse, in words, inputs of ``dtype`` for a model whose ``ModelSpec.input_dtype`` is ``input_dtype``: a
    float model takes floating-point inputs, an integer one (token ids for an ``nn.Embedding``) int64 or int32."""
    if input_dtype == "float32":
        if dtype.is_floating_point:
            return
        if dtype in _ID_DTYPES:
            raise ValueError(
                f"the {name} inputs are {dtype} tensors but the model takes floating-point inputs (input_dtype = "
                f'"float32"): for token ids set input_dtype = "{str(dtype).removeprefix("torch.")}" (a federation '
                "file's [federation], --input-dtype for simulate); for images, torchvision's ToTensor scales uint8 "
                "to [0, 1], or return PIL images to have fedatoms convert them"
            )
        raise ValueError(
            f"the {name} inputs are {dtype} tensors: the model takes floating-point inputs (input_dtype = "
            '"float32"; torchvision\'s ToTensor scales uint8 images to [0, 1]), or return PIL images to have '
            "fedatoms convert them"
        )
    if dtype not in _ID_DTYPES:
        raise ValueError(
            f"the {name} inputs are {dtype} tensors but the model takes integer inputs (input_dtype = "
            f'"{input_dtype}"): give token ids as int64 (or int32) tensors (e.g. torch.tensor(ids, dtype=torch.long)),'
            ' or set input_dtype = "float32" for a model of floating-point inputs'
        )


def fit_to_model(
    train: Any,
    test: Any,
    input_shape: Sequence[int],
    normalization: Normalization | None = None,
    *,
    first: str = "training",
    input_dtype: str = "float32",
) -> tuple[Any, Any, Normalization | None]:
    """``(train, test, normalization used)`` ready for the model; image datasets get the default transforms.

    ``normalization`` ``None``: computed from ``train`` (:func:`channel_stats`); datasets of tensors are
    returned as they are (the normalization used is then ``None``: theirs, unknown to fedatoms). ``first``
    names ``train`` in errors (the server's evaluation set is fitted alone, as ``train``). ``input_dtype`` is
    the model's (:attr:`fedcore.spec.ModelSpec.input_dtype`): an integer model (token ids) takes tensors of
    integers as they are, never images and never a normalization.
    """
    integer = input_dtype != "float32"
    if integer and normalization is not None:
        raise ValueError(
            f"a normalization (mean/std per channel) applies to images; the model takes {input_dtype} inputs "
            f'(input_dtype = "{input_dtype}", token ids), which are never normalized: leave normalization unset'
        )
    if not needs_fitting(train):
        for name, ds in ((first, train), ("test", test)):
            if ds is not None and len(ds):
                if needs_fitting(ds):
                    raise ValueError("the training set gives tensors but the test set gives images: give both alike")
                _check_ready(name, ds, input_shape, input_dtype)
        return train, test, None
    if integer:
        raise ValueError(
            f'the {first} set gives images but the model takes {input_dtype} inputs (input_dtype = "{input_dtype}", '
            "token ids): give tensors of integer ids of the model's input shape, or a float32 model for images"
        )
    if test is not None and len(test) and not needs_fitting(test):
        raise ValueError("the training set gives images but the test set gives tensors: give both alike")
    used = normalization if normalization is not None else channel_stats(train, input_shape)
    transform = image_transform(input_shape, used)
    return FittedImages(train, transform), None if test is None else FittedImages(test, transform), used
