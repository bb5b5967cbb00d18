"""Training-throughput and MACs benchmark for the factorized layers in ``fedcore``.

Run from the repository root::

    .venv/bin/python benchmarks/layers.py                      # defaults: ~2-3 min on 2 idle CPU cores
    .venv/bin/python benchmarks/layers.py --models resnet18 --device cuda --json out.json

For ``lenet-cifar10`` and ``resnet18`` it measures, for every factorization (``none``, ``atoms``,
``lowrank``, ``atoms-lowrank``) and tier γ ∈ {1, 1/2, 1/4, 1/8}:

- **images/s** of a full training step (forward, cross-entropy, backward, SGD-with-momentum
  step) on a fixed random batch, and
- **forward MACs per sample** as :class:`fedcore.spec.ModelSpec` counts them (through the path
  each layer's forward actually takes),

each also as a ratio to ``none`` measured in the same run. ``none`` and ``atoms`` have no tiers,
so they appear once, at γ = 1 (``lowrank``/``atoms-lowrank`` at γ = 1 build the same network as
``none``/``atoms``; they are timed anyway and so show the run's noise floor).

Made for a shared, noisy machine: every model is built and warmed up first, then the variants
are timed interleaved in rounds (each round times ``--steps`` steps of every variant, in an order
rotated per round), every step is timed on its own, and each variant reports the median over all
its timed steps (``--steps`` × ``--repeats``). Ratios divide by ``none``'s median from the same
rounds. A "targets" section closes the report with PASS/FAIL lines; the exit status
is 0 either way. Progress goes to stderr, the report to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from fedcore.models import model_info
from fedcore.spec import ModelSpec

MODELS = ("lenet-cifar10", "resnet18")
TIERS = (1.0, 0.5, 0.25, 0.125)
NUM_ATOMS = 9
# Per-model defaults (CPU): (batch size, steps per round, rounds). A resnet18 step at batch 32
# takes ~0.3-2 s on two cores depending on the variant; lenet steps take tens of milliseconds.
# Few steps per round and more rounds interleave finely, so a neighbour's burst of load hits
# all variants alike instead of a few of them.
DEFAULTS = {"lenet-cifar10": (64, 5, 8), "resnet18": (32, 2, 5)}
FALLBACK_DEFAULTS = (32, 5, 3)
WARMUP_STEPS = 2


@dataclass
class Variant:
    model: str
    factorization: str
    rank_ratio: float
    params: int
    macs: int
    net: nn.Module = field(repr=False)
    opt: torch.optim.Optimizer = field(repr=False)
    samples: list[float] = field(default_factory=list)  # images/s, one per timed step

    @property
    def label(self) -> str:
        return f"{self.factorization} γ={tier_label(self.rank_ratio)}"

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def tier_label(rank_ratio: float) -> str:
    return str(Fraction(rank_ratio).limit_denominator(64))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def variant_keys() -> list[tuple[str, float]]:
    keys = [("none", 1.0), ("atoms", 1.0)]
    keys += [(f, g) for f in ("lowrank", "atoms-lowrank") for g in TIERS]
    return keys


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_steps(v: Variant, x: torch.Tensor, y: torch.Tensor, steps: int, device: torch.device) -> list[float]:
    """Run ``steps`` training steps; return each step's wall time in seconds."""
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        v.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(v.net(x), y)
        loss.backward()
        v.opt.step()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def bench_model(model: str, batch_size: int, steps: int, repeats: int, device: torch.device) -> list[Variant]:
    info = model_info(model)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, *info.input_shape, generator=gen).to(device)
    y = torch.randint(0, info.default_classes, (batch_size,), generator=gen).to(device)

    variants: list[Variant] = []
    for factorization, gamma in variant_keys():
        spec = ModelSpec(model, info.default_classes, factorization, NUM_ATOMS, gamma)
        torch.manual_seed(0)
        net = spec.build().to(device).train()
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        variants.append(Variant(model, factorization, gamma, spec.num_parameters, spec.macs, net, opt))

    log(f"[{model}] batch {batch_size}, {steps} steps × {repeats} rounds, {len(variants)} variants; warming up")
    for v in variants:
        train_steps(v, x, y, WARMUP_STEPS, device)

    for r in range(repeats):
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:  # rotate so no variant always runs first/last
            rates = [batch_size / t for t in train_steps(v, x, y, steps, device)]
            v.samples += rates
            log(f"[{model} round {r + 1}/{repeats}] {v.label:<22} {statistics.median(rates):9.1f} img/s")
    for v in variants:  # free memory before the next model
        v.net = v.opt = None  # type: ignore[assignment]
    return variants


