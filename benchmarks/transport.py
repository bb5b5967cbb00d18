"""Transport throughput of the aggregator on loopback, as ratios measured in one run (not a test).

The aggregator runs in its own process, as ``fedatoms aggregator serve`` does (this script with
``--serve``: the same ``build_server``, with ``check_tensors`` timed), and this process is the
client, with the agent's channel options and allocator setting. Sharing one process, and so
one GIL, would charge the client for the server's Python and the other way round, which no
deployment does. On 127.0.0.1, payload = the resnet18 model's tensors as they travel (float32,
≈45 MB, cut into ≤ 1 MiB chunks packed into ≤ 1 MiB batches):

- **raw copy**: the same payload bytes through a plain TCP socket between the same two processes,
  in 1 MiB ``sendall`` writes into a fresh receive buffer (``recv_into`` a ``bytearray``), in each
  transfer's direction: from the aggregator into this process (FetchModel's reference), and from
  this process into the aggregator until it acknowledges (PushUpdate's). This moves every byte
  once and is the reference (1.0×). (A receive buffer from ``np.empty``, with huge pages like the
  Reassembler's, made this copy no faster here: medians of 31-61 ms against 27-31 ms.)
- **FetchModel**: the call until the client holds the decoded arrays (``framing.fetch_model``, whose
  batches' chunks are parsed in place, + ``codec.Reassembler`` + ``finish()``, as ``client_agent``
  does).
- **PushUpdate, transport only**: the call until the server has received the stream,
  reassembled it and validated it (the server process wraps ``check_tensors`` and reports when
  it returned, on ``CLOCK_MONOTONIC``, which both processes read).
- **PushUpdate, end to end**: the same call until the client has the acknowledgement, which is
  sent only after the update is durably committed (SQLite WAL, ``synchronous=FULL``).
  The push's batches are built before the clock starts (``framing.push_messages``; client-side
  encoding is printed apart).

The transfers run interleaved ``--reps`` times (each push from another cohort member, so
every push really stores); ratios are per repetition, and the table shows their median (and
range), so load from other processes on a shared machine hits both sides of a ratio alike.
Each transfer starts once the aggregator process has been idle for 0.25 s: the WAL checkpoint it
runs after a push, off the commit path, would otherwise land in the next transfer but never in
the raw copy (its CPU is printed instead).
Target: ≥ 0.5× for FetchModel and PushUpdate. Then GetTask latency (p50/p99) and rate with
``--clients`` registered clients polling from ``--pollers`` threads.

On this 2-core machine both processes share the cores; ``--pin`` gives each one its own core (as two
machines would, though with one core each).

    .venv/bin/python benchmarks/transport.py [--reps 9] [--clients 1000] [--pollers 16] [--polls 3000] [--pin]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import grpc

import aggregator_service.coordinator.uploads as uploads_module
from aggregator_service import store
from aggregator_service.config import AggregatorSettings, FederationConfig
from aggregator_service.coordinator import Coordinator
from aggregator_service.server import build_server
from client_agent.transport import channel_options
from fedcore import codec
from fedwire import framing
from fedwire.allocator import reuse_message_buffers
from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

_RAW_REQUEST = struct.Struct("!cQ")  # b"G": the aggregator sends n bytes; b"P": it receives n bytes


def _recv_exactly(conn: socket.socket, nbytes: int) -> bytearray:
    """Receive ``nbytes`` into a fresh buffer, as a plain receiver would (``bytearray``: 4 KiB pages)."""
    buf = bytearray(nbytes)  # where the bytes must land, like the receiver's tensors
    view, got = memoryview(buf), 0
    while got < nbytes:
        n = conn.recv_into(view[got:], min(nbytes - got, 1 << 20))
        if not n:
            raise ConnectionError(f"raw copy: the peer closed after {got} of {nbytes} bytes")
        got += n
    return buf


def _send_all(conn: socket.socket, payload: memoryview) -> None:
    for off in range(0, len(payload), 1 << 20):
        conn.sendall(payload[off : off + (1 << 20)])


def raw_copy_server() -> int:
    """In the aggregator process: a plain TCP peer for the raw copies; returns its port. It sends back the
    bytes it last received (the benchmark sends the payload once first)."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = bytearray()

    def run() -> None:
        nonlocal held
        while True:
            conn, _ = listener.accept()
            with conn:
                op, nbytes = _RAW_REQUEST.unpack(conn.recv(_RAW_REQUEST.size, socket.MSG_WAITALL))
                if op == b"G":
                    _send_all(conn, memoryview(held)[:nbytes])
                else:
                    held = _recv_exactly(conn, nbytes)
                    conn.sendall(b"k")

    threading.Thread(target=run, name="raw-copy", daemon=True).start()
    return int(listener.getsockname()[1])


