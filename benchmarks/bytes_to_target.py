"""Bytes to FedAvg's accuracy: does the composition (atoms, tiers, FedLAMA, fp16) pay off?

For one dataset and split, runs plain FedAvg and each configuration below over several seeds,
in process (:func:`fedatoms.simulate.run_simulation`). Per seed, FedAvg's mean-of-last-5 test
accuracy is the target; for every configuration the table shows the first round whose global
test accuracy reaches it, the bytes moved up to and including that round (``cumulative_bytes_up``
+ ``cumulative_bytes_down`` of that round's record: the one byte ledger,
:class:`aggregator_service.metrics.BandwidthLedger`) and FedAvg's bytes to its own first round at
the target divided by those (× fewer bytes; "never" when the run did not get there). It also
prints each configuration's mean-of-last-5 accuracy, that of the global model cut to its smallest
tier below 1 (the model those clients run), and writes a plot of accuracy against cumulative
bytes (mean over seeds; the smallest tier's cut dashed).

Configurations (``--configs`` picks a subset):

- ``fedavg``: factorization none, every tensor every round;
- ``atoms``; ``atoms+lama2`` / ``atoms+lama4``: with FedLAMA at φ = 2 / 4 (τ' = 1);
- ``atoms-lowrank``: tiers 1, ½, ¼, ⅛ round-robin over the clients;
- ``stack``: atoms-lowrank + tiers + FedLAMA (φ = ``--stack-phi``) + fp16 on the wire;
- ``fedhm-1/8`` / ``fedhm-1``: FedHM (lowrank) with every client at tier ⅛ / at tier 1.

Defaults: the bundled digits, 20 clients × 2 classes (shards), half of them per round, E = 2,
batch 10, lr 0.01 with momentum 0.9 (where ``benchmarks/lr_sweep.py`` finds none and atoms
learning on digits), 40 rounds, 3 seeds (``--first-seed`` picks where they start, to split seeds across
runs). ``--data`` federates your own images instead (an ImageFolder directory, or ``module:function``
returning ``(train, test)`` Datasets, as ``fedatoms simulate --data``) with the ``--model`` you name.
``--set KEY=VALUE`` applies a config key to every configuration but FedAvg, which stays the papers'
baseline (e.g. ``--set warmup_rounds=0`` for FedLAMA's Algorithm 1), where the configuration reads it (a FedLAMA key
only where FedLAMA runs, a mixed tiers' rule only where tiers mix); the setting FedAvg must share
(data, split, rounds, rate, model, seed) has its own flags and is refused there. ``--jobs`` runs that
many simulations in parallel processes (one torch thread each). A run that takes longer than a minute
reports its latest round about once a minute on stderr. A run that diverges (a tensor non-finite, or past
float16's range on an fp16 wire) counts 0 accuracy from then on; FedAvg diverging sets no target, and the
benchmark stops there (exit 2). ``--json PATH`` also writes every run's
per-round accuracy, cumulative bytes and smallest-tier cut with the table's figures for it, to
re-plot or to merge runs split by ``--first-seed``. ``--baseline PATH`` takes FedAvg's runs (the targets
and the byte baseline) from such a file, written with the same setting, instead of running FedAvg again:
on MNIST a configuration's rerun then costs its own runs only.

    OMP_NUM_THREADS=1 nice python benchmarks/bytes_to_target.py
    python benchmarks/bytes_to_target.py --rounds 30 --seeds 2 --configs fedavg,atoms+lama4
    python benchmarks/bytes_to_target.py --dataset mnist --data-dir DIR --clients 100 --fraction 0.1 --rounds 50
    python benchmarks/bytes_to_target.py --data ~/pictures --model mnist-cnn --partition dirichlet
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALL_TIERS = [1.0, 0.5, 0.25, 0.125]
PROGRESS_EVERY_S = 60.0  # a long run (MNIST: minutes a run) says where it is this often
#: CodecError kinds that mean a run diverged: a tensor turned non-finite, or left float16's range on an fp16 wire
DIVERGED = ("nonfinite", "fp16_overflow")

#: keys of the experiment's setting beyond the flags: --set may not change them for the configurations alone
SETTING = frozenset({"seed", "batch_size", "model_args", "input_shape", "download", "threads"})

#: configuration name → SimulationConfig keys beyond the shared ones
CONFIGS: dict[str, dict[str, Any]] = {
    "fedavg": {"factorization": "none"},
    "atoms": {"factorization": "atoms"},
    "atoms+lama2": {"factorization": "atoms", "interval_policy": "fedlama", "phi": 2},
    "atoms+lama4": {"factorization": "atoms", "interval_policy": "fedlama", "phi": 4},
    "atoms-lowrank": {"factorization": "atoms-lowrank", "tiers": ALL_TIERS},
    "stack": {"factorization": "atoms-lowrank", "tiers": ALL_TIERS, "interval_policy": "fedlama", "fp16": True},
    "fedhm-1/8": {"factorization": "lowrank", "tiers": [0.125]},
    "fedhm-1": {"factorization": "lowrank", "tiers": [1.0]},
}


@dataclass(frozen=True)
class Outcome:
    """One run, reduced to what the table and the plot need."""

    accuracy: list[float]
    cumulative_bytes: list[int]  # up + down, through each round (the ledger's figures)
    seconds: float
    #: (tier, accuracy per round) of the global model cut to the smallest tier below 1; None without tiers
    smallest_cut: tuple[str, list[float]] | None = None
    diverged: bool = False  # its training diverged: the rounds after count 0 accuracy

    @property
    def last5(self) -> float:
        return statistics.fmean(self.accuracy[-5:])

    def reach(self, target: float) -> tuple[int, int] | None:
        """The first round (1-based) whose accuracy is at least ``target``, and the bytes through it."""
        for i, acc in enumerate(self.accuracy):
            if acc >= target:
                return i + 1, self.cumulative_bytes[i]
        return None


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def _run(job: tuple[str, int, dict[str, Any]]) -> tuple[str, int, Outcome]:
    """One simulation; a run whose training diverges (a tensor non-finite, or past float16's range on an fp16
    wire) counts its rounds so far and 0 accuracy after."""
    from fedatoms.simulate import SimulationConfig, run_simulation
    from fedcore.codec import CodecError

    name, seed, keys = job
    started = time.perf_counter()
    rounds: list[dict[str, Any]] = []
    reported = started

    def progress(record: dict[str, Any]) -> None:
        nonlocal reported
        rounds.append(record)
        now = time.perf_counter()
        if now - reported >= PROGRESS_EVERY_S:
            reported = now
            moved = record["cumulative_bytes_up"] + record["cumulative_bytes_down"]
            print(
                f"    {name} seed {seed}: round {record['round']}/{keys['rounds']}, accuracy "
                f"{record['test_accuracy']:.3f}, {_fmt_bytes(moved)} ({now - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    diverged: CodecError | None = None
    try:
        # the returned records, not the progress ones: over gRPC a round is reported when it closes, before
        # its cohort's evaluation fetches are counted
        rounds = run_simulation(SimulationConfig(**keys, seed=seed), progress=progress)["rounds"]
    except CodecError as exc:
        if exc.kind not in DIVERGED:
            raise
        diverged = exc  # the rounds reported so far
    accuracy = [r["test_accuracy"] for r in rounds]
    moved = [r["cumulative_bytes_up"] + r["cumulative_bytes_down"] for r in rounds]
    missing = keys["rounds"] - len(rounds)
    cut = None
    if rounds and "tier_accuracy" in rounds[0]:
        tier = min(rounds[0]["tier_accuracy"], key=float)
        cut = (tier, [r["tier_accuracy"][tier] for r in rounds] + [0.0] * missing)
    outcome = Outcome(
        accuracy + [0.0] * missing,
        moved + [moved[-1] if moved else 0] * missing,
        time.perf_counter() - started,
        cut,
        diverged is not None,
    )
    if diverged is not None:
        print(f"  {name} seed {seed}: diverged after round {len(rounds)} ({diverged})", file=sys.stderr, flush=True)
    return name, seed, outcome


def _split(args: argparse.Namespace) -> str:
    """The population in words: ``20 clients × 2 classes``, ``… Dirichlet α = 0.5``, ``… IID``."""
    if args.partition == "shards":
        return f"{args.clients} clients × {args.classes_per_client} classes"
    if args.partition == "dirichlet":
        return f"{args.clients} clients, Dirichlet α = {args.dirichlet_alpha:g}"
    return f"{args.clients} clients, {args.partition}"


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="digits", help="digits (bundled), mnist, fashion-mnist, cifar10, cifar100")
    p.add_argument("--data-dir", help="where torchvision datasets live (mnist, cifar10, …)")
    p.add_argument(
        "--data",
        metavar="PATH_OR_REF",
        help="your own data instead of --dataset: an ImageFolder directory or module:function, as in "
        "fedatoms simulate --data (needs --model)",
    )
    p.add_argument("--model", help="the model every configuration federates [the dataset's]")
    p.add_argument("--configs", default=",".join(CONFIGS), help=", ".join(CONFIGS))
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument(
        "--partition", default="shards", choices=("shards", "dirichlet", "iid"), help="as fedatoms simulate [shards]"
    )
    p.add_argument("--classes-per-client", type=int, default=2, help="with shards [2]")
    p.add_argument("--dirichlet-alpha", type=float, default=0.5, help="with dirichlet [0.5]")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="seeds run from this one on [0]: split seeds across runs")
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--stack-phi", type=int, default=2, help="FedLAMA's φ in the full stack [2]")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config key for every run")
    p.add_argument("--jobs", type=int, default=1, help="simulations run in parallel processes [1]")
    p.add_argument(
        "--plot", default="bytes_to_target.png", help="accuracy against cumulative bytes (PNG) [bytes_to_target.png]"
    )
    p.add_argument(
        "--json", metavar="PATH", help="also write every run's per-round curves and the table's figures (JSON)"
    )
    p.add_argument(
        "--baseline",
        metavar="PATH",
        help="FedAvg's runs from an earlier --json of the same setting, instead of running FedAvg again",
    )
    args = p.parse_args(argv)

    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}; choose among {', '.join(CONFIGS)}")
    if "fedavg" not in names:
        names.insert(0, "fedavg")  # the target and the byte baseline
    if args.data is not None and args.model is None:
        p.error(f"--data {args.data} needs --model: the model that takes these images")
    source = args.data if args.data is not None else args.dataset
    shared: dict[str, Any] = {
        "dataset": args.dataset,
        "data": args.data,
        "model": args.model,
        "data_dir": args.data_dir,
        "clients": args.clients,
        "fraction": args.fraction,
        "partition": args.partition,
        "classes_per_client": args.classes_per_client,
        "dirichlet_alpha": args.dirichlet_alpha,
        "rounds": args.rounds,
        "local_epochs": args.local_epochs,
        "lr": args.lr,
        "momentum": args.momentum,
        "threads": 1,
    }
    from dataclasses import MISSING, fields

    from aggregator_service.config import inert_keys, parse_tiers
    from fedatoms.simulate import SimulationConfig

    config_keys = {f.name for f in fields(SimulationConfig)}
    extra: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set takes KEY=VALUE, got {item!r}")
        key = key.replace("-", "_")
        if key in shared or key in SETTING:
            flag = f"; use --{key.replace('_', '-')}" if key in shared else ""
            p.error(f"--set {key}: FedAvg (the target and the byte baseline) and every configuration share it{flag}")
        if key not in config_keys:
            p.error(f"--set {key}: not a config key; the keys are fedatoms simulate's options")
        extra[key] = _parse_value(value)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    setting = {**{k: v for k, v in shared.items() if k != "threads"}, "stack_phi": args.stack_phi}
    results: dict[tuple[str, int], Outcome] = {}
    if args.baseline is not None:
        try:
            results = _baseline(Path(args.baseline), setting, seeds)
        except ValueError as exc:
            p.error(f"--baseline {args.baseline}: {exc}")
    jobs = []
    read: set[str] = set()  # the --set keys some configuration reads
    defaults = {f.name: f.default_factory() if f.default is MISSING else f.default for f in fields(SimulationConfig)}  # type: ignore[misc]
    for name in names:
        if name == "fedavg" and results:
            continue  # its runs are the baseline's
        keys = {**shared, **CONFIGS[name]}
        if name == "stack":
            keys["phi"] = args.stack_phi
        if name != "fedavg":  # plain FedAvg stays the papers' baseline whatever the rules under test
            merged = {**keys, **extra}
            try:
                tiers = parse_tiers(merged.get("tiers", defaults["tiers"]))
                policy = merged.get("interval_policy", defaults["interval_policy"])
                unread = inert_keys(policy, tiers, merged.get("cohort", defaults["cohort"]))
            except ValueError as exc:
                p.error(f"--set tiers: {exc}")
            keys.update({k: v for k, v in extra.items() if k not in unread})
            read.update(k for k in extra if k not in unread)
        for seed in seeds:
            jobs.append((name, seed, keys))

    if not jobs:
        p.error("--baseline holds FedAvg's runs: name the configurations to compare with them in --configs")
    if set(extra) - read:
        p.error(f"--set {', '.join(sorted(set(extra) - read))}: no configuration of {','.join(names)} reads it")
    try:  # refuse a setting that cannot run before any run starts
        for keys in {name: keys for name, _, keys in jobs}.values():
            SimulationConfig(**keys, seed=seeds[0])
        SimulationConfig(**jobs[0][2], seed=seeds[0]).population().build(fit=())
    except (TypeError, ValueError, FileNotFoundError) as exc:
        p.error(str(exc))
    print(
        f"{source}: {_split(args)}, fraction {args.fraction:g}, "
        f"E = {args.local_epochs}, lr {args.lr:g}, momentum {args.momentum:g}, batch 10, {args.rounds} rounds, "
        f"{args.seeds} seeds, {len(jobs)} runs, {args.jobs} at a time"
        + (f"; FedAvg's runs from {args.baseline}" if args.baseline else "")
        + (f"; set {', '.join(f'{k}={v}' for k, v in extra.items())}" if extra else ""),
        flush=True,
    )
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for done, (name, seed, outcome) in enumerate(pool.map(_run, jobs) if args.jobs > 1 else map(_run, jobs), 1):
            results[(name, seed)] = outcome  # beside FedAvg's runs a --baseline file brought: they count no run
            print(
                f"  [{done}/{len(jobs)}, {time.perf_counter() - started:.0f} s] {name} seed {seed}: "
                f"last-5 {outcome.last5:.3f}, {_fmt_bytes(outcome.cumulative_bytes[-1])} ({outcome.seconds:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    fell = [s for s in seeds if results[("fedavg", s)].diverged]
    if fell:
        print(
            f"error: FedAvg diverged on seed {', '.join(map(str, fell))}: it sets no target to reach; lower --lr",
            file=sys.stderr,
        )
        return 2
    targets = {s: results[("fedavg", s)].last5 for s in seeds}
    baseline = {s: results[("fedavg", s)].reach(targets[s]) for s in seeds}
    print(f"\ntarget per seed (FedAvg's mean of the last 5 rounds): {', '.join(f'{targets[s]:.3f}' for s in seeds)}")
    print("per seed: first round at the target / bytes through it / FedAvg's bytes to its target ÷ those\n")
    header = f"{'configuration':<15} {'last-5 acc':>10} | " + " | ".join(f"{'seed ' + str(s):^30}" for s in seeds)
    print(header + f" | {'mean ×':>7}")
    print("-" * len(header) + "-" * 10)
    #: (name, seed) → (first round at the target, bytes through it, × fewer bytes), None where never
    reached: dict[tuple[str, int], tuple[int, int, float] | None] = {}
    for key, outcome in results.items():
        hit, base = outcome.reach(targets[key[1]]), baseline[key[1]]
        reached[key] = None if hit is None or base is None else (*hit, base[1] / hit[1])
    for name in names:
        cells, ratios = [], []
        for s in seeds:
            figures = reached[(name, s)]
            if figures is None:
                cells.append(f"{'never':^30}")
                ratios.append(math.nan)
                continue
            ratios.append(figures[2])
            cells.append(f"r{figures[0]:>3} {_fmt_bytes(figures[1]):>10} {figures[2]:>6.2f}× fewer")
        last5 = statistics.fmean(results[(name, s)].last5 for s in seeds)
        finite = [r for r in ratios if not math.isnan(r)]
        mean = f"{math.exp(statistics.fmean(math.log(r) for r in finite)):.2f}×" if len(finite) == len(ratios) else "—"
        print(f"{name:<15} {last5:>10.3f} | " + " | ".join(cells) + f" | {mean:>7}")
    print("\nmean × is the geometric mean over seeds, shown only where every seed reached the target")
    cuts = [(n, [results[(n, s)].smallest_cut for s in seeds]) for n in names]
    cuts = [(n, c) for n, c in cuts if all(x is not None for x in c)]
    if cuts:
        print("the global model cut to the smallest tier (what those clients run), last-5, mean over seeds:")
        for name, per_seed in cuts:
            tier = per_seed[0][0]
            cut_last5 = statistics.fmean(statistics.fmean(acc[-5:]) for _, acc in per_seed)
            print(f"  {name:<15} tier {tier:<6} {cut_last5:.3f}")
    print(f"({time.perf_counter() - started:.0f} s)")

    from fedatoms.plots import plot_accuracy_vs_bytes

    curves = {
        name: (
            [statistics.fmean(results[(name, s)].cumulative_bytes[i] for s in seeds) for i in range(args.rounds)],
            [statistics.fmean(results[(name, s)].accuracy[i] for s in seeds) for i in range(args.rounds)],
        )
        for name in names
    }
    cut_curves = {
        name: (per_seed[0][0], [statistics.fmean(acc[i] for _, acc in per_seed) for i in range(args.rounds)])
        for name, per_seed in cuts
    }
    over = f"mean of {args.seeds} seeds" if args.seeds > 1 else f"seed {args.first_seed}"
    out = plot_accuracy_vs_bytes(
        curves,
        statistics.fmean(targets.values()),
        Path(args.plot),
        title=f"{Path(source).name or source}, {_split(args)}, {over}",
        cuts=cut_curves,
    )
    print(f"plot: {out}")
    if args.json:
        _write_json(Path(args.json), setting, extra, targets, results, reached)
        print(f"json: {args.json}")
    return 0


def _baseline(path: Path, setting: dict[str, Any], seeds: range) -> dict[tuple[str, int], Outcome]:
    """FedAvg's runs for ``seeds`` from a ``--json`` document; refused unless it was written with ``setting``
    (the stack's φ aside: FedAvg does not read it; nor where the dataset's files live), since a target reached
    under another setting means nothing."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file (write one with --json)")
    try:
        document = json.loads(path.read_text())
        written, runs = dict(document["setting"]), document["runs"]
        fedavg = {
            r["seed"]: Outcome(list(r["accuracy"]), list(r["cumulative_bytes"]), 0.0)
            for r in runs
            if r["configuration"] == "fedavg"
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a --json file of this benchmark ({exc!r})") from exc
    ours = json.loads(json.dumps(setting, default=str))  # compared as the file holds it
    differ = sorted(
        k for k in ours.keys() | written.keys() if k not in ("stack_phi", "data_dir") and ours.get(k) != written.get(k)
    )
    if differ:
        shown = ", ".join(f"{k} {written.get(k)!r} there, {ours.get(k)!r} here" for k in differ)
        raise ValueError(f"written with another setting: {shown}")
    missing = [s for s in seeds if s not in fedavg]
    if missing:
        raise ValueError(f"holds no FedAvg run of seed {', '.join(map(str, missing))}")
    return {("fedavg", s): fedavg[s] for s in seeds}


def _write_json(
    path: Path,
    setting: dict[str, Any],
    extra: dict[str, Any],
    targets: dict[int, float],
    results: dict[tuple[str, int], Outcome],
    reached: dict[tuple[str, int], tuple[int, int, float] | None],
) -> None:
    """Every run's curves with the table's figures for it: re-plot, or merge runs split by ``--first-seed``."""
    runs = []
    for (name, seed), outcome in results.items():
        figures = reached[(name, seed)]
        runs.append(
            {
                "configuration": name,
                "seed": seed,
                "last5": outcome.last5,
                "first_round_at_target": figures[0] if figures else None,
                "bytes_to_target": figures[1] if figures else None,
                "fewer_bytes": figures[2] if figures else None,
                "accuracy": outcome.accuracy,
                "cumulative_bytes": outcome.cumulative_bytes,
                "smallest_cut": (
                    None
                    if outcome.smallest_cut is None
                    else {"tier": float(outcome.smallest_cut[0]), "accuracy": outcome.smallest_cut[1]}
                ),
            }
        )
    document = {"setting": setting, "set": extra, "targets": {str(s): t for s, t in targets.items()}, "runs": runs}
    path.write_text(json.dumps(document, indent=1, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
