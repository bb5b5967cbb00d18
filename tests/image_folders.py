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
