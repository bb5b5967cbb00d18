"""`fedatoms predict`: classify images with a model file the aggregator exported."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "load_image"]


def load_image(path: Path, input_shape: tuple[int, ...], normalization: dict[str, Any] | None) -> Any:
    """One image as the model's input, through the same transform a client's images take (channels,
    resize to H×W, [0, 1], the federation's normalization if the file carries one)."""
    from PIL import Image, UnidentifiedImageError

    from fedcore.model_input import Normalization, image_transform

    given = None if normalization is None else Normalization.from_dict(normalization)
    try:
        with Image.open(path) as image:
            image.load()
            return image_transform(input_shape, given)(image)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except (OSError, UnidentifiedImageError) as exc:
        raise ValueError(f"{path}: not an image ({exc})") from None


def cmd_predict(args: argparse.Namespace) -> int:
    import torch

    from client_agent.allowed_models import DEFAULT_ALLOWED_MODELS, check_reference
    from fedcore.model_file import read_model_file

    file = read_model_file(args.model)
    spec = file.spec
    if spec.integer_inputs:
        raise ValueError(
            f"{args.model}: the model takes {spec.input_dtype} inputs (token ids, input_dtype), not images: "
            "fedatoms predict classifies images; load the model file's plain model in Python to run it on ids"
        )
    if len(spec.input_shape) != 3:
        raise ValueError(f"{args.model}: the model takes inputs {list(spec.input_shape)}, not images (C, H, W)")
    allowed = tuple(a for a in args.allow_model if a != "none") if args.allow_model else DEFAULT_ALLOWED_MODELS
    check_reference(spec.model, allowed)
    model = file.plain_model()
    if file.normalization is None:
        print(
            f"fedatoms predict: {args.model} records no normalization, so images go in as [0, 1] pixels; a model "
            "whose clients normalized their own images expects otherwise (set [federation] normalization)",
            file=sys.stderr,
        )
    batch = torch.stack([load_image(Path(p), spec.input_shape, file.normalization) for p in args.images])
    with torch.no_grad():
        probabilities = torch.softmax(model(batch), dim=1)
    classes = file.classes
    for path, p in zip(args.images, probabilities, strict=True):
        index = int(p.argmax())
        label = classes[index] if classes is not None and index < len(classes) else str(index)
        print(f"{path}\t{label}\t{float(p[index]):.4f}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "predict",
        help="classify images with an exported model file",
        description="Prints one line per image: the path, the predicted class and its probability.",
    )
    p.add_argument("model", help="a model file written by `fedatoms aggregator export`")
    p.add_argument("images", nargs="+", help="image files (any format Pillow reads)")
    p.add_argument(
        "--allow-model",
        action="append",
        metavar="MODULE",
        help="model code the file may make this command import [the zoo and torchvision.models]",
    )
    p.set_defaults(func=cmd_predict)
