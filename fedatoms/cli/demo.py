"""`fedatoms demo`: the end-to-end demo, a federation on digits with the dashboard watching it."""

from __future__ import annotations

import argparse
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedatoms.cli.simulate import print_comparison, print_summary, progress_printer

__all__ = ["add_parser"]


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
        bar = progress_printer(config.rounds)
        results = run_simulation(config, progress=bar, on_start=bar.start, **options)
    finally:
        if dashboard is not None:
            dashboard[1]()
    write_results(results, out_dir / "demo-results.json")
    print_summary(results)
    # plain FedAvg on the same split and seed, in process: the curve the atoms federation is judged against
    baseline = replace(
        config,
        factorization="none",
        interval_policy="every_round",
        tiers=[1.0],
        personal_atoms=False,
        personal_epochs=None,
        transport="inprocess",
        output=str(out_dir / "demo-fedavg.json"),
    )
    print(f"\nplain FedAvg on the same split and seed ({baseline.rounds} rounds, in process):")
    bar = progress_printer(baseline.rounds)
    fedavg = run_simulation(baseline, progress=bar, on_start=bar.start)
    write_results(fedavg, out_dir / "demo-fedavg.json")
    print_comparison(results, fedavg)
    plot = plot_runs([out_dir / "demo-results.json", out_dir / "demo-fedavg.json"], out_dir / "demo.png")
    print(f"\nper-round JSON: {out_dir / 'demo-results.json'}, {out_dir / 'demo-fedavg.json'}\nplots:          {plot}")
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


def add_parser(sub: Any) -> None:
    demo = sub.add_parser("demo", help="the end-to-end demo that `make demo` runs")
    demo.add_argument("--rounds", type=int, default=20)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--output-dir", default="demo-output")
    demo.add_argument("--transport", choices=["grpc", "inprocess"], default="grpc")
    demo.add_argument("--dashboard-port", type=int, default=8080)
    demo.add_argument("--no-dashboard", action="store_true")
    demo.set_defaults(func=cmd_demo)
