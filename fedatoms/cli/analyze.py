"""`fedatoms analyze`: measurements about the method rather than runs of it.

``fedatoms analyze variance`` runs the papers' variance measurement (:mod:`fedatoms.variance`):
the variance of the aggregated model across repeated local trainings, with and without atoms.
``benchmarks/variance.py`` is the same command.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

__all__ = ["add_parser", "cmd_variance"]


def cmd_variance(args: argparse.Namespace) -> int:
    from fedatoms.simulate import SimulationConfig
    from fedatoms.variance import compare, format_table, stderr_progress
    from fedcore.data import load_dataset

    factorizations = [f.strip() for f in args.factorizations.split(",") if f.strip()]
    if "none" not in factorizations:
        factorizations.insert(0, "none")
    config = SimulationConfig(
        dataset=args.dataset,
        data_dir=args.data_dir,
        model=args.model,
        clients=args.clients,
        fraction=1.0,
        partition=args.partition,
        classes_per_client=args.classes_per_client,
        num_atoms=args.num_atoms,
        local_epochs=args.local_epochs,
        lr=args.lr,
        momentum=args.momentum,
        atom_lr=args.atom_lr,
        seed=args.seed,
    )
    started = time.perf_counter()
    train, test = load_dataset(config.dataset, config.data_dir)
    clients = config.population().clients(train, test)
    results = compare(config, clients, args.repetitions, factorizations, threads=args.threads, progress=stderr_progress)
    print(
        f"{config.dataset} / {config.model}: {config.clients} clients × {config.classes_per_client} classes "
        f"({config.partition}), all aggregated; one round from initial_model(seed={config.seed}) "
        "(the plain convs loaded with the atoms' α⁰ × D⁰: one start for all), "
        f"N_c = {args.repetitions} repetitions of local training (E = {config.local_epochs}, lr = {config.lr:g}, "
        f"momentum {config.momentum:g}, batch {config.batch_size}, atom_lr = {config.atom_lr}, "
        f"{'k²' if config.num_atoms is None else config.num_atoms} atoms per k×k conv) "
        f"[{time.perf_counter() - started:.0f} s]"
    )
    print("variance of the aggregated conv filters across repetitions, (1/N_c) Σ_i ‖θ^i − θ̄‖²;")
    print("Σpα×D: the same repetitions' clients averaged as filters, Σ_k p_k α_k × D_k (Prop. 5.1's θ_φ);")
    print("var/move: the variance over ‖θ̄ − θ⁰‖², how far the mean aggregate moved from the start\n")
    print(format_table(results))
    if args.json:
        payload: dict[str, Any] = {"config": config.to_dict(), "repetitions": args.repetitions}
        payload["results"] = {f: r.to_dict() for f, r in results.items()}
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=1)
        print(f"\nresults written to {args.json}")
    return 0


def add_parser(sub: Any) -> None:
    analyze = sub.add_parser("analyze", help="measurements about the method (the papers' variance)")
    commands = analyze.add_subparsers(dest="analysis", required=True)
    v = commands.add_parser(
        "variance",
        help="variance of the aggregated model across repeated local trainings, with and without atoms",
        description="Proposition 5.1's measurement: from one global model, repeat every client's local training "
        "N_c times with different data orders, aggregate each repetition with the federation's own aggregation, "
        "and print the per-layer variance of the aggregated conv filters (α × D rebuilt for atoms).",
    )
    v.add_argument("--dataset", default="digits", help="digits (bundled), mnist, fashion-mnist, cifar10, cifar100")
    v.add_argument("--data-dir", help="where torchvision datasets live")
    v.add_argument("--model", help="default: by dataset")
    v.add_argument("--factorizations", default="none,atoms", help="compared against none [none,atoms]")
    v.add_argument("--num-atoms", type=int, help="atoms per k×k conv [k²: a complete basis; the papers: 9]")
    v.add_argument("--clients", type=int, default=10, help="clients, all aggregated [10]")
    v.add_argument("--partition", default="shards", choices=["iid", "shards", "dirichlet"])
    v.add_argument("--classes-per-client", type=int, default=2)
    v.add_argument("--repetitions", type=int, default=10, help="N_c, repetitions of local training [10]")
    v.add_argument("--local-epochs", type=int, default=2)
    v.add_argument("--lr", type=float, default=0.01)
    v.add_argument("--momentum", type=float, default=0.9)
    v.add_argument("--atom-lr", default="preconditioned", choices=["preconditioned", "scaled", "shared"])
    v.add_argument("--seed", type=int, default=0, help="the global model's seed (repetitions differ from it)")
    v.add_argument("--threads", type=int, default=1)
    v.add_argument("--json", help="also write the per-layer figures here")
    v.set_defaults(func=cmd_variance)