def find(variants: list[Variant], model: str, factorization: str, gamma: float) -> Variant | None:
    for v in variants:
        if v.model == model and v.factorization == factorization and v.rank_ratio == gamma:
            return v
    return None


def report(results: dict[str, list[Variant]]) -> tuple[list[dict], list[dict]]:
    header = (
        f"{'model':<14} {'factorization':<14} {'γ':>4} {'params':>11} {'MACs (M)':>9} "
        f"{'MACs×':>6} {'images/s':>9} {'speed×':>7}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for model, variants in results.items():
        base = find(variants, model, "none", 1.0)
        assert base is not None
        for v in variants:
            macs_ratio = v.macs / base.macs
            speed_ratio = v.median / base.median
            rows.append(
                {
                    "model": model,
                    "factorization": v.factorization,
                    "rank_ratio": v.rank_ratio,
                    "params": v.params,
                    "macs": v.macs,
                    "macs_ratio": macs_ratio,
                    "images_per_s": v.median,
                    "images_per_s_samples": v.samples,
                    "speed_ratio": speed_ratio,
                }
            )
            print(
                f"{model:<14} {v.factorization:<14} {tier_label(v.rank_ratio):>4} {v.params:>11,} "
                f"{v.macs / 1e6:>9.2f} {macs_ratio:>6.3f} {v.median:>9.1f} {speed_ratio:>7.2f}"
            )
        print()

    print("targets")
    targets = []

    def check(name: str, ok: bool, detail: str) -> None:
        targets.append({"target": name, "pass": ok, "detail": detail})
        print(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")

    for model, variants in results.items():
        base, atoms = find(variants, model, "none", 1.0), find(variants, model, "atoms", 1.0)
        if base and atoms:
            ratio = atoms.median / base.median
            check(f"{model} atoms throughput ≥ 0.9× none", ratio >= 0.9, f"{ratio:.2f}×")
    if "resnet18" in results:
        variants = results["resnet18"]
        base, al = find(variants, "resnet18", "none", 1.0), find(variants, "resnet18", "atoms-lowrank", 0.125)
        if base and al:
            fewer = base.macs / al.macs
            check("resnet18 atoms-lowrank γ=1/8 ≥ 2× fewer MACs than none", fewer >= 2.0, f"{fewer:.2f}× fewer")
            speed = al.median / base.median
            check("resnet18 atoms-lowrank γ=1/8 faster than none", speed > 1.0, f"{speed:.2f}× none's images/s")
    return rows, targets


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), help=f"models to run (default: {' '.join(MODELS)})")
    p.add_argument("--batch-size", type=int, help="batch size for every model (default: 64 lenet, 32 resnet18)")
    p.add_argument("--steps", type=int, help="timed steps per variant per round (default: 5 lenet, 2 resnet18)")
    p.add_argument("--repeats", type=int, help="rounds of interleaved timing (default: 8 lenet, 5 resnet18)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own choice)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)

    for m in args.models:
        model_info(m)  # fail early on an unknown name
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"fedcore layer benchmark: torch {torch.__version__}, device {device} ({dev_name}), "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, num_atoms={NUM_ATOMS}"
    )
    print("images/s: forward+backward+SGD step, median over all timed steps; ×: ratio to none from the same run")

    results: dict[str, list[Variant]] = {}
    config: dict[str, dict[str, int]] = {}
    t0 = time.perf_counter()
    for model in args.models:
        bs, steps, repeats = DEFAULTS.get(model, FALLBACK_DEFAULTS)
        bs, steps, repeats = args.batch_size or bs, args.steps or steps, args.repeats or repeats
        config[model] = {"batch_size": bs, "steps": steps, "repeats": repeats}
        print(f"{model}: batch {bs}, {steps} steps × {repeats} rounds")
        results[model] = bench_model(model, bs, steps, repeats, device)
    log(f"done in {time.perf_counter() - t0:.0f} s")
    print()

    rows, targets = report(results)

    if args.json:
        payload = {
            "torch": torch.__version__,
            "device": str(device),
            "device_name": dev_name,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "num_atoms": NUM_ATOMS,
            "config": config,
            "results": rows,
            "targets": targets,
        }
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
