"""`fedatoms client run`: one client agent on an edge device, until its federation is done."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser"]


def cmd_client_run(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from aggregator_service.logfmt import configure_logging
    from client_agent.agent import EXIT_CODES, Agent
    from client_agent.profile import declared_profile, measured_profile
    from client_agent.transport import AggregatorClient, Backoff
    from fedwire.allocator import reuse_message_buffers

    _check_server(args.server)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be ≥ 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    if args.device is not None:  # as `fedatoms simulate --device`: refused in one line, before anything registers
        from fedcore.training import resolve_device

        resolve_device(args.device)
    if args.min_link_kbps is not None and not args.min_link_kbps > 0:
        raise ValueError(f"--min-link-kbps must be > 0, got {args.min_link_kbps}")
    train, test = _local_data(args)
    if args.profile is not None:
        profile = declared_profile(args.profile, len(train))
    elif args.measure:
        profile = measured_profile(len(train), budget_ms=args.budget_ms, device=args.device or "auto")
    else:
        from fedcore.tiers import CapabilityProfile

        profile = CapabilityProfile(num_samples=len(train))
    _check_writable(Path(args.state_dir))  # the last check: it creates the directory
    configure_logging(logging.DEBUG if args.verbose else logging.INFO)
    reuse_message_buffers()
    client = AggregatorClient(
        args.server,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        backoff=Backoff(max_elapsed=args.give_up_after),
        **({} if args.min_link_kbps is None else {"min_link_bytes_per_second": args.min_link_kbps * 1000 / 8}),
    )
    agent = Agent(
        client,
        args.state_dir,
        train,
        test,
        profile=profile,
        enrollment_secret=args.enrollment_secret or "",
        name=args.name,
        progress=not args.no_progress,
        allowed_models=allowed_models(args.allow_model),
        device=args.device,
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


def _local_data(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(train, test)`` of ``--data``, or of its ``--partition-index`` shard; read lazily, fitted after Register."""
    from client_agent.pool import Population
    from fedcore.datasource import describe, open_data

    kind = describe(args.data)
    if args.download and kind != "bundled":
        raise ValueError(f"--download fetches a benchmark (mnist, cifar10, …); --data {args.data} is not one")
    if args.partition_index is not None and not 0 <= args.partition_index < args.num_partitions:
        raise ValueError(f"--partition-index must be in [0, {args.num_partitions}), got {args.partition_index}")
    if args.download:  # fetched once into --data-dir; read below as any local copy
        from fedcore.data import load_dataset

        load_dataset(args.data, args.data_dir, download=True)
    if args.partition_index is None:
        if kind == "bundled":
            raise ValueError(f"--data {args.data} is a benchmark dataset: give --partition-index (this device's shard)")
        return open_data(args.data, args.data_dir)
    pop = Population(
        args.data,
        args.data_dir,
        args.num_partitions,
        (1.0,),
        args.partition,
        args.classes_per_client,
        args.dirichlet_alpha,
        args.seed,
    )
    vc = pop.build()[args.partition_index]
    return vc.train, vc.test


def allowed_models(flags: list[str] | None) -> tuple[str, ...]:
    """``--allow-model`` values: unset, the default list; ``none``, the zoo only; else exactly those given."""
    from client_agent.allowed_models import DEFAULT_ALLOWED_MODELS

    if not flags:
        return DEFAULT_ALLOWED_MODELS
    return tuple(f for f in flags if f != "none")


def _check_server(server: str) -> None:
    """HOST:PORT, refused without a port: gRPC would dial 443 and retry a closed port for minutes."""
    from aggregator_service.listen import split_listen

    try:
        split_listen(server)
    except ValueError:
        raise ValueError(
            f"--server needs HOST:PORT (e.g. 127.0.0.1:50051 or aggregator.example:443), got {server!r}"
        ) from None


def _check_writable(state_dir: Path) -> None:
    """Before registering: an agent that cannot save its credentials would leave an orphan client behind."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        probe = state_dir / ".write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--state-dir {state_dir} cannot be written ({exc.strerror}); nothing was registered") from exc


def add_parser(sub: Any) -> None:
    import os

    client = sub.add_parser("client", help="run a client agent on an edge device")
    client_sub = client.add_subparsers(dest="client_command", required=True)
    run = client_sub.add_parser(
        "run",
        help="register (once), then train for the federation until it is done",
        description="Exit codes: 0 done, 2 bad arguments, 3 refused by the aggregator (secret/token), "
        "4 aggregator unreachable for --give-up-after seconds, 5 local training diverged, 6 out of memory (the tier "
        "does not fit this device: enroll anew declaring a smaller memory_bytes), 130 interrupted.",
    )
    run.add_argument("--server", required=True, help="aggregator HOST:PORT")
    run.add_argument(
        "--enrollment-secret",
        default=os.environ.get("FEDATOMS_ENROLLMENT_SECRET"),
        help="the federation's enrollment secret (first run only) [FEDATOMS_ENROLLMENT_SECRET]",
    )
    run.add_argument(
        "--data",
        "--dataset",
        dest="data",
        default="digits",
        help="this device's data: an ImageFolder directory (one subfolder per class; train/ and test/ inside, or "
        "a 20%% holdout is the test split), an import reference module:function returning (train, test) torch "
        "Datasets, or a benchmark: digits (bundled), mnist, fashion-mnist, cifar10, cifar100 [digits]",
    )
    run.add_argument("--data-dir", help="where torchvision datasets live")
    run.add_argument(
        "--download", action="store_true", help="fetch a torchvision benchmark into --data-dir if it is not there"
    )
    run.add_argument(
        "--partition-index",
        type=int,
        help="train on this shard of --data (required for a benchmark dataset) [all of a folder or reference]",
    )
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
    run.add_argument(
        "--min-link-kbps",
        type=float,
        default=None,
        help="the slowest link a fetch or push is given time for before it is cut and retried "
        "(its deadline: 120 s plus its bytes at this rate; a keepalive ping's ack, 1.25 x 256 KiB at this rate, "
        "at least 60 s) [8]",
    )
    run.add_argument(
        "--allow-model",
        action="append",
        metavar="MODULE",
        help="model code the aggregator may make this client import, as a module prefix or a full reference; "
        "repeat for several [the zoo and torchvision.models; 'none': the zoo only]",
    )
    run.add_argument(
        "--threads",
        type=int,
        help="torch threads for training and evaluation [one per core]; 1 when several clients share a machine",
    )
    run.add_argument(
        "--device",
        help="the torch device this client trains and evaluates on: auto (CUDA when available, else CPU), cpu, "
        "cuda or cuda:N [auto]",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar per local epoch")
    run.add_argument("-v", "--verbose", action="store_true")
    run.set_defaults(func=cmd_client_run)