def raw_copy_seconds(port: int, payload: bytes, op: bytes) -> float:
    """Seconds to move ``payload``'s bytes once through loopback TCP between this process and the aggregator's:
    ``G`` from the aggregator into a fresh buffer here (FetchModel's direction), ``P`` from here into a fresh
    buffer there, until it acknowledges (PushUpdate's)."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        conn.sendall(_RAW_REQUEST.pack(op, len(payload)))
        if op == b"G":
            _recv_exactly(conn, len(payload))
        else:
            _send_all(conn, memoryview(payload))
            if conn.recv(1) != b"k":
                raise ConnectionError("raw copy: no acknowledgement")
        return time.perf_counter() - t0


def pin(cpu: int, pid: int = 0) -> None:
    """Every thread of process ``pid`` (0: this one) on ``cpu``; threads started later inherit it."""
    tasks = Path(f"/proc/{pid or os.getpid()}/task")
    for tid in [int(t) for t in os.listdir(tasks)] if tasks.exists() else [0]:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, {cpu})


def settings_for(url: str) -> AggregatorSettings:
    # fraction 1: every registered client joins round 1; one member never pushes, so it stays open
    fed = FederationConfig(model="resnet18", num_classes=10, fraction=1.0, min_clients=2, rounds=5)
    return AggregatorSettings(listen="127.0.0.1:0", database_url=url, federation=fed, deadline_seconds=3600)


def serve(url: str) -> None:
    """The aggregator process (``--serve URL``): prints its port, then one ``validated <t>`` line per
    push, ``t`` the ``time.monotonic()`` at which ``check_tensors`` returned; stops when stdin closes."""
    reuse_message_buffers()  # as `fedatoms aggregator serve` does
    settings = settings_for(url)
    store.upgrade(url)
    coordinator = Coordinator(settings, store.session_factory(store.create_engine_for(url)), enrollment_iterations=1000)
    original = uploads_module.check_tensors

    def timed(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        print(f"validated {time.monotonic()!r}", flush=True)
        return out

    uploads_module.check_tensors = timed  # type: ignore[assignment]  # push() looks it up per call
    server, port, _ = build_server(settings, coordinator)
    server.start()
    raw_port = raw_copy_server()
    print(f"port {port} {raw_port}", flush=True)
    sys.stdin.read()  # until the benchmark exits or closes our stdin
    server.stop(None)


def start_server(url: str, cpu: int | None = None) -> tuple[subprocess.Popen[str], int, int]:
    """The aggregator process, pinned to ``cpu`` (before it starts a thread) unless ``None``: its gRPC and raw
    ports."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=None if cpu is None else lambda: os.sched_setaffinity(0, {cpu}),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("port "):
        proc.kill()
        raise RuntimeError(f"the aggregator process did not start (exit code {proc.wait()})")
    _, port, raw_port = line.split()
    return proc, int(port), int(raw_port)


def validated_at(out: IO[str]) -> float:
    line = out.readline()
    if not line.startswith("validated "):
        raise RuntimeError(f"the aggregator process reported {line!r} instead of a validated push")
    return float(line.split()[1])


