"""Peak memory and time of a client's model build + load, the whole build against the lean one (not a test).

Every round a client builds its tier's model and loads the tensors it holds into it, twice (to train, to
evaluate). The **whole** build (``spec.build()`` then ``load_state_dict``) makes the plain model first, at
full rank and initialized, and factorizes it; the **lean** one (``spec.build_loaded``) builds on the meta
device, allocates the tier's tensors empty and copies the state in. For each model and tier, each way is run
once in a fresh process (``--repeats`` times, the median kept): the state (random tensors of the tier's
shapes, what a client holds) is made first and the spec derived, then the peak counter is reset (``5``
written to ``/proc/self/clear_refs``) and the build + load is timed; **peak** is ``VmHWM`` less the
``VmRSS`` from before it. The table prints both ways and their ratios, from the same run.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/client_build.py [--models resnet18,vgg11] [--repeats 3]

``vgg11`` is torchvision's (ImageNet classifier: a 25088 → 4096 linear, 133M parameters at full rank, inputs
3×224×224), a user's model by reference; ``resnet18`` the zoo's CIFAR one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPECS = {
    "resnet18": {"model": "resnet18", "num_classes": 10},
    "vgg11": {
        "model": "torchvision.models:vgg11",
        "num_classes": 10,
        "model_args": {"num_classes": 10},
        "input_shape": [3, 224, 224],
    },
}


def status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def child(spec_json: str, way: str) -> None:
    """One build + load in this process; prints ``{"seconds": …, "peak_mb": …}``."""
    import time

    import torch

    from fedcore.spec import ModelSpec

    spec = ModelSpec.from_dict(json.loads(spec_json))
    gen = torch.Generator().manual_seed(0)
    state = {
        t.name: torch.randn(t.shape, generator=gen).to(getattr(torch, t.dtype))
        if getattr(torch, t.dtype).is_floating_point
        else torch.zeros(t.shape, dtype=getattr(torch, t.dtype))
        for t in spec.tensors
    }
    Path("/proc/self/clear_refs").write_text("5")
    before = status_kb("VmRSS")
    began = time.perf_counter()
    if way == "whole":
        model = spec.build()
        model.load_state_dict(state)
    else:
        model = spec.build_loaded(state)
    seconds = time.perf_counter() - began
    peak = status_kb("VmHWM") - before
    assert sum(p.numel() for p in model.parameters()) == spec.num_parameters
    print(json.dumps({"seconds": seconds, "peak_mb": peak / 1024, "params": spec.num_parameters}))


def measure(spec: dict, way: str, repeats: int) -> tuple[float, float, int]:
    runs = []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec), way],
            check=True,
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return (
        statistics.median(r["seconds"] for r in runs),
        statistics.median(r["peak_mb"] for r in runs),
        runs[0]["params"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="resnet18,vgg11")
    parser.add_argument("--factorizations", default="atoms,atoms-lowrank,lowrank")
    parser.add_argument("--tier", type=float, default=0.125)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "WAY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    print(f"one client model build + load, tier γ = {args.tier:g}, median of {args.repeats} fresh processes")
    header = (
        f"{'model':<10} {'factorization':<14} {'params':>11}  {'whole s':>8} {'lean s':>7} {'time ×':>7}"
        f"  {'whole MB':>9} {'lean MB':>8} {'peak ×':>7}"
    )
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        for factorization in args.factorizations.split(","):
            tier = 1.0 if factorization == "atoms" else args.tier
            spec = {**SPECS[name], "factorization": factorization, "rank_ratio": tier}
            whole_s, whole_mb, params = measure(spec, "whole", args.repeats)
            lean_s, lean_mb, _ = measure(spec, "lean", args.repeats)
            label = factorization if tier == args.tier else f"{factorization} γ=1"
            print(
                f"{name:<10} {label:<14} {params:>11,}  {whole_s:>8.3f} {lean_s:>7.3f} {whole_s / lean_s:>6.1f}×"
                f"  {whole_mb:>9.1f} {lean_mb:>8.1f} {whole_mb / max(lean_mb, 0.1):>6.1f}×",
                flush=True,
            )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
