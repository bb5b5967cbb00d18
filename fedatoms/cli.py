"""The one `fedatoms` command; subcommands import their heavy modules only when run."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

__all__ = ["main"]


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


def _add_simulation_flags(p: argparse.ArgumentParser) -> None:
    from fedatoms.simulate import SimulationConfig

    defaults = SimulationConfig()
    g = p.add_argument_group("federation (each flag may also be a key of --config TOML)")
    g.add_argument("--config", type=Path, help="TOML file with the same keys as the flags (flags win)")
    g.add_argument(
        "--transport",
        choices=["inprocess", "grpc"],
        help="inprocess: direct calls; grpc: a real aggregator and real client agents in worker processes",
    )
    g.add_argument("--dataset", help=f"digits (bundled), mnist, fashion-mnist, cifar10, cifar100 [{defaults.dataset}]")
    g.add_argument("--data-dir", help="where torchvision datasets live")
    g.add_argument("--download", action="store_true", default=None, help="let torchvision download missing data")
    g.add_argument("--model", help="digits-cnn, mnist-cnn, lenet-cifar10, lenet-cifar100, resnet18 [by dataset]")
    g.add_argument("--factorization", choices=["none", "atoms", "lowrank", "atoms-lowrank"])
    g.add_argument("--num-atoms", type=int)
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
    g.add_argument("--strategy", choices=["fedavg", "fedprox", "scaffold"])
    g.add_argument("--mu", type=float, help="FedProx proximal weight")
    g.add_argument("--global-lr", type=float, help="SCAFFOLD server step size η_g")
    g.add_argument("--weighting", choices=["samples", "tier-softmax"])
    g.add_argument("--temperature", type=float, help="FedHM softmax temperature τ (inf = plain FedAvg weights)")
    g.add_argument("--keep-local-buffers", action="store_true", default=None, help="never average BN statistics")
    g.add_argument("--frobenius-decay", type=float, help="FedHM Frobenius decay λ on low-rank factors")
    g.add_argument("--interval-policy", choices=["every_round", "fixed", "fedlama"])
    g.add_argument("--beta", type=float, help="fixed policy: coefficients every 1/β rounds")
    g.add_argument("--tau", type=int, help="FedLAMA base interval τ' in rounds")
    g.add_argument("--phi", type=int, help="FedLAMA interval factor φ")
    g.add_argument("--warmup-rounds", type=int, help="FedLAMA: no interval adjustment at or before this round")
    g.add_argument("--tiers", type=_tiers, help="capability tiers assigned round-robin, e.g. 1,0.5,0.25,0.125")
    g.add_argument("--personal-atoms", action="store_true", default=None, help="keep personal atoms per client")
    g.add_argument("--personal-epochs", type=int)
    g.add_argument("--fp16", action="store_true", default=None, help="send tensors as float16")
    g.add_argument("--seed", type=int)
    g.add_argument("--device", help="auto, cpu or cuda")
    g.add_argument("--threads", type=int, help="torch threads per training and for aggregation (default 1)")
    g.add_argument("--output", help="write the results JSON here")


def _config_from_args(args: argparse.Namespace) -> Any:
    from fedatoms.simulate import SimulationConfig

    keys = {f.name for f in fields(SimulationConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in keys and v is not None}
    if args.config is not None:
        return SimulationConfig.from_toml(args.config, overrides)
    return SimulationConfig(**overrides)


def _progress_printer(total: int, label: str = "round") -> Any:
    from tqdm import tqdm

    bar = tqdm(total=total, desc=label, unit="round", file=sys.stderr, dynamic_ncols=True)

    def report(record: dict[str, Any]) -> None:
        post = {
            "acc": f"{record['test_accuracy']:.3f}",
            "MB": f"{record['cumulative_bytes_up'] / 1e6 + record['cumulative_bytes_down'] / 1e6:.2f}",
        }
        if record.get("personalized_accuracy") is not None:
            post["pers"] = f"{record['personalized_accuracy']:.3f}"
        bar.set_postfix(post)
        bar.update(1)
        if bar.n >= total:
            bar.close()

    return report


def _print_summary(results: dict[str, Any]) -> None:
    s = results["summary"]
    c = results["config"]
    print(f"\n{c['model']} / {c['factorization']} / {c['interval_policy']} on {c['dataset']}: {s['rounds']} rounds")
    print(f"  global test accuracy   {s['final_test_accuracy']:.4f} (best {s['best_test_accuracy']:.4f})")
    if s.get("final_local_accuracy") is not None:
        print(f"  global model on clients' local tests {s['final_local_accuracy']:.4f}")
    if "final_personalized_accuracy" in s and s["final_personalized_accuracy"] is not None:
        print(f"  personalized accuracy  {s['final_personalized_accuracy']:.4f}")
    ratio = s["bytes_ratio_vs_fedavg"]
    print(
        f"  bytes moved            {s['bytes_total'] / 1e6:.2f} MB vs FedAvg-equivalent "
        f"{s['fedavg_equivalent_bytes'] / 1e6:.2f} MB ({ratio:.3f}×)"
    )
    print(f"  wall time              {s['wall_seconds']:.1f} s")


def _grpc_options(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "server": args.server,
        "database_url": args.database_url,
        "enrollment_secret": args.enrollment_secret,
        "workers": args.workers,
        "state_dir": args.state_dir,
        "tls_ca": args.tls_ca,
    }
    return {k: v for k, v in given.items() if v is not None}


def cmd_simulate(args: argparse.Namespace) -> int:
    from fedatoms.simulate import run_simulation, write_results

    config = _config_from_args(args)
    results = run_simulation(config, progress=_progress_printer(config.rounds), **_grpc_options(args))
    if config.output:
        write_results(results, config.output)
        print(f"results written to {config.output}")
    else:
        if not args.quiet_json:
            json.dump(results["summary"], sys.stdout, indent=1)
            print()
    _print_summary(results)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from fedatoms.plots import plot_runs

    print(f"plot written to {plot_runs(args.results, args.output)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fedatoms.plots import plot_runs
    from fedatoms.simulate import SimulationConfig, run_simulation, write_results

    out_dir = Path(args.output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    db = out_dir / "demo.db"
    for stale in (db, db.with_name("demo.db-wal"), db.with_name("demo.db-shm")):
        stale.unlink(missing_ok=True)  # a demo starts a new federation
    shutil.rmtree(out_dir / "clients", ignore_errors=True)  # with new clients: old tokens died with the database
    url = f"sqlite:///{db}"
    print(
        "fedatoms demo: an aggregator (gRPC, SQLite) and 20 client agents on sklearn digits (2 classes each),\n"
        "filter atoms with personal atoms, FedLAMA intervals (τ'=1, φ=2), 4 capability tiers "
        f"γ ∈ {{1, 1/2, 1/4, 1/8}}, {args.rounds} rounds.\n"
    )
    from aggregator_service import store

    store.upgrade(url)  # the dashboard reads the schema before the aggregator has started
    dashboard = _start_dashboard(url, args.dashboard_port) if not args.no_dashboard else None
    if dashboard is not None:
        print(f"dashboard: {dashboard[0]}  (live while the demo runs)\n")
    config = SimulationConfig(
        dataset="digits",
        factorization="atoms-lowrank",
        clients=20,
        fraction=0.5,
        partition="shards",
        classes_per_client=2,
        rounds=args.rounds,
        local_epochs=2,
        lr=0.02,
        interval_policy="fedlama",
        tau=1,
        phi=2,
        tiers=[1.0, 0.5, 0.25, 0.125],
        personal_atoms=True,
        personal_epochs=3,
        seed=args.seed,
        transport=args.transport,
        output=str(out_dir / "demo-results.json"),
    )
    options = {"database_url": url, "state_dir": str(out_dir / "clients")} if args.transport == "grpc" else {}
    try:
        results = run_simulation(config, progress=_progress_printer(config.rounds), **options)
    finally:
        if dashboard is not None:
            dashboard[1]()
    write_results(results, out_dir / "demo-results.json")
    _print_summary(results)
    plot = plot_runs([out_dir / "demo-results.json"], out_dir / "demo.png")
    print(f"\nper-round JSON: {out_dir / 'demo-results.json'}\nplots:          {plot}")
    if args.transport == "grpc":
        print(f"database:       {url}")
        print(f"dashboard:      .venv/bin/fedatoms dashboard serve --database-url {url}")
    return 0


def _start_dashboard(url: str, port: int) -> tuple[str, Any] | None:
    """The dashboard on a background thread, or None (with a note) when the port is taken."""
    import socket
    import threading

    import uvicorn

    from dashboard_api.app import create_app
    from dashboard_api.settings import DashboardSettings

    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            print(f"port {port} is taken: no dashboard for this demo (use --dashboard-port)")
            return None
    app = create_app(DashboardSettings(database_url=url))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="dashboard", daemon=True)
    thread.start()

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}/", stop


def _settings(args: argparse.Namespace) -> Any:
    from aggregator_service.config import AggregatorSettings

    overrides = {"listen": getattr(args, "listen", None), "database_url": args.database_url}
    if getattr(args, "config", None) is not None:
        return AggregatorSettings.from_toml(args.config, **overrides)
    return AggregatorSettings(**{k: v for k, v in overrides.items() if v is not None})


def cmd_aggregator_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from aggregator_service.server import serve

    try:
        settings = _settings(args)
    except ValidationError as exc:
        raise ValueError(f"invalid aggregator settings: {exc}") from exc
    return serve(settings)


def _database_url(args: argparse.Namespace) -> str:
    return str(_settings(args).database_url)


def cmd_aggregator_revoke(args: argparse.Namespace) -> int:
    from aggregator_service.export import revoke

    revoke(_database_url(args), args.client)
    print(f"client {args.client} revoked: its next call answers UNAUTHENTICATED")
    return 0


def cmd_aggregator_rebind(args: argparse.Namespace) -> int:
    from aggregator_service.export import rebind_certificate

    digest = rebind_certificate(_database_url(args), args.client, args.client_cert)
    print(f"client {args.client} bound to certificate sha256 {digest}: other certificates get PERMISSION_DENIED")
    return 0


def cmd_aggregator_export(args: argparse.Namespace) -> int:
    from aggregator_service.export import export_global_model

    settings = _settings(args)
    path = export_global_model(settings.database_url, args.round, args.output, settings.federation_name)
    print(f"global model after round {args.round} written to {path}")
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from aggregator_service import store

    url = _database_url(args)
    store.upgrade(url)
    print(f"{url}: schema at {store.head_revision()}")
    return 0


def _add_aggregator_commands(sub: Any) -> None:
    db_help = "database URL [FEDATOMS_DATABASE_URL, else sqlite:///fedatoms.db]"
    agg = sub.add_parser("aggregator", help="run and administer the gRPC aggregator")
    agg_sub = agg.add_subparsers(dest="aggregator_command", required=True)

    serve = agg_sub.add_parser("serve", help="serve a federation over gRPC (defaults: 127.0.0.1:50051, a demo)")
    serve.add_argument("--config", type=Path, help="TOML file: service keys, and the method under [federation]")
    serve.add_argument("--listen", help="HOST:PORT to listen on [127.0.0.1:50051]")
    serve.add_argument("--database-url", help=db_help)
    serve.set_defaults(func=cmd_aggregator_serve)

    revoke = agg_sub.add_parser("revoke", help="revoke a client's token (works while the server runs)")
    revoke.add_argument("client", help="client id, as shown in the server log and the dashboard")
    revoke.add_argument("--config", type=Path, help="the server's TOML file (for its database_url)")
    revoke.add_argument("--database-url", help=db_help)
    revoke.set_defaults(func=cmd_aggregator_revoke)

    rebind = agg_sub.add_parser(
        "rebind", help="mutual TLS: bind a client's token to its renewed certificate (works while the server runs)"
    )
    rebind.add_argument("client", help="client id, as shown in the server log and the dashboard")
    rebind.add_argument("--client-cert", type=Path, required=True, help="the client's new certificate (PEM)")
    rebind.add_argument("--config", type=Path, help="the server's TOML file (for its database_url)")
    rebind.add_argument("--database-url", help=db_help)
    rebind.set_defaults(func=cmd_aggregator_rebind)

    export = agg_sub.add_parser("export", help="write the global model of the last closed round as safetensors")
    export.add_argument("--round", type=int, required=True, help="the last closed round (the model it produced)")
    export.add_argument("output", help="OUT.safetensors")
    export.add_argument("--config", type=Path, help="the server's TOML file (database_url, federation_name)")
    export.add_argument("--database-url", help=db_help)
    export.set_defaults(func=cmd_aggregator_export)

    db = sub.add_parser("db", help="database maintenance")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_sub.add_parser("upgrade", help="migrate the database to the newest schema")
    upgrade.add_argument("--config", type=Path, help="the server's TOML file (for its database_url)")
    upgrade.add_argument("--database-url", help=db_help)
    upgrade.set_defaults(func=cmd_db_upgrade)


def cmd_client_run(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from client_agent.agent import EXIT_CODES, Agent
    from client_agent.pool import Population
    from client_agent.profile import declared_profile, measured_profile
    from client_agent.transport import AggregatorClient, Backoff
    from fedwire.allocator import reuse_message_buffers

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    reuse_message_buffers()
    if not 0 <= args.partition_index < args.num_partitions:
        raise ValueError(f"--partition-index must be in [0, {args.num_partitions}), got {args.partition_index}")
    pop = Population(
        args.dataset,
        args.data_dir,
        args.num_partitions,
        (1.0,),
        args.partition,
        args.classes_per_client,
        args.dirichlet_alpha,
        args.seed,
    )
    vc = pop.build()[args.partition_index]
    if args.profile is not None:
        profile = declared_profile(args.profile, len(vc.train))
    elif args.measure:
        profile = measured_profile(len(vc.train), budget_ms=args.budget_ms)
    else:
        from fedcore.tiers import CapabilityProfile

        profile = CapabilityProfile(num_samples=len(vc.train))
    client = AggregatorClient(
        args.server,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        backoff=Backoff(max_elapsed=args.give_up_after),
    )
    agent = Agent(
        client,
        args.state_dir,
        vc.train,
        vc.test,
        profile=profile,
        enrollment_secret=args.enrollment_secret or "",
        name=args.name,
        progress=not args.no_progress,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    code = agent.run(stop)
    client.close()
    if code == EXIT_CODES["unauthenticated"]:
        print(
            "fedatoms client: the aggregator refused this client (wrong enrollment secret, or the token was revoked)",
            file=sys.stderr,
        )
    return code


def _add_client_commands(sub: Any) -> None:
    import os

    client = sub.add_parser("client", help="run a client agent on an edge device")
    client_sub = client.add_subparsers(dest="client_command", required=True)
    run = client_sub.add_parser(
        "run",
        help="register (once), then train for the federation until it is done",
        description="Exit codes: 0 done, 2 bad arguments, 3 refused by the aggregator (secret/token), "
        "4 aggregator unreachable for --give-up-after seconds, 5 local training diverged, 130 interrupted.",
    )
    run.add_argument("--server", required=True, help="aggregator HOST:PORT")
    run.add_argument(
        "--enrollment-secret",
        default=os.environ.get("FEDATOMS_ENROLLMENT_SECRET"),
        help="the federation's enrollment secret (first run only) [FEDATOMS_ENROLLMENT_SECRET]",
    )
    run.add_argument("--dataset", default="digits", help="digits (bundled), mnist, fashion-mnist, cifar10, cifar100")
    run.add_argument("--data-dir", help="where torchvision datasets live")
    run.add_argument("--partition-index", type=int, required=True, help="which shard of the dataset is this device's")
    run.add_argument("--num-partitions", type=int, default=10, help="how many shards the dataset is cut into [10]")
    run.add_argument("--partition", default="shards", choices=["iid", "shards", "dirichlet"])
    run.add_argument("--classes-per-client", type=int, default=2)
    run.add_argument("--dirichlet-alpha", type=float, default=0.5)
    run.add_argument("--seed", type=int, default=0, help="partition seed (the same on every device)")
    run.add_argument("--state-dir", required=True, help="token, tensors and progress; reuse it to resume")
    run.add_argument("--name", help="a label for the dashboard [the server makes one]")
    g = run.add_mutually_exclusive_group()
    g.add_argument("--profile", type=Path, help="declared capability profile (TOML with CapabilityProfile keys)")
    g.add_argument("--measure", action="store_true", help="measure compute and memory before registering")
    run.add_argument("--budget-ms", type=float, default=20.0, help="with --measure: training time per sample allowed")
    run.add_argument("--tls-ca", type=Path, help="CA bundle that signed the aggregator's certificate (enables TLS)")
    run.add_argument("--tls-cert", type=Path, help="client certificate, for mutual TLS")
    run.add_argument("--tls-key", type=Path, help="client key, for mutual TLS")
    run.add_argument(
        "--give-up-after", type=float, default=None, help="exit 4 after this many seconds unreachable [never]"
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar per local epoch")
    run.add_argument("-v", "--verbose", action="store_true")
    run.set_defaults(func=cmd_client_run)


def _add_dashboard_commands(sub: Any) -> None:
    from dashboard_api.cli import add_parser

    add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedatoms",
        description="Federated learning with filter atoms, FedHM low-rank tiers and FedLAMA intervals.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="run a whole federation on this machine and record every round")
    _add_simulation_flags(sim)
    sim.add_argument("--quiet-json", action="store_true", help="do not print the summary JSON")
    g = sim.add_argument_group("--transport grpc")
    g.add_argument("--server", help="HOST:PORT of a running aggregator (default: start one on a loopback port)")
    g.add_argument("--database-url", help="the aggregator's database [a new SQLite file, printed at start]")
    g.add_argument("--enrollment-secret", help="with --server: that federation's secret")
    g.add_argument("--workers", type=int, help="worker processes running the virtual clients [2]")
    g.add_argument("--state-dir", help="where each virtual client keeps its state [a new temporary directory]")
    g.add_argument("--tls-ca", help="with --server: CA bundle to verify the aggregator's certificate")
    sim.set_defaults(func=cmd_simulate)

    plot = sub.add_parser("plot", help="plot accuracy, bytes, dispersion and intervals of simulation results")
    plot.add_argument("results", nargs="+", help="results JSON files from `fedatoms simulate --output`")
    plot.add_argument("-o", "--output", default="fedatoms-runs.png", help="PNG to write")
    plot.set_defaults(func=cmd_plot)

    demo = sub.add_parser("demo", help="the end-to-end demo that `make demo` runs")
    demo.add_argument("--rounds", type=int, default=20)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--output-dir", default="demo-output")
    demo.add_argument("--transport", choices=["grpc", "inprocess"], default="grpc")
    demo.add_argument("--dashboard-port", type=int, default=8080)
    demo.add_argument("--no-dashboard", action="store_true")
    demo.set_defaults(func=cmd_demo)

    _add_aggregator_commands(sub)
    _add_client_commands(sub)
    _add_dashboard_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"fedatoms: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
