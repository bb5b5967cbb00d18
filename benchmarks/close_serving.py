"""GetTask latency of 1,000 polling clients while rounds close, against the same polling idle (not a test).

A real aggregator (``fedatoms aggregator serve``, its own process, default settings but the
federation: ``--model`` (resnet18 by default, 44.7 MB), every round a cohort of ``--cohort``
clients, ``fraction`` = cohort / clients) serves ``--clients`` registered clients, which
``--pollers`` threads of this process poll with plain GetTask calls (``wait_seconds`` = 0, so
every call is answered at once), round-robin.

- **idle**: polling only; the cohort of round 1 is never served, so no push, no close.
- **closing**: the same polling while the cohort members a poll finds with a Train task fetch
  the model and push it back unchanged (no training: the server's side of a round is what is
  measured), so rounds close back to back.

A GetTask of the closing phase *overlaps a close* when it was in flight at some moment between
the aggregator's log line storing a round's last update (the cohort is complete: the close
starts) and its ``round_closed`` line (the new model is in place). The log's timestamps are the
aggregator's local time, to the millisecond, on the same machine as this script's clock.
Printed: p50/p99 of idle calls, of overlapping calls, their ratio
(target: p99 within 2× of idle), the calls completed per second in each, the longest call, and
how long the closes took.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/close_serving.py [--clients 1000]
        [--cohort 10] [--pollers 16] [--idle-seconds 15] [--rounds 4] [--model resnet18]
"""

from __future__ import annotations

import argparse
import bisect
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from polling import free_port, wait_serving

TARGET = 2.0
SECRET = "fedatoms-demo"


def serve(
    workdir: Path, model: str, clients: int, cohort: int, rounds: int
) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    url = f"sqlite:///{workdir / 'fedatoms.db'}"
    config = workdir / "aggregator.toml"
    config.write_text(
        f'listen = "127.0.0.1:{port}"\ndatabase_url = "{url}"\ndeadline_seconds = 3600\n'
        "[federation]\n"
        f'model = "{model}"\nfactorization = "none"\ntiers = [1.0]\n'
        f"fraction = {cohort / clients}\nmin_clients = {cohort}\nrounds = {rounds + 1}\n"
    )
    log = (workdir / "aggregator.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedatoms", "aggregator", "serve", "--config", str(config)], stdout=log, stderr=log
    )
    return proc, f"127.0.0.1:{port}", url


def enrol(url: str, clients: int) -> list[str]:
    """Tokens of ``clients`` clients enrolled in the database (PBKDF2 per Register is not what is measured)."""
    from aggregator_service import store

    engine = store.create_engine_for(url)
    try:
        deadline = time.monotonic() + 60
        while True:
            with store.session_factory(engine).begin() as s:
                fed_row = store.get_federation(s, "default")
                if fed_row is not None:
                    return [store.register_client(s, fed_row, {"num_samples": 10}, 1.0)[1] for _ in range(clients)]
            if time.monotonic() > deadline:
                raise TimeoutError("the aggregator did not create its federation")
            time.sleep(0.2)
    finally:
        engine.dispose()


def close_windows(log: Path) -> dict[int, tuple[float, float]]:
    """Per closed round: (when its last update was stored, when it closed), as UNIX times, from the log."""
    stored: dict[int, float] = {}
    windows: dict[int, tuple[float, float]] = {}
    for line in log.read_text().splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "round" not in fields or "ts" not in fields:
            continue
        t = datetime.strptime(fields["ts"], "%Y-%m-%dT%H:%M:%S.%f").timestamp()  # local time, as logged
        r = int(fields["round"])
        if fields.get("event") == "update_stored":
            stored[r] = t
        elif fields.get("event") == "round_closed" and r in stored:
            windows[r] = (stored[r], t)
    return windows


class Polling:
    """``pollers`` threads calling GetTask round-robin over the tokens; every call's (start, end) in wall time."""

    def __init__(self, target: str, tokens: list[str], pollers: int, trains: queue.Queue | None) -> None:
        import grpc

        from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.AggregatorStub(self.channel)
        self.tokens, self.trains = tokens, trains
        self.calls: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.seen: set[tuple[str, int]] = set()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._poll, args=(i, pollers)) for i in range(pollers)]

    def _poll(self, first: int, step: int) -> None:
        from fedwire.v1 import aggregator_pb2 as pb

        i = first
        while not self.stop.is_set():
            token = self.tokens[i % len(self.tokens)]
            i += step
            start = time.time()
            task = self.stub.GetTask(pb.GetTaskRequest(), metadata=(("authorization", f"Bearer {token}"),))
            end = time.time()
            kind = task.WhichOneof("kind")
            if kind == "train":
                key = (token, task.train.round)
                with self.lock:
                    fresh = key not in self.seen
                    self.seen.add(key)
                if fresh and self.trains is not None:
                    self.trains.put((token, task.train.round))
                continue  # a Train answer is not a plain poll
            with self.lock:
                self.calls.append((start, end))

    def __enter__(self) -> Polling:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        self.channel.close()


