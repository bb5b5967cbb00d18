"""`fedatoms simulate` and `fedatoms plot`, and the simulation flags and reports `fedatoms demo` shares."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

__all__ = ["ProgressBar", "add_parser", "print_comparison", "print_summary", "progress_printer"]


def _tiers(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if "/" in part:
            num, den = part.split("/", 1)
            out.append(float(num) / float(den))
        elif part:
            out.append(float(part))
    if not out:
        raise argparse.ArgumentTypeError("give at least one tier, e.g. 1,0.5,0.25,0.125")
    return out


def _strategy_arg(text: str) -> tuple[str, Any]:
    """``NAME=VALUE``; the value is read as JSON (numbers, true/false, quoted strings) or else taken as text."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"write NAME=VALUE, got {text!r}")
    try:
        return name.strip(), json.loads(value)
    except json.JSONDecodeError:
        return name.strip(), value


def _json_table(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('give a JSON object, e.g. {"num_classes": 10}')
    return value


def _names(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _sizes(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError("give sizes like 3,32,32") from None


def _add_simulation_flags(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`SimulationConfig` key; a flag left out takes the TOML's value, then the default."""
    from fedatoms.simulate import SimulationConfig

    defaults = SimulationConfig()
    g = p.add_argument_group("federation (each flag may also be a key of --config TOML)")
    g.add_argument("--config", type=Path, help="TOML file with the same keys as the flags (flags win)")
    g.add_argument(
        "--transport",
        choices=["inprocess", "grpc"],
        help="inprocess: direct calls; grpc: a real aggregator and real client agents in worker processes",
    )
    g.add_argument("--engine", choices=["local", "ray"], help="where virtual clients run: this machine, or Ray actors")
    g.add_argument("--ray-address", help="with --engine ray: join this Ray cluster [start a local Ray, stop it after]")
    g.add_argument("--ray-num-cpus", type=int, help="with --engine ray, no --ray-address: the local Ray's CPUs [all]")
    g.add_argument(
        "--actor-failure",
        choices=["retry", "dropout"],
        help="with --engine ray: a dead actor's clients retry the round on its replacement, or drop out of it",
    )
    g.add_argument("--dataset", help=f"digits (bundled), mnist, fashion-mnist, cifar10, cifar100 [{defaults.dataset}]")
    g.add_argument(
        "--data",
        help="an ImageFolder directory (one subfolder per class), an import reference module:function returning "
        "(train, test) Datasets, or a bundled dataset name; split across the clients by --partition",
    )
    g.add_argument("--data-dir", help="where torchvision datasets live")
    g.add_argument("--download", action="store_true", default=None, help="let torchvision download missing data")
    g.add_argument(
        "--model",
        help="a zoo name (digits-cnn, mnist-cnn, lenet-cifar10, lenet-cifar100, resnet18) [by dataset] "
        "or an import reference package.module:callable, e.g. torchvision.models:resnet18",
    )
    g.add_argument(
        "--num-classes",
        type=int,
        help="the model's classes, kept even when the training labels use fewer (a vocabulary-sized head) "
        "[model_args' num_classes, else the data's: its class folders or largest label + 1, else the dataset's]",
    )
    g.add_argument(
        "--model-args", type=_json_table, help="keyword arguments of --model as JSON, e.g. '{\"num_classes\": 10}'"
    )
    g.add_argument(
        "--full-rank", type=_names, help="module-name patterns kept full rank at every tier, e.g. conv1,layer1.*"
    )
    g.add_argument(
        "--full-rank-share",
        type=float,
        help="without --full-rank: the leading convs and linears holding together at most this share of the "
        f"factorizable weights keep full rank with the stem [{defaults.full_rank_share:g}; 0: the stem alone]",
    )
    g.add_argument("--input-shape", type=_sizes, help="one sample's C,H,W for a reference model [the dataset's]")
    g.add_argument(
        "--input-dtype",
        choices=["float32", "int64", "int32"],
        help="the dtype the model takes: float32 (images, features) or int64/int32 token ids [float32]",
    )
    g.add_argument("--factorization", choices=["none", "atoms", "lowrank", "atoms-lowrank"])
    g.add_argument("--num-atoms", type=int, help="atoms per k×k conv [k²: a complete basis; the papers: 9]")
    g.add_argument("--clients", type=int, help=f"number of clients [{defaults.clients}]")
    g.add_argument("--fraction", type=float, help=f"fraction sampled per cohort [{defaults.fraction}]")
    g.add_argument("--min-clients", type=int)
    g.add_argument("--cohort", choices=["period", "per_round"], help="keep a cohort for a sync period, or resample")
    g.add_argument("--partition", choices=["iid", "shards", "dirichlet"])
    g.add_argument("--classes-per-client", type=int)
    g.add_argument("--dirichlet-alpha", type=float)
    g.add_argument("--rounds", type=int)
    g.add_argument("--local-epochs", type=int)
    g.add_argument("--batch-size", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--momentum", type=float)
    g.add_argument("--weight-decay", type=float)
    g.add_argument(
        "--strategy",
        help="fedavg, fedprox, scaffold, fedavgm, fedadam, fedyogi, fedadagrad, fedmedian, fedtrimmedavg, feddyn, "
        "feddc, or a class of your own as package.module:Class (docs/strategies.md)",
    )
    g.add_argument(
        "--strategy-arg",
        dest="strategy_args",
        type=_strategy_arg,
        action="append",
        metavar="NAME=VALUE",
        help="a keyword argument of the strategy's class, e.g. alpha=0.01 (feddyn), beta=0.1 (fedtrimmedavg)",
    )
    g.add_argument("--mu", type=float, help="FedProx proximal weight")
    g.add_argument("--global-lr", type=float, help="SCAFFOLD server step size η_g")
    g.add_argument("--weighting", choices=["samples", "tier-softmax", "uniform"])
    g.add_argument("--temperature", type=float, help="FedHM softmax temperature τ (inf = plain FedAvg weights)")
    g.add_argument("--keep-local-buffers", action="store_true", default=None, help="never average BN statistics")
    g.add_argument(
        "--bn-statistics",
        choices=["precise", "running"],
        help="BatchNorm statistics: recomputed for the trained weights and pooled (precise), or PyTorch's "
        "running averages averaged as they are (running) [precise]",
    )
    g.add_argument("--frobenius-decay", type=float, help="FedHM Frobenius decay λ on low-rank factors")
    g.add_argument("--interval-policy", choices=["every_round", "fixed", "fedlama"])
    g.add_argument("--beta", type=float, help="fixed policy: the slow tensors every 1/β rounds")
    g.add_argument(
        "--slow-tensors",
        choices=["coefficients", "all_but_atoms"],
        help="fixed policy: what goes every 1/β rounds, the coefficients (the paper's §4.2; default) or every "
        "tensor but the atoms (its §6.4: the whole model)",
    )
    g.add_argument("--tau", type=int, help="FedLAMA base interval τ' in rounds")
    g.add_argument("--phi", type=int, help="FedLAMA interval factor φ")
    g.add_argument("--warmup-rounds", type=int, help="FedLAMA: no interval adjustment at or before this round [6]")
    g.add_argument(
        "--lama-warmup",
        choices=["periods", "rounds"],
        help="FedLAMA: --warmup-rounds as 3 adjustment periods at any φ (warmup·φ/2 rounds; default), or as rounds",
    )
    g.add_argument(
        "--hold-cohort",
        choices=["while_relaxed", "sync_period"],
        help="FedLAMA with --cohort period: keep a cohort for φτ' rounds only while a tensor is relaxed, or always "
        "(the paper); refused with a new cohort every round, where nothing reads it",
    )
    g.add_argument(
        "--lama-protect",
        choices=["head_and_first", "none"],
        help="FedLAMA: never relax the head and the first layer (default), or relax any kernel (the paper)",
    )
    g.add_argument("--tiers", type=_tiers, help="capability tiers assigned round-robin, e.g. 1,0.5,0.25,0.125")
    g.add_argument(
        "--tier-init",
        choices=["energy", "truncated", "nested"],
        help="a tier's first factors: the SVD cut scaled to the plain layer's energy (default), FedHM's cut, or "
        "with nested tiers the smallest tier's energy-keeping cut in every tier",
    )
    g.add_argument(
        "--tier-average",
        choices=["held", "aligned"],
        help="mixed tiers: each factorized entry averaged over the clients that hold it (default), or FedHM's eq. 1",
    )
    g.add_argument(
        "--tier-training",
        choices=["nested", "own"],
        help="mixed tiers: larger tiers train the smallest tier's part as that model (default), or each its own",
    )
    g.add_argument("--personal-atoms", action="store_true", default=None, help="keep personal atoms per client")
    g.add_argument("--personal-epochs", type=int, help="personal atoms', Ditto's and FT's epochs (default: local)")
    g.add_argument(
        "--personalization",
        help="a personalization baseline: none, ft (FedAvg/FedProx+FT), fedper, fedrep, lg (LG-FedAvg), ditto, local",
    )
    g.add_argument("--head-epochs", type=int, help="FedRep: head epochs before the body's local epochs")
    g.add_argument("--ditto-lambda", type=float, help="Ditto's λ (the decomposition paper: 0.75)")
    g.add_argument(
        "--atom-lr",
        choices=["preconditioned", "scaled", "shared"],
        help="step sizes of atoms, coefficients and low-rank factor pairs: preconditioned (scaled atoms, ScaledGD "
        "pairs; the default), scaled (α×D and U V move like a plain layer), or the papers' shared rate",
    )
    g.add_argument("--fp16", action="store_true", default=None, help="send tensors as float16")
    g.add_argument("--seed", type=int)
    g.add_argument("--device", help="auto, cpu or cuda")
    g.add_argument("--threads", type=int, help="torch threads per training and for aggregation (default 1)")
    g.add_argument("--output", help="write the results JSON here")


def _config_from_args(args: argparse.Namespace) -> Any:
    from fedatoms.simulate import SimulationConfig

    keys = {f.name for f in fields(SimulationConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in keys and v is not None}
    if "strategy_args" in overrides:
        overrides["strategy_args"] = dict(overrides["strategy_args"])
    if args.config is not None:
        return SimulationConfig.from_toml(args.config, overrides)
    return SimulationConfig(**overrides)


class ProgressBar:
    """A progress bar on stderr, so stdout keeps only the results.

    Drawn at :meth:`start`, which :func:`~fedatoms.simulate.run_simulation` calls once the data, model
    and clients are ready: an error found before shows alone, not after a bar at 0 %.
    """

    def __init__(self, total: int, label: str = "round") -> None:
        self.total, self.label = total, label
        self._bar: Any = None

    def start(self) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.label, unit="round", file=sys.stderr, dynamic_ncols=True)

    def __call__(self, record: dict[str, Any]) -> None:
        self.start()
        post = {"MB": f"{record['cumulative_bytes_up'] / 1e6 + record['cumulative_bytes_down'] / 1e6:.2f}"}
        if record["test_accuracy"] is not None:  # None: the aggregator evaluates nothing (no eval_data)
            post = {"acc": f"{record['test_accuracy']:.3f}", **post}
        if record.get("personalized_accuracy") is not None:
            post["pers"] = f"{record['personalized_accuracy']:.3f}"
        self._bar.set_postfix(post)
        self._bar.update(1)
        if self._bar.n >= self.total:
            self._bar.close()

    def close(self) -> None:
        """End the bar's line (a run that stopped early): what is printed next starts a line of its own."""
        if self._bar is not None:
            self._bar.close()


def progress_printer(total: int, label: str = "round") -> ProgressBar:
    """The progress bar of a run: pass it as ``progress`` and its ``start`` as ``on_start``."""
    return ProgressBar(total, label)


def print_summary(results: dict[str, Any]) -> None:
    s = results["summary"]
    c = results["config"]
    data = c.get("data") or c["dataset"]
    from fedatoms.plots import run_label

    print(f"\n{c['model']} / {run_label(results, '')} on {data}: {s['rounds']} rounds")
    if s["mean_test_accuracy_last5"] is None:
        print("  global test accuracy   none: the aggregator evaluates nothing (set its eval_data)")
    else:
        final = "-" if s["final_test_accuracy"] is None else f"{s['final_test_accuracy']:.4f}"
        print(
            f"  global test accuracy   {s['mean_test_accuracy_last5']:.4f} mean of the last {min(5, s['rounds'])} "
            f"rounds (final {final}, best {s['best_test_accuracy']:.4f})"
        )
    for tier, accuracy in s.get("mean_tier_accuracy_last5", {}).items():
        print(
            f"  cut to tier {tier:<10} {accuracy:.4f} mean of the last {min(5, s['rounds'])} rounds "
            "(what that tier's clients run)"
        )
    if s.get("final_local_accuracy") is not None:
        print(
            f"  global model on clients' local tests {s['final_local_accuracy']:.4f} (final round's cohort, each "
            "client counted once; the dashboard's mean client accuracy weights them by samples)"
        )
    personal = s.get("final_personalized_accuracy")
    if personal is not None:
        last5 = s.get("mean_personalized_accuracy_last5")
        shown = (
            f"{personal:.4f} (final round's cohort)"
            if last5 is None
            else f"{last5:.4f} mean of the last {min(5, s['rounds'])} rounds (final {personal:.4f})"
        )
        print(f"  personalized accuracy  {shown}")
    ratio = s["bytes_ratio_vs_fedavg"]
    print(
        f"  bytes moved            {s['bytes_total'] / 1e6:.2f} MB vs FedAvg-equivalent "
        f"{s['fedavg_equivalent_bytes'] / 1e6:.2f} MB (moved ÷ FedAvg-equivalent = {ratio:.3f}×)"
    )
    print(f"  wall time              {s['wall_seconds']:.1f} s")


def print_comparison(results: dict[str, Any], fedavg: dict[str, Any]) -> None:
    """Two runs of one split and seed side by side: accuracy over the last rounds, and bytes moved."""
    ours, base = results["summary"], fedavg["summary"]
    label = f"{results['config']['factorization']} / {results['config']['interval_policy']}"
    print(f"\n{'':28}{label:>28}{'plain FedAvg':>16}")
    accuracy = ours["mean_test_accuracy_last5"], base["mean_test_accuracy_last5"]
    print(f"{'mean test acc., last 5':28}{accuracy[0]:>28.4f}{accuracy[1]:>16.4f}")
    print(f"{'bytes moved':28}{ours['bytes_total'] / 1e6:>25.2f} MB{base['bytes_total'] / 1e6:>13.2f} MB")
    print(f"{'vs FedAvg-equivalent':28}{ours['bytes_ratio_vs_fedavg']:>27.3f}×{base['bytes_ratio_vs_fedavg']:>15.3f}×")


def _grpc_options(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "server": args.server,
        "database_url": args.database_url,
        "enrollment_secret": args.enrollment_secret,
        "federation_name": args.federation_name,
        "workers": args.workers,
        "state_dir": args.state_dir,
        "tls_ca": args.tls_ca,
        "give_up_after": args.give_up_after,
    }
    return {k: v for k, v in given.items() if v is not None}


def cmd_simulate(args: argparse.Namespace) -> int:
    from client_agent.agent import TrainingDiverged, UpdateRefused
    from client_agent.ray_pool import SlotFailed
    from fedatoms.simulate import run_simulation, write_results

    config = _config_from_args(args)
    bar = progress_printer(config.rounds)
    try:
        results = run_simulation(
            config, progress=bar, model_out=args.save_model, on_start=bar.start, **_grpc_options(args)
        )
    # the run's setting, not a fault: one line, as in process; SlotFailed: clients that kill their Ray actor
    except (TrainingDiverged, UpdateRefused, SlotFailed) as exc:
        raise ValueError(user_message(exc)) from None  # raised in a Ray actor: its message, not its traceback
    finally:
        bar.close()
    if args.save_model is not None:
        print(f"final global model written to {args.save_model} (fedatoms predict, fedatoms.load_model)")
    if config.output:
        write_results(results, config.output)
        print(f"results written to {config.output}")
    else:
        if not args.quiet_json:
            json.dump(results["summary"], sys.stdout, indent=1)
            print()
    print_summary(results)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from fedatoms.plots import plot_runs

    print(f"plot written to {plot_runs(args.results, args.output)}")
    return 0


def add_parser(sub: Any) -> None:
    sim = sub.add_parser("simulate", help="run a whole federation on this machine and record every round")
    _add_simulation_flags(sim)
    sim.add_argument("--quiet-json", action="store_true", help="do not print the summary JSON")
    sim.add_argument(
        "--save-model",
        type=Path,
        metavar="OUT.safetensors",
        help="write the final global model as a model file (what `fedatoms aggregator export` writes)",
    )
    g = sim.add_argument_group("--transport grpc")
    g.add_argument("--server", help="HOST:PORT of a running aggregator (default: start one on a loopback port)")
    g.add_argument("--database-url", help="the aggregator's database [a new SQLite file, printed at start]")
    g.add_argument("--enrollment-secret", help="with --server: that federation's secret")
    g.add_argument(
        "--federation-name",
        help="the federation in --database-url the records are read from (and, without "
        "--server, the one the aggregator started here serves) [default]",
    )
    g.add_argument("--workers", type=int, help="worker processes running the virtual clients [2]")
    g.add_argument("--state-dir", help="where each virtual client keeps its state [a new temporary directory]")
    g.add_argument("--tls-ca", help="with --server: CA bundle to verify the aggregator's certificate")
    g.add_argument(
        "--give-up-after",
        type=float,
        help="with --server: end the run (exit 2) when the aggregator cannot be reached for this many seconds "
        "while the clients register [60]",
    )
    sim.set_defaults(func=cmd_simulate)

    plot = sub.add_parser("plot", help="plot accuracy, bytes, dispersion and intervals of simulation results")
    plot.add_argument("results", nargs="+", help="results JSON files from `fedatoms simulate --output`")
    plot.add_argument("-o", "--output", default="fedatoms-runs.png", help="PNG to write")
    plot.set_defaults(func=cmd_plot)


def user_message(exc: BaseException) -> str:
    """What a user's mistake says: its own message, also when a Ray worker raised it (Ray's ``RayTaskError``
    is an instance of the worker's exception class, and its text is the worker's traceback; ``cause`` is the
    exception itself)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and type(exc).__module__.startswith("ray."):
        return user_message(cause)
    return str(exc)
