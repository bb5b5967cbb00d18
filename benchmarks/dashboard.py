"""Dashboard latency with a long federation: p50/p99 of /api/v1/rounds, /bandwidth and /metrics, 50 concurrent.

Fills a database with 10,000 closed rounds (metrics, 10 tensors' metrics each, a cohort of 10 whose
every member fetched, pushed and evaluated: 30 rows of the ``transfers`` ledger a round, and the
round's sums in ``round_bytes``) and 10,000 clients through the store's ORM models (bulk inserts),
starts the dashboard as a real
uvicorn process on a loopback port, and fires requests from an httpx async client. SQLite always;
PostgreSQL too when ``--postgres-url`` or ``FEDATOMS_TEST_POSTGRES_URL`` is given (in a scratch
schema, dropped afterwards).

    .venv/bin/python benchmarks/dashboard.py [--rounds 10000] [--clients 10000] [--requests 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from sqlalchemy import insert

from aggregator_service import store

TENSORS = [
    ("conv1.atoms", "atoms"),
    ("conv1.coefficients", "coefficients"),
    ("conv1.bias", "body"),
    ("conv2.atoms", "atoms"),
    ("conv2.coefficients", "coefficients"),
    ("conv2.bias", "body"),
    ("fc1.weight", "body"),
    ("fc1.bias", "body"),
    ("head.weight", "head"),
    ("head.bias", "head"),
]
COHORT = 10
CHUNK = 5_000


def _chunks(rows: list[dict], size: int = CHUNK) -> Iterator[list[dict]]:
    for i in range(0, len(rows), size):
        yield rows[i : i + size]


def fill(url: str, rounds: int, clients: int) -> None:
    """A federation of ``rounds`` closed rounds and ``clients`` clients, written with bulk inserts."""
    rng = random.Random(0)
    store.upgrade(url)
    engine = store.create_engine_for(url)
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    try:
        with store.session_factory(engine).begin() as s:
            fed = store.create_federation(s, "default", {"model": "digits-cnn", "rounds": rounds}, "x", iterations=1)
            fed.current_round = rounds + 1
            fid = fed.id
            ids = [uuid.UUID(int=rng.getrandbits(128)).hex for _ in range(clients)]
            client_rows = [
                {
                    "id": cid,
                    "federation_id": fid,
                    "name": f"device-{i}",
                    "number": i,
                    "token_hash": uuid.UUID(int=rng.getrandbits(128)).hex * 2,
                    "profile": {"num_samples": 100},
                    "tier": rng.choice((1.0, 0.5, 0.25, 0.125)),
                    "registered_at": t0 + timedelta(seconds=i),
                    "last_seen": t0 + timedelta(seconds=i),
                    "rounds_joined": rng.randrange(rounds),
                    "bytes_up": rng.randrange(10**9),
                    "bytes_down": rng.randrange(10**9),
                    "last_accuracy": rng.random(),
                }
                for i, cid in enumerate(ids)
            ]
            for part in _chunks(client_rows):
                s.execute(insert(store.Client), part)
            print(f"  {clients} clients", flush=True)
            s.execute(
                insert(store.GlobalTensor),
                [
                    {
                        "federation_id": fid,
                        "name": n,
                        "version": rounds,
                        "interval": 1,
                        "dtype": "float32",
                        "shape": [0],
                        "data": b"",
                    }
                    for n, _ in TENSORS
                ],
            )
            round_rows, metric_rows, tensor_rows = [], [], []
            for r in range(1, rounds + 1):
                opened = t0 + timedelta(seconds=30 * r)
                duration = rng.uniform(1, 60)
                round_rows.append(
                    {
                        "federation_id": fid,
                        "number": r,
                        "state": "closed",
                        "cohort": rng.sample(ids, COHORT),
                        "due": [n for n, _ in TENSORS],
                        "deadline": opened + timedelta(minutes=5),
                        "opened_at": opened,
                        "closed_at": opened + timedelta(seconds=duration),
                        "reported": COHORT,
                    }
                )
                metric_rows.append(
                    {
                        "federation_id": fid,
                        "round": r,
                        "test_accuracy": rng.random(),
                        "test_loss": rng.random() * 2,
                        "dispersion": rng.random() * 10,
                        "latent_clients": 72,
                        "bytes_up": rng.randrange(10**7),
                        "bytes_down": rng.randrange(10**7),
                        "fedavg_equivalent_bytes": 2 * 10**7,
                        "duration_seconds": duration,
                    }
                )
                tensor_rows += [
                    {
                        "federation_id": fid,
                        "round": r,
                        "name": n,
                        "ordinal": i,
                        "role": role,
                        "d_l": rng.random(),
                        "dispersion": rng.random(),
                        "interval": rng.choice((1, 2)),
                        "bytes_down": 1000,
                        "bytes_up": 1000,
                        "version": r,
                    }
                    for i, (n, role) in enumerate(TENSORS)
                ]
            for part in _chunks(round_rows):
                s.execute(insert(store.Round), part)
            for part in _chunks(metric_rows):
                s.execute(insert(store.RoundMetrics), part)
            print(f"  {rounds} rounds with metrics", flush=True)
            for part in _chunks(tensor_rows):
                s.execute(insert(store.TensorMetric), part)
            print(f"  {len(tensor_rows)} tensor metrics", flush=True)
            transfer_rows, sums = [], {}
            for rnd in round_rows:
                for cid in rnd["cohort"]:
                    for category, direction in store.TRANSFER_CATEGORIES.items():
                        nbytes = rng.randrange(10**6)
                        transfer_rows.append(
                            {
                                "federation_id": fid,
                                "round": rnd["number"],
                                "client_id": cid,
                                "category": category,
                                "direction": direction,
                                "bytes": nbytes,
                                "fedavg_equivalent_bytes": 10**6,
                            }
                        )
                        b, f = sums.get((rnd["number"], category), (0, 0))
                        sums[(rnd["number"], category)] = (b + nbytes, f + 10**6)
            for part in _chunks(transfer_rows):
                s.execute(insert(store.Transfer), part)
            s.execute(
                insert(store.RoundBytes),
                [
                    {"federation_id": fid, "round": r, "category": c, "bytes": b, "fedavg_equivalent_bytes": f}
                    for (r, c), (b, f) in sums.items()
                ],
            )
            print(f"  {len(transfer_rows)} transfers", flush=True)
            eval_rows = [
                {
                    "federation_id": fid,
                    "round": r,
                    "client_id": cid,
                    "global_accuracy": rng.random(),
                    "global_loss": rng.random(),
                    "personalized_accuracy": rng.random(),
                    "num_samples": 100,
                    "reported_at": t0,
                }
                for r in range(max(1, rounds - 99), rounds + 1)
                for cid in rng.sample(ids, COHORT)
            ]
            s.execute(insert(store.Evaluation), eval_rows)
            print(f"  {len(eval_rows)} evaluations", flush=True)
    finally:
        engine.dispose()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve(url: str) -> Iterator[str]:
    """The dashboard as its own uvicorn process, as an operator runs it."""
    port = _free_port()
    env = {**os.environ, "FEDATOMS_DASHBOARD_DATABASE_URL": url, "FEDATOMS_DASHBOARD_LISTEN": f"127.0.0.1:{port}"}
    code = (
        "import uvicorn; from dashboard_api.app import create_app;"
        f"uvicorn.run(create_app(), host='127.0.0.1', port={port}, log_level='warning', timeout_keep_alive=60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the dashboard did not become ready")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=20)


async def _load(base: str, path: str, requests: int, concurrency: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    errors: list[str] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                t = time.perf_counter()
                try:
                    r = await client.get(path)
                except httpx.TransportError:  # a dropped connection under load: retried, and counted
                    errors.append(path)
                    r = await client.get(path)
                latencies.append(time.perf_counter() - t)
                if r.status_code != 200:
                    raise RuntimeError(f"{path}: {r.status_code} {r.text[:200]}")

        for _ in range(20):  # warm the connection pools
            await client.get(path)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        if errors:
            print(f"  {len(errors)} requests to {path} retried after a dropped connection", flush=True)
        return latencies, time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] * 1000


def bench(name: str, url: str, args: argparse.Namespace) -> list[tuple[str, ...]]:
    print(f"{name}: filling {args.rounds} rounds and {args.clients} clients …", flush=True)
    t = time.perf_counter()
    fill(url, args.rounds, args.clients)
    print(f"  filled in {time.perf_counter() - t:.1f} s; starting the dashboard", flush=True)
    rows: list[tuple[str, ...]] = []
    with serve(url) as base:
        for path in args.paths:
            lat, wall = asyncio.run(_load(base, path, args.requests, args.concurrency))
            row = (name, path, f"{_pct(lat, 50):.1f}", f"{_pct(lat, 99):.1f}", f"{len(lat) / wall:.0f}")
            print("  " + "  ".join(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10_000)
    p.add_argument("--clients", type=int, default=10_000)
    p.add_argument("--requests", type=int, default=1_000, help="requests per endpoint")
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--postgres-url", default=os.environ.get("FEDATOMS_TEST_POSTGRES_URL"))
    p.add_argument(
        "--paths",
        nargs="+",
        default=["/api/v1/rounds", "/api/v1/rounds?order=desc&limit=20", "/api/v1/bandwidth", "/metrics"],
    )
    args = p.parse_args()
    rows: list[tuple[str, ...]] = []
    with tempfile.TemporaryDirectory() as tmp:
        rows += bench("sqlite", f"sqlite:///{Path(tmp) / 'bench.db'}", args)
    if args.postgres_url:
        with store.scratch_schema(args.postgres_url) as url:
            rows += bench("postgresql", url, args)
    else:
        print("PostgreSQL skipped: pass --postgres-url or set FEDATOMS_TEST_POSTGRES_URL")
    header = ("backend", "endpoint", "p50 ms", "p99 ms", "req/s")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(
        f"\n{args.rounds} rounds, {args.clients} clients, {args.requests} requests per endpoint, "
        f"{args.concurrency} concurrent"
    )
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
