"""The decomposition paper's two tables, rerun with fedatoms' own switches: global FL and personalized FL.

Table 1 (global model): each base strategy of the paper (FedAvg, FedProx, SCAFFOLD, FedDyn, FedDC
— those the strategy registry holds when this runs) without and with filter decomposition
(``factorization = atoms``); the server's test accuracy on the whole test set, mean of the last
5 rounds. Table 2 (personalized FL): Local-only, FedAvg+FT, FedProx+FT, Ditto, FedPer, FedRep,
LG-FedAvg and personal atoms ("Ours"); the clients' mean personalized accuracy on their own test
splits, mean of the last 5 rounds. Every cell is the mean ± standard deviation over ``--seeds``.

    OMP_NUM_THREADS=1 nice python benchmarks/paper_tables.py              # digits, 10 clients × 2 classes
    python benchmarks/paper_tables.py --rounds 20 --seeds 5 --table personal
    python benchmarks/paper_tables.py --dataset cifar10 --data-dir DIR --clients 100 --fraction 0.1 --rounds 200 \
        --local-epochs 10 --num-atoms 9 --atom-lr shared                    # the paper's setting

The paper's hyper-parameters where it states them: SGD lr 0.01, momentum 0.9, batch 10; FedProx
μ = 0.0001; FedDyn α = 0.01; Ditto λ = 0.75; FT 10 epochs; FedRep 10 head epochs + the local
epochs for the body. On digits the default run takes a few minutes on one CPU core.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from aggregator_service.strategies import STRATEGIES
from fedatoms.simulate import SimulationConfig, run_simulation
from fedcore.codec import CodecError

#: The paper's Table 1 rows, in its order; a strategy the registry lacks is left out (and said so).
PAPER_STRATEGIES = ("fedavg", "fedprox", "scaffold", "feddyn", "feddc")
LABELS = {"fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "Scaffold", "feddyn": "FedDyn", "feddc": "FedDC"}
#: The paper's Table 2 rows: label → the switches that give it.
PERSONAL_ROWS: dict[str, dict[str, Any]] = {
    "Local": dict(personalization="local"),
    "FedAvg + FT": dict(personalization="ft"),
    "FedProx + FT": dict(strategy="fedprox", personalization="ft"),
    "Ditto": dict(personalization="ditto"),
    "FedPer": dict(personalization="fedper"),
    "FedRep": dict(personalization="fedrep"),
    "LG-FedAvg": dict(personalization="lg"),
    "Ours (personal atoms)": dict(factorization="atoms", personal_atoms=True),
}


def _cell(values: list[float]) -> str:
    if not values:
        return "—"
    mean = 100 * statistics.fmean(values)
    spread = 100 * statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:6.2f} ± {spread:4.2f}"


def _config(args: argparse.Namespace, seed: int, **switches: Any) -> SimulationConfig:
    base: dict[str, Any] = dict(
        dataset=args.dataset,
        data_dir=args.data_dir,
        clients=args.clients,
        classes_per_client=args.classes_per_client,
        partition="shards",
        fraction=args.fraction,
        cohort="per_round",
        rounds=args.rounds,
        local_epochs=args.local_epochs,
        batch_size=10,
        lr=0.01,
        momentum=0.9,
        ditto_lambda=0.75,
        personal_epochs=args.personal_epochs,
        head_epochs=args.head_epochs,
        device=args.device,
        seed=seed,
    )
    base.update(switches)
    if base.get("factorization") == "atoms":  # the atoms' own settings: keys the plain rows never read
        base.update({k: v for k, v in (("num_atoms", args.num_atoms), ("atom_lr", args.atom_lr)) if v is not None})
    if base.get("strategy") == "fedprox":
        base["mu"] = 1e-4  # the paper's μ (refused for the strategies that take none)
    try:
        return SimulationConfig(**base)
    except ValueError as exc:
        if "atom_lr" not in str(exc) or args.atom_lr is not None:  # a rate asked for is never replaced
            raise
        return SimulationConfig(**{**base, "atom_lr": "shared"})  # e.g. SCAFFOLD's one rate (stated in the notes)


def _measure(args: argparse.Namespace, key: str, **switches: Any) -> tuple[list[float], str | None]:
    """``key`` of the summary over the seeds, and a note: why there is none (refused at start, or diverged), or
    a setting the row needed beyond its switches."""
    values, note = [], None
    for seed in range(args.seeds):
        try:
            config = _config(args, seed, **switches)
        except ValueError as exc:
            return [], f"refused: {exc}"
        if config.atom_lr == "shared" and "atom_lr" not in switches and args.atom_lr is None:
            note = "atom_lr = shared: its strategy takes one learning rate for every tensor (docs/strategies.md)"
        try:
            values.append(run_simulation(config)["summary"][key])
        except CodecError as exc:  # a push of NaN/Inf: the method diverged on this seed
            return [], f"diverged on seed {seed}: {exc}"
    return values, note


def _table(title: str, column: str, rows: list[tuple[str, Callable[[], tuple[list[float], str | None]]]]) -> None:
    print(f"\n{title}\n")
    print(f"| Method | {column} |")
    print("|---|---|")
    notes = []
    method = ""  # the method a "+ Decomposition" row adds to
    for label, measure in rows:
        method = f"{method} {label}" if label.startswith("+") else label
        t0 = time.perf_counter()
        values, note = measure()
        cell = _cell(values) if values else (note or "no value").split(":")[0]
        print(f"| {label} | {cell} |", flush=True)
        if note is not None:
            notes.append(f"{method}: {note}")
        print(f"<!-- {label}: {time.perf_counter() - t0:.0f} s -->", file=sys.stderr)
    if notes:
        print()
    for note in notes:
        print(f"- {note}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--data-dir")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--classes-per-client", type=int, default=2)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument(
        "--personal-epochs",
        type=int,
        default=10,
        help="personal atoms', FT's and Ditto's epochs (the paper: 10 FT)",
    )
    parser.add_argument("--head-epochs", type=int, default=10, help="FedRep's head epochs (the paper: 10)")
    parser.add_argument(
        "--num-atoms",
        type=int,
        help="atoms per conv in the rows with atoms (the paper: 9 for every conv, 5×5 ones included) [k² a k×k conv]",
    )
    parser.add_argument(
        "--atom-lr",
        choices=["shared", "scaled", "preconditioned"],
        help="the atoms' and coefficients' step in the rows with atoms (the paper: shared, one rate for every "
        "tensor) [fedatoms' default, preconditioned; shared where a strategy takes one rate only]",
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--table", choices=["global", "personal", "both"], default="both")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    column = f"{args.dataset} ({args.clients},{args.classes_per_client})"
    started = time.perf_counter()
    print(
        f"{args.dataset}, {args.clients} clients × {args.classes_per_client} classes, {args.fraction:g} per round, "
        f"{args.rounds} rounds, E = {args.local_epochs}, seeds 0..{args.seeds - 1}; accuracy (%) mean ± std over "
        f"seeds of the mean of the last {min(5, args.rounds)} rounds; with atoms: "
        f"{'k²' if args.num_atoms is None else args.num_atoms} atoms per conv, atom_lr {args.atom_lr or 'default'}"
    )
    if args.table in ("global", "both"):
        present = [s for s in PAPER_STRATEGIES if s in STRATEGIES]
        missing = [s for s in PAPER_STRATEGIES if s not in STRATEGIES]
        rows: list[tuple[str, Callable[[], tuple[list[float], str | None]]]] = []
        for strategy in present:
            for label, factorization in ((LABELS[strategy], "none"), ("+ Decomposition", "atoms")):
                rows.append(
                    (
                        label,
                        lambda s=strategy, f=factorization: _measure(
                            args, "mean_test_accuracy_last5", strategy=s, factorization=f
                        ),
                    )
                )
        _table("Table 1: test accuracy of the global model", column, rows)
        if missing:
            print(f"\n- not in this build's strategy registry: {', '.join(missing)}")
    if args.table in ("personal", "both"):
        rows = [
            (label, lambda sw=switches: _measure(args, "mean_personalized_accuracy_last5", **sw))
            for label, switches in PERSONAL_ROWS.items()
        ]
        _table("Table 2: test accuracy of personalized FL (clients' own test splits)", column, rows)
    minutes = (time.perf_counter() - started) / 60
    print(f"\n{minutes:.1f} min")
    return 0 if not math.isnan(minutes) else 1


if __name__ == "__main__":
    sys.exit(main())