def settle(pid: int, quiet: float = 0.25, limit: float = 5.0) -> float:
    """Wait until the aggregator process has used no CPU for ``quiet`` seconds; returns the CPU seconds it used
    meanwhile. Work it does after an acknowledgement (the WAL checkpoint, off the commit path) would otherwise
    land in the next timed transfer but never in the raw copy it is compared with (Linux; elsewhere no wait)."""
    stat = Path(f"/proc/{pid}/stat")
    if not stat.exists():
        return 0.0
    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    start = last = cpu()
    quiet_since = time.monotonic()
    deadline = quiet_since + limit
    while time.monotonic() < deadline:
        time.sleep(0.01)
        now = cpu()
        if now != last:
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet:
            break
    return last - start


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):5.2f}x ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9, help="interleaved repetitions of raw copy, fetch and push")
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--pollers", type=int, default=16)
    ap.add_argument("--polls", type=int, default=3000)
    ap.add_argument("--pin", action="store_true", help="the aggregator and this client on a core each")
    ap.add_argument("--serve", metavar="URL", help=argparse.SUPPRESS)  # the aggregator process
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return
    tmp = Path(tempfile.mkdtemp(prefix="fedatoms-bench-"))
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ~0.4 GB of stored updates


def run(args: argparse.Namespace, tmp: Path) -> None:
    started = time.perf_counter()
    url = f"sqlite:///{tmp / 'bench.db'}"
    reuse_message_buffers()  # as `fedatoms client run` does
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pinned = args.pin and len(cpus) >= 2
    if pinned:  # a core each, like an aggregator and a device on two machines, though with one core each
        pin(cpus[1])
    server, port, raw_port = start_server(url, cpus[0] if pinned else None)
    print(
        f"aggregator on CPU {cpus[0]}, client on CPU {cpus[1]}" if pinned else "processes not pinned to cores",
        flush=True,
    )
    assert server.stdout is not None
    reports = server.stdout
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())  # the agent's channel
    stub = pb_grpc.AggregatorStub(channel)
    fetch_model, push_update = framing.fetch_model(channel), framing.push_update(channel)
    regs = [
        stub.Register(
            pb.RegisterRequest(profile=pb.CapabilityProfile(num_samples=10), enrollment_secret="fedatoms-demo")
        )
        for _ in range(args.reps + 1)
    ]
    auths = [(("authorization", f"Bearer {r.token}"),) for r in regs]
    tasks = [stub.GetTask(pb.GetTaskRequest(), metadata=a) for a in auths]
    assert all(t.WhichOneof("kind") == "train" for t in tasks), "every client should be in round 1's cohort"

    def fetch() -> dict[str, Any]:
        asm = codec.Reassembler()
        for batch in fetch_model(pb.FetchRequest(), metadata=auths[0]):
            for _, chunk in batch:
                asm.add(chunk)
        return asm.finish()

    tensors = fetch()  # warm-up: the server encodes and frames each tensor once per version
    due = list(tasks[0].train.due_tensors)
    t0 = time.perf_counter()  # the push's batches as client_agent builds them, minus the header
    batches = list(framing.push_messages(pb.PushHeader(), [(n, tensors[n], 0, pb.TENSOR_KIND_MODEL) for n in due]))[1:]
    encode_s = time.perf_counter() - t0
    payload = b"".join(codec.encode(tensors[name]).data for name in due)
    nbytes = len(payload)
    raw_copy_seconds(raw_port, payload, b"P")  # the aggregator's raw peer now holds the payload to send back
    print(
        f"resnet18: {len(due)} tensors, {nbytes / 1e6:.1f} MB float32 in {len(batches)} batches of ≤ 1 MiB; "
        f"client-side encode+frame {encode_s * 1e3:.0f} ms (not in the push timings)",
        flush=True,
    )

    def push(i: int) -> tuple[float, float]:
        def messages() -> Iterator[pb.PushMessage | bytes]:
            header = pb.PushHeader(round=tasks[i].train.round, update_id=uuid.uuid4().hex, num_samples=10)
            yield pb.PushMessage(header=header)
            yield from batches

        t0 = time.monotonic()  # the server's clock too (validated_at)
        reply = push_update(messages(), metadata=auths[i])
        end = time.monotonic()
        assert reply.accepted and not reply.duplicate, reply
        return validated_at(reports) - t0, end - t0

    def timed(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    raw_s, raw_up_s, fetch_s, push_t, push_e, after_push = [], [], [], [], [], []
    settle(server.pid)  # then each push settles before the next repetition
    for rep in range(args.reps):
        raw_s.append(raw_copy_seconds(raw_port, payload, b"G"))
        settle(server.pid)
        raw_up_s.append(raw_copy_seconds(raw_port, payload, b"P"))
        settle(server.pid)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fetch_s.append(timed(fetch))
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        settle(server.pid)
        transport, end_to_end = push(1 + rep)  # client 0 never pushes: the round stays open
        push_t.append(transport)
        push_e.append(end_to_end)
        after_push.append(settle(server.pid))
        print(
            f"  rep {rep + 1}/{args.reps}: raw {raw_s[-1] * 1e3:.0f} ms down, {raw_up_s[-1] * 1e3:.0f} ms up, "
            f"fetch {fetch_s[-1] * 1e3:.0f} ms ({faults} page faults in this process), "
            f"push {transport * 1e3:.0f} ms received+validated / {end_to_end * 1e3:.0f} ms acknowledged, "
            f"then {after_push[-1] * 1e3:.0f} ms of aggregator CPU after the acknowledgement",
            flush=True,
        )

    def row(label: str, seconds: list[float], raw: list[float]) -> str:
        ratios = [r / s for r, s in zip(raw, seconds, strict=True)]
        med = statistics.median(seconds)
        return f"{label:<52} {med * 1e3:8.0f} {nbytes / med / 1e6:8.0f}   {median_range(ratios)}"

    print()
    print(
        f"{'path (median of ' + str(args.reps) + ' interleaved reps)':<52} {'ms':>8} {'MB/s':>8}   ratio to raw (range)"
    )
    print(row("raw TCP copy, aggregator → client (reference)", raw_s, raw_s))
    print(row("FetchModel: stream → decoded arrays", fetch_s, raw_s) + "   target ≥ 0.5x")
    print(row("raw TCP copy, client → aggregator (reference)", raw_up_s, raw_up_s))
    print(row("PushUpdate transport only: received+validated", push_t, raw_up_s) + "   target ≥ 0.5x")
    print(row("PushUpdate end to end: + durable commit, ack", push_e, raw_up_s))
    commit = statistics.median(e - t for e, t in zip(push_e, push_t, strict=True))
    print(
        f"(PushUpdate after validation: SQLite insert of {nbytes / 1e6:.0f} MB + fsync'd commit + ack: "
        f"{commit * 1e3:.0f} ms; then the aggregator's CPU after the ack, its WAL checkpoint off the commit path: "
        f"{statistics.median(after_push) * 1e3:.0f} ms)"
    )
    print()

    # -- GetTask with many registered clients
    engine = store.create_engine_for(url)  # enrol in the database: PBKDF2 per Register is not measured here
    with store.session_factory(engine).begin() as s:
        fed_row = store.get_federation(s, "default")
        assert fed_row is not None
        tokens = [store.register_client(s, fed_row, {}, 1.0)[1] for _ in range(args.clients)]
    engine.dispose()
    latencies: list[float] = []

    def poll(i: int) -> None:
        md = (("authorization", f"Bearer {tokens[i % len(tokens)]}"),)
        t = time.perf_counter()
        stub.GetTask(pb.GetTaskRequest(), metadata=md)
        latencies.append(time.perf_counter() - t)

    print(f"GetTask: {args.polls} polls over {args.clients} clients from {args.pollers} threads …", flush=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.pollers) as pool:
        list(pool.map(poll, range(args.polls)))
    wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100)
    print(f"GetTask     {args.polls / wall:7.0f} calls/s; p50 {q[49] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms")
    channel.close()
    server.communicate("")  # closes its stdin: it stops
    print(f"(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
