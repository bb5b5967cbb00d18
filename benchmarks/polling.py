"""Seconds per round of idle clients with the default settings: long polls against plain polls (not a test).

A real aggregator (``fedatoms aggregator serve``, its own process, default settings: a Wait tells
a plain poller to come back in 5 s) serves a federation of ``digits-cnn`` without factorization
(≈151k parameters), every client every round; ``--clients`` (default 10) real
:class:`client_agent.agent.Agent` s run in threads of this process, each with 10 digits samples
and batch size 10 (one SGD step: the clients are idle, what is measured is the service's
pacing), no test data (no evaluation), no state written.

The same federation runs twice, in one run of this script:

- **long poll**: the agents as shipped: a GetTask with nothing to do is held by the server
  (``wait_seconds`` = 30 s) and answered the moment a task is ready;
- **plain poll**: the agents with ``long_poll_seconds=0``, i.e. as before long polls: a Wait
  sends them back in the retry-after (5 s by default);
- **plain poll every 0.05 s**: the same, against a server whose retry-after is 0.05 s
  (``poll_interval_seconds``): the issue's reference (0.18–0.24 s a round where it was filed), i.e.
  what a round costs with (almost) no polling floor on this machine.

A round's time is the time between consecutive closes (the ``closed_at`` column of the
``rounds`` table, written in the closing transaction), rounds 2… (round 1 includes start-up).
Target: long poll ≤ 0.3 s per round (median); printed too: long poll ÷ the 0.05 s poll, in the
same run (≤ 1: the long poll leaves no polling floor, what remains is the round's own work).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/polling.py [--clients 10] [--rounds 8]
"""

from __future__ import annotations

import argparse
import itertools
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TARGET = 0.3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(
    workdir: Path, clients: int, rounds: int, poll_interval: float | None = None
) -> tuple[subprocess.Popen[bytes], str, str]:
    """``fedatoms aggregator serve`` with default settings but the federation (and ``poll_interval``, the
    retry-after, when given); its process, target, database URL."""
    port = free_port()
    url = f"sqlite:///{workdir / 'fedatoms.db'}"
    config = workdir / "aggregator.toml"
    config.write_text(
        f'listen = "127.0.0.1:{port}"\n'
        f'database_url = "{url}"\n'
        + (f"poll_interval_seconds = {poll_interval}\n" if poll_interval is not None else "")
        + "[federation]\n"
        'model = "digits-cnn"\nfactorization = "none"\ntiers = [1.0]\n'
        f"fraction = 1.0\nmin_clients = {clients}\nrounds = {rounds}\nbatch_size = 10\nlocal_epochs = 1\n"
    )
    log = (workdir / "aggregator.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedatoms", "aggregator", "serve", "--config", str(config)], stdout=log, stderr=log
    )
    return proc, f"127.0.0.1:{port}", url


def wait_serving(target: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the aggregator exited with {proc.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.2)
    raise TimeoutError("the aggregator did not start serving")


def rounds_times(url: str) -> list[tuple[float, float]]:
    """The closed rounds' ``(opened_at, closed_at)`` times, in round order (seconds)."""
    from sqlalchemy import select

    from aggregator_service import store

    engine = store.create_engine_for(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(store.Round.opened_at, store.Round.closed_at)
                .where(store.Round.state == "closed")
                .order_by(store.Round.number)
            ).all()
    finally:
        engine.dispose()
    return [(o.timestamp(), c.timestamp()) for o, c in rows]


def run(clients: int, rounds: int, long_poll: float, poll_interval: float | None = None) -> list[tuple[float, float]]:
    """One federation to its end; per round from round 2 on, the seconds since the previous close until its
    close and until its opening."""
    import numpy as np

    from aggregator_service.config import DEMO_ENROLLMENT_SECRET
    from client_agent.agent import Agent
    from client_agent.transport import AggregatorClient
    from fedcore.data import load_dataset

    train, _ = load_dataset("digits")
    with tempfile.TemporaryDirectory(prefix="fedatoms-polling-") as tmp:
        workdir = Path(tmp)
        proc, target, url = serve(workdir, clients, rounds, poll_interval)
        try:
            wait_serving(target, proc)
            codes: list[int] = []
            agents = [
                Agent(
                    AggregatorClient(target),
                    workdir / f"client{i}",
                    train.subset(np.arange(10 * i, 10 * i + 10)),
                    durable=False,
                    keep_state=False,
                    enrollment_secret=DEMO_ENROLLMENT_SECRET,
                    long_poll_seconds=long_poll,
                )
                for i in range(clients)
            ]
            threads = [threading.Thread(target=lambda a=a: codes.append(a.run())) for a in agents]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=rounds * 30 + 60)
            for a in agents:
                a.stop.set()
            if codes != [0] * clients:
                print((workdir / "aggregator.log").read_text()[-3000:])
                raise RuntimeError(f"agents exited with {codes}")
            for a in agents:
                a.client.close()
            times = rounds_times(url)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    # round r's time: from round r−1's close to round r's, split at r's opening
    return [(c - pc, o - pc) for (_, pc), (o, c) in itertools.pairwise(times)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    print(f"{args.clients} clients, digits-cnn (none), {args.rounds} rounds, default aggregator settings", flush=True)
    results = {}
    for label, wait, interval in (
        ("long poll (30 s)", 30.0, None),
        ("plain poll", 0.0, None),
        ("plain poll, 0.05 s", 0.0, 0.05),
    ):
        measured = run(args.clients, args.rounds, wait, interval)
        periods = [p for p, _ in measured]
        results[label] = statistics.median(periods)
        print(
            f"{label:18s} median {results[label]:6.3f} s/round  (range {min(periods):.3f}–{max(periods):.3f}, "
            f"{len(periods)} rounds); of it close → next round open: "
            f"{statistics.median(o for _, o in measured) * 1e3:.0f} ms",
            flush=True,
        )
    long_ = results["long poll (30 s)"]
    print(
        f"plain / long poll: {results['plain poll'] / long_:.1f}×; long poll / 0.05 s poll: "
        f"{long_ / results['plain poll, 0.05 s']:.2f}×; target long poll ≤ {TARGET} s: "
        f"{'met' if long_ <= TARGET else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
