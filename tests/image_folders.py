"""ImageFolders of PNGs written from sklearn's bundled digits: a user's own pictures, made offline."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def digits_images(channels: int, size: int) -> tuple[list, np.ndarray]:
    """Every digit as a PIL image of ``size × size`` in ``L`` (1 channel) or tinted ``RGB`` (3), and its label."""
    from PIL import Image
    from sklearn.datasets import load_digits

    bunch = load_digits()
    out = []
    for img in bunch.images:
        gray = (np.asarray(img) * (255.0 / 16.0)).round().astype(np.uint8)
        if channels == 1:
            pic = Image.fromarray(gray, "L")
        else:  # three different channels, so converting to one channel is not a no-op
            rgb = np.stack([gray, (gray // 2).astype(np.uint8), (255 - gray).astype(np.uint8)], axis=-1)
            pic = Image.fromarray(rgb, "RGB")
        out.append(pic.resize((size, size), Image.Resampling.BILINEAR))
    return out, np.asarray(bunch.target, dtype=np.int64)


def write_folder(
    root: Path, *, channels: int, size: int, count: int | None = None, classes: str = "numbered", start: int = 0
) -> Path:
    """``root/<class>/<i>.png`` for digits ``start .. start+count``; classes named ``0..9`` or ``digit-0..9``."""
    images, labels = digits_images(channels, size)
    stop = len(images) if count is None else start + count
    for i in range(start, stop):
        name = str(labels[i]) if classes == "numbered" else f"digit-{labels[i]}"
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        images[i].save(folder / f"{i:05d}.png")
    return root


def gray_pngs(root: Path, count: int = 3) -> list[Path]:
    """``count`` flat gray 8×8 PNGs (pixel 40, 80, …): pictures a user hands ``fedatoms predict``."""
    from PIL import Image

    paths = []
    for i in range(count):
        path = root / f"digit{i}.png"
        Image.fromarray(np.full((8, 8), 40 * (i + 1), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def digits_probabilities(model, test, count: int = 3):
    """What a digits model trained under the benchmark's normalization gives :func:`gray_pngs`' pictures.

    The digits loader maps raw pixel 0 to ``test.x.min()`` and 16/16 to ``test.x.max()``: the
    normalization is derived here from the loader's output, not from the code that records it.
    """
    import torch

    std = 1.0 / float(test.x.max() - test.x.min())
    mean = -float(test.x.min()) * std
    with torch.no_grad():
        gray = torch.tensor([40.0 * (i + 1) / 255.0 for i in range(count)]).reshape(count, 1, 1, 1)
        return torch.softmax(model((gray.expand(count, 1, 8, 8) - mean) / std), dim=1)
