"""Heartbeat latency of enrolled clients, idle and under a flood of wrong-secret Register calls.

Three processes: the aggregator (production PBKDF2 iterations, default workers), the flood (``--threads``
threads calling Register with a wrong secret as fast as they are answered) and this one, which times
enrolled clients' Heartbeats. Target (issue 18, item 5): p99 under the flood ≤ 2 × idle p99.

What keeps the flood off the CPU is the tarpit (``aggregator_service/tarpit.py``): past a burst of 5,
each refusal to the flooding host is held ``refusal_delay_seconds`` on a thread beyond the workers, so
the flood's threads wait instead of calling. ``--refusal-delay 0`` runs the aggregator without it (every
refusal answered at once), for the figure it replaces.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/register_flood.py [--refusal-delay 0]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from aggregator_service import store
from aggregator_service.config import AggregatorSettings, FederationConfig
from aggregator_service.coordinator import Coordinator
from aggregator_service.server import build_server
from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

SECRET = "bench-enrollment-secret"


def serve(url: str, refusal_delay: float | None) -> None:
    settings = AggregatorSettings(
        listen="127.0.0.1:0",
        database_url=url,
        enrollment_secret=SECRET,
        **({} if refusal_delay is None else {"refusal_delay_seconds": refusal_delay}),
        federation=FederationConfig(model="digits-cnn", min_clients=100, rounds=1),
    )
    store.upgrade(url)
    coordinator = Coordinator(settings, store.session_factory(store.create_engine_for(url)))
    server, port, _ = build_server(settings, coordinator)
    server.start()
    print(f"port {port}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop(grace=None)


def flood(port: int, threads: int) -> None:
    """Wrong-secret Register calls from ``threads`` threads until stdin closes; prints the codes' counts."""
    stub = pb_grpc.AggregatorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    stop = threading.Event()
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def loop() -> None:
        request = pb.RegisterRequest(profile=pb.CapabilityProfile(num_samples=10), enrollment_secret="a-guess")
        while not stop.is_set():
            try:
                stub.Register(request, timeout=30)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            with lock:
                counts[code] = counts.get(code, 0) + 1

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    print("flooding", flush=True)
    sys.stdin.read()
    stop.set()
    for w in workers:
        w.join()
    print(" ".join(f"{k}={v}" for k, v in sorted(counts.items())), flush=True)


def heartbeats(stub: pb_grpc.AggregatorStub, auths: list, n: int) -> list[float]:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        stub.Heartbeat(pb.HeartbeatRequest(), metadata=auths[i % len(auths)], timeout=30)
        times.append(time.perf_counter() - t0)
    return times


def summary(times: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(times, n=100)
    return q[49] * 1e3, q[98] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=48, help="flood threads (wrong-secret Register calls)")
    parser.add_argument("--clients", type=int, default=4, help="enrolled clients whose Heartbeats are timed")
    parser.add_argument("--beats", type=int, default=500, help="Heartbeats timed in each phase")
    parser.add_argument(
        "--refusal-delay",
        type=float,
        help="the aggregator refusal_delay_seconds (unset: its default; 0: no tarpit)",
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--flood", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.refusal_delay)
    if args.flood:
        return flood(args.flood, args.threads)
    with tempfile.TemporaryDirectory(prefix="fedatoms-flood-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", url]
            + ([] if args.refusal_delay is None else ["--refusal-delay", str(args.refusal_delay)]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            port = int(server.stdout.readline().split()[1])
            stub = pb_grpc.AggregatorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
            profile = pb.CapabilityProfile(num_samples=10)
            auths = [
                (
                    (
                        "authorization",
                        f"Bearer {stub.Register(pb.RegisterRequest(profile=profile, enrollment_secret=SECRET)).token}",
                    ),
                )
                for _ in range(args.clients)
            ]
            heartbeats(stub, auths, 50)  # warm-up
            idle = heartbeats(stub, auths, args.beats)
            flooder = subprocess.Popen(
                [sys.executable, __file__, "--flood", str(port), "--threads", str(args.threads)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert flooder.stdout.readline().strip() == "flooding"
            time.sleep(1.0)  # let the flood reach its pace
            t0 = time.perf_counter()
            flooded = heartbeats(stub, auths, args.beats)
            elapsed = time.perf_counter() - t0
            flooder.stdin.close()
            codes = flooder.stdout.read().strip()
            flooder.wait()
        finally:
            server.stdin.close()
            server.wait()
    (p50_idle, p99_idle), (p50_flood, p99_flood) = summary(idle), summary(flooded)
    print(f"Heartbeat, {args.clients} enrolled clients, {args.beats} calls per phase")
    print(f"  idle:  p50 {p50_idle:.2f} ms  p99 {p99_idle:.2f} ms")
    print(f"  flood: p50 {p50_flood:.2f} ms  p99 {p99_flood:.2f} ms  ({args.threads} threads of wrong-secret Register)")
    delay = AggregatorSettings().refusal_delay_seconds if args.refusal_delay is None else args.refusal_delay
    print(f"  flood answers over the whole flood (~{elapsed + 1:.1f} s, refusal_delay_seconds = {delay:g}): {codes}")
    print(f"  p99 ratio flood/idle: {p99_flood / p99_idle:.2f} (target ≤ 2)")
    print(f"  p50 ratio flood/idle: {p50_flood / p50_idle:.2f}")


if __name__ == "__main__":
    main()
