"""The server's per-round cut of huge layers: LAPACK's SVD against fedcore.spectral.thin_svd (the Gram route).

Run from the repository root::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/thin_svd.py            # about two minutes on 2 cores
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/thin_svd.py --vgg      # adds VGG-11's 4096 × 25088 fc (an hour)

For FedHM's matrices of real layers (float64, as the cuts take them) it prints the seconds of each, their ratio
measured in the same run (the two interleaved, median of ``--repeats``), and how far thin_svd's leading
singular values and rank-``r`` cut (r = an eighth of the smaller side) are from LAPACK's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from fedcore.spectral import thin_svd

#: (what it is, FedHM's matrix shape: (out·k, in·k) for a conv, (out, in) for a linear)
SHAPES = [
    ("McMahan's CNN fc1 (MNIST)", (512, 3136)),
    ("VGG-11 classifier.0 at ¼ width", (1024, 6272)),
]
#: square matrices (a ResNet-18 layer4 conv's 1536 × 1536) keep LAPACK's SVD: thin_svd is LAPACK's there
VGG = [
    ("VGG-11 classifier.0 at ½ width", (2048, 12544)),
    ("VGG-11 classifier.0 fc", (4096, 25088)),
]


def _timed(fn, a: torch.Tensor) -> tuple[float, tuple[torch.Tensor, ...]]:
    start = time.perf_counter()
    out = fn(a)
    return time.perf_counter() - start, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vgg", action="store_true", help="also VGG-11's classifier.0 at ½ and full width (an hour)")
    args = parser.parse_args()
    shapes = SHAPES + (VGG if args.vgg else [])
    print(f"{'matrix':32} {'shape':>13} {'LAPACK s':>9} {'thin s':>8} {'ratio':>6} {'Δσ/σ₁':>8} {'Δcut/‖cut‖':>11}")
    for what, (rows, cols) in shapes:
        a = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0), dtype=torch.float64) / cols**0.5
        lapack, thin = [], []
        for i in range(args.repeats):
            print(f"  {what}: repeat {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
            t_lapack, ref = _timed(lambda m: torch.linalg.svd(m, full_matrices=False), a)
            t_thin, got = _timed(thin_svd, a)
            lapack.append(t_lapack)
            thin.append(t_thin)
        r = min(rows, cols) // 8
        cut = (ref[0][:, :r] * ref[1][:r]) @ ref[2][:r]
        mine = (got[0][:, :r] * got[1][:r]) @ got[2][:r]
        ds = float((got[1] - ref[1]).abs().max() / ref[1][0])
        dcut = float((mine - cut).norm() / cut.norm())
        t_l, t_t = statistics.median(lapack), statistics.median(thin)
        print(f"{what:32} {f'{rows}×{cols}':>13} {t_l:9.2f} {t_t:8.2f} {t_l / t_t:6.1f} {ds:8.1e} {dcut:11.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
