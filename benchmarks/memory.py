"""The aggregator's peak memory over one round of resnet18 clients, in model sizes (not a test).

A real aggregator (``fedatoms aggregator serve``, its own process, SQLite in a temporary
directory) serves resnet18 without factorization (tier 1: every push carries the whole model in
float32, ≈44.7 MB), every client every round. This process registers ``--clients`` clients, asks
each for its task (round 1 opens), then pushes every client's update at once, one thread each
(the worst case: the whole cohort reports together), until the last push's reply (sent after the
close it triggered). One client fetches the model first, as every client does before it trains (the
server's per-tier and serialized-model caches fill, and are part of idle). Every update is the
initial model; no client trains (what is measured is the service).

The aggregator's resident set is read from ``/proc/<pid>/status``: **idle** is ``VmRSS`` once
the round is open and every client has its task; then the peak counter is reset (``5`` written to
``/proc/<pid>/clear_refs``) and **peak** is ``VmHWM`` after the round closed (all pushes but the
last go together; the last one, which closes the round, after them, so the pushes' own peak
is printed too). The table shows
peak − idle, in MB and in multiples of the model's float32 bytes. Target: ≤ 4× whatever the
cohort size.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/memory.py [--clients 10,50]
"""

from __future__ import annotations

import argparse
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

TARGET = 4.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def measure(clients: int) -> tuple[float, float, float, int]:
    """One round of ``clients`` pushes: (idle MB, peak MB of the pushes, peak MB with the close, model bytes)."""
    import grpc

    from aggregator_service.config import DEMO_ENROLLMENT_SECRET
    from client_agent.transport import AggregatorClient
    from fedcore.spec import ModelSpec
    from fedcore.tiers import CapabilityProfile
    from fedwire import framing
    from fedwire.v1 import aggregator_pb2 as pb

    with tempfile.TemporaryDirectory(prefix="fedatoms-memory-") as tmp:
        workdir = Path(tmp)
        port = free_port()
        config = workdir / "aggregator.toml"
        config.write_text(
            f'listen = "127.0.0.1:{port}"\ndatabase_url = "sqlite:///{workdir / "fedatoms.db"}"\n'
            "deadline_seconds = 3600\n[federation]\n"
            'model = "resnet18"\nfactorization = "none"\ntiers = [1.0]\n'
            f"fraction = 1.0\nmin_clients = {clients}\nrounds = 2\n"
        )
        log = (workdir / "aggregator.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedatoms", "aggregator", "serve", "--config", str(config)], stdout=log, stderr=log
        )
        try:
            target = f"127.0.0.1:{port}"
            first = AggregatorClient(target)
            deadline = time.monotonic() + 180
            while True:
                try:
                    reply, spec = first.register(
                        CapabilityProfile(num_samples=100, preferred_tier=1.0), DEMO_ENROLLMENT_SECRET
                    )
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    time.sleep(0.5)
            tokens = [reply.token]
            for _ in range(clients - 1):
                other = AggregatorClient.sharing(first)
                r, _ = other.register(CapabilityProfile(num_samples=100, preferred_tier=1.0), DEMO_ENROLLMENT_SECRET)
                tokens.append(r.token)
            rounds = set()
            for token in tokens:
                c = AggregatorClient.sharing(first)
                c.token = token
                task = c.get_task()
                assert task.WhichOneof("kind") == "train", task
                rounds.add(task.train.round)
            (round_,) = rounds
            spec = ModelSpec.from_json(reply.model_spec_json)
            first.fetch(spec, {}, round_=round_)  # as a client does before training: the serving caches fill
            state = spec.initial_model(0).state_dict()
            model = {n: state[n] for n in spec.names}
            tensors = [(n, t, 0, pb.TENSOR_KIND_MODEL) for n, t in model.items()]
            body = list(framing.push_messages(pb.PushHeader(), tensors))[1:]
            nbytes = sum(t.numel() * 4 for t in model.values())
            time.sleep(1.0)
            idle = status_kb(proc.pid, "VmRSS") / 1024
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")
            push = framing.push_update(first.channel)
            errors: list[BaseException] = []

            def one(token: str) -> None:
                header = pb.PushHeader(round=round_, update_id=uuid.uuid4().hex, num_samples=100)
                try:
                    while True:  # as client_agent does: UNAVAILABLE (the server's push line is full) is retried
                        try:
                            r = push(
                                iter([pb.PushMessage(header=header).SerializeToString(), *body]),
                                metadata=(("authorization", f"Bearer {token}"),),
                                timeout=600,
                            )
                            break
                        except grpc.RpcError as exc:
                            if exc.code() != grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
                                raise
                            time.sleep(random.uniform(0.2, 2.0))
                    assert r.accepted, r
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=one, args=(t,)) for t in tokens[:-1]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            pushes = status_kb(proc.pid, "VmHWM") / 1024  # all but the last stored: the round is still open
            one(tokens[-1])  # the last push, and the close it triggers
            if errors:
                raise errors[0]
            peak = status_kb(proc.pid, "VmHWM") / 1024
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return idle, pushes, peak, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="10,50")
    args = ap.parse_args()
    print(f"{'clients':>7}  {'idle MB':>8}  {'peak MB':>8}  {'peak − idle':>12}  {'× model':>8}", flush=True)
    for n in (int(x) for x in args.clients.split(",")):
        idle, pushes, peak, nbytes = measure(n)
        ratio = (peak - idle) * 2**20 / nbytes
        print(
            f"{n:7d}  {idle:8.0f}  {peak:8.0f}  {peak - idle:9.0f} MB  {ratio:7.2f}×  "
            f"(pushes alone {(pushes - idle) * 2**20 / nbytes:.2f}×) "
            f"(model {nbytes / 1e6:.1f} MB; target ≤ {TARGET:g}×: {'met' if ratio <= TARGET else 'NOT met'})",
            flush=True,
        )


if __name__ == "__main__":
    main()