def trainer(target: str, trains: queue.Queue, stop: threading.Event) -> None:
    """Fetch the model and push it back unchanged for each (token, round) a poll found with a Train task."""
    import grpc

    from client_agent.transport import channel_options
    from fedcore import codec
    from fedwire import framing
    from fedwire.v1 import aggregator_pb2 as pb

    channel = grpc.insecure_channel(target, options=channel_options())
    fetch_model, push_update = framing.fetch_model(channel), framing.push_update(channel)
    while not stop.is_set():
        try:
            token, round_ = trains.get(timeout=0.2)
        except queue.Empty:
            continue
        md = (("authorization", f"Bearer {token}"),)
        asm = codec.Reassembler()
        for batch in fetch_model(pb.FetchRequest(), metadata=md):
            for _, chunk in batch:
                asm.add(chunk)
        tensors = asm.finish()
        header = pb.PushHeader(round=round_, update_id=f"{token[:16]}-{round_}", num_samples=10)
        frames = framing.push_messages(header, [(n, a, 0, pb.TENSOR_KIND_MODEL) for n, a in tensors.items()])
        push_update(iter(frames), metadata=md, timeout=600)
    channel.close()


def quantiles(calls: list[tuple[float, float]]) -> tuple[float, float, float]:
    latencies = sorted(e - s for s, e in calls)
    q = statistics.quantiles(latencies, n=100)
    return q[49], q[98], latencies[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--cohort", type=int, default=10)
    ap.add_argument("--pollers", type=int, default=16)
    ap.add_argument("--idle-seconds", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--model", default="resnet18")
    args = ap.parse_args()
    print(
        f"{args.clients} clients polling GetTask from {args.pollers} threads; {args.model}, cohorts of "
        f"{args.cohort}, {args.rounds} closes",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="fedatoms-close-serving-") as tmp:
        proc, target, url = serve(Path(tmp), args.model, args.clients, args.cohort, args.rounds)
        try:
            wait_serving(target, proc)
            tokens = enrol(url, args.clients)
            with Polling(target, tokens, args.pollers, None) as idle:
                time.sleep(args.idle_seconds)
            idle_calls = [c for c in idle.calls if c[0] > idle.calls[0][0] + 1.0]  # after a second's warm-up
            trains: queue.Queue = queue.Queue()
            stop = threading.Event()
            workers = [threading.Thread(target=trainer, args=(target, trains, stop)) for _ in range(2)]
            for w in workers:
                w.start()
            log = Path(tmp) / "aggregator.log"
            with Polling(target, tokens, args.pollers, trains) as busy:
                began = time.time()
                while len(close_windows(log)) < args.rounds:
                    if time.time() - began > 600:
                        raise TimeoutError(f"only {len(close_windows(log))} rounds closed in 600 s")
                    time.sleep(0.5)
            stop.set()
            for w in workers:
                w.join(60)
            windows = sorted(close_windows(log).values())
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    starts = [w[0] for w in windows]

    def overlaps(call: tuple[float, float]) -> bool:
        k = bisect.bisect_right(starts, call[1]) - 1  # the last window starting before the call ended
        return k >= 0 and windows[k][1] >= call[0]

    during = [c for c in busy.calls if overlaps(c)]
    idle_span = idle_calls[-1][1] - idle_calls[0][0]
    close_span = sum(e - s for s, e in windows)
    (i50, i99, imax), (d50, d99, dmax) = quantiles(idle_calls), quantiles(during)
    print(
        f"idle            {len(idle_calls) / idle_span:7.0f} calls/s; p50 {i50 * 1e3:6.1f} ms, "
        f"p99 {i99 * 1e3:6.1f} ms, max {imax * 1e3:6.0f} ms"
    )
    print(
        f"during closes   {len(during) / close_span:7.0f} calls/s; p50 {d50 * 1e3:6.1f} ms, p99 {d99 * 1e3:6.1f} ms, "
        f"max {dmax * 1e3:6.0f} ms  ({len(during)} calls over {len(windows)} closes)"
    )
    print(f"closes (last update stored → round_closed): {', '.join(f'{e - s:.2f}' for s, e in windows)} s")
    ratio = d99 / i99
    print(f"p99 during closes / idle: {ratio:.2f}×; target ≤ {TARGET:.0f}×: {'met' if ratio <= TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
