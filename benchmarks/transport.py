"""Transport throughput of the aggregator on loopback, as ratios measured in one run (not a test).

- FetchModel and PushUpdate of the whole resnet18 (≈45 MB fp32) against a raw loopback TCP copy of
  the same bytes (target ≥ 0.5×). PushUpdate includes validation and the durable SQLite write.
- GetTask latency (p50/p99) and rate with 1,000 registered clients polling from 16 threads.

    .venv/bin/python benchmarks/transport.py [--clients 1000] [--pollers 16]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from aggregator_service import store
from aggregator_service.config import AggregatorSettings, FederationConfig
from aggregator_service.coordinator import Coordinator
from aggregator_service.server import build_server
from fedatoms import wire
from fedatoms.v1 import aggregator_pb2 as pb
from fedatoms.v1 import aggregator_pb2_grpc as pb_grpc
from fedcore import codec


def raw_copy_seconds(nbytes: int) -> float:
    """Seconds to push ``nbytes`` through a loopback TCP socket in 1 MiB writes."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    done = threading.Event()

    def sink() -> None:
        conn, _ = server.accept()
        left = nbytes
        while left:
            left -= len(conn.recv(min(left, 1 << 20)))
        conn.sendall(b"k")
        conn.close()
        done.set()

    threading.Thread(target=sink, daemon=True).start()
    payload = bytes(nbytes)
    view = memoryview(payload)
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        for off in range(0, nbytes, 1 << 20):
            c.sendall(view[off : off + (1 << 20)])
        c.recv(1)
        seconds = time.perf_counter() - t0
    server.close()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--pollers", type=int, default=16)
    ap.add_argument("--polls", type=int, default=3000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fedatoms-bench-"))
    url = f"sqlite:///{tmp / 'bench.db'}"
    fed = FederationConfig(model="resnet18", num_classes=10, fraction=1.0, min_clients=2, rounds=5)
    settings = AggregatorSettings(listen="127.0.0.1:0", database_url=url, federation=fed, deadline_seconds=3600)
    store.upgrade(url)
    coordinator = Coordinator(settings, store.session_factory(store.create_engine_for(url)), enrollment_iterations=1000)
    server, port, _ = build_server(settings, coordinator)
    server.start()
    opts = [("grpc.max_receive_message_length", 8 << 20)]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=opts)
    stub = pb_grpc.AggregatorStub(channel)
    regs = [
        stub.Register(
            pb.RegisterRequest(profile=pb.CapabilityProfile(num_samples=10), enrollment_secret="fedatoms-demo")
        )
        for _ in range(2)
    ]
    auth = (("authorization", f"Bearer {regs[0].token}"),)
    task = stub.GetTask(pb.GetTaskRequest(), metadata=auth)

    # -- FetchModel
    stub_fetch = []
    for _ in range(3):
        t0 = time.perf_counter()
        asm = codec.Reassembler()
        for msg in stub.FetchModel(pb.FetchRequest(), metadata=auth):
            asm.add(wire.to_chunk(msg))
        stub_fetch.append(time.perf_counter() - t0)
    tensors = asm.finish()
    nbytes = asm.bytes_received
    raw = min(raw_copy_seconds(nbytes) for _ in range(3))
    fetch = min(stub_fetch)

    # -- PushUpdate (the cohort has two members, so this push stores without closing the round)
    def messages():
        yield pb.PushMessage(header=pb.PushHeader(round=task.train.round, update_id=uuid.uuid4().hex, num_samples=10))
        for name in task.train.due_tensors:
            for m in wire.tensor_messages(name, tensors[name]):
                yield pb.PushMessage(chunk=m)

    t0 = time.perf_counter()
    reply = stub.PushUpdate(messages(), metadata=auth)
    push = time.perf_counter() - t0
    assert reply.accepted
    print(f"resnet18 payload {nbytes / 1e6:.1f} MB; raw loopback copy {nbytes / raw / 1e6:.0f} MB/s")
    print(f"FetchModel  {nbytes / fetch / 1e6:7.0f} MB/s  ratio to raw copy {raw / fetch:.2f}x (target >= 0.5x)")
    print(f"PushUpdate  {nbytes / push / 1e6:7.0f} MB/s  ratio to raw copy {raw / push:.2f}x (validated + stored)")

    # -- GetTask with many registered clients
    with coordinator._factory.begin() as s:  # enrol directly: PBKDF2 per Register is not measured here
        row = store.get_federation(s, "default")
        tokens = [store.register_client(s, row, {}, 1.0)[1] for _ in range(args.clients)]
    latencies: list[float] = []

    def poll(i: int) -> None:
        md = (("authorization", f"Bearer {tokens[i % len(tokens)]}"),)
        t = time.perf_counter()
        stub.GetTask(pb.GetTaskRequest(), metadata=md)
        latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.pollers) as pool:
        list(pool.map(poll, range(args.polls)))
    wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100)
    print(
        f"GetTask     {args.polls / wall:7.0f} calls/s from {args.pollers} threads over {args.clients} clients; "
        f"p50 {q[49] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms"
    )
    channel.close()
    server.stop(None)


if __name__ == "__main__":
    main()
