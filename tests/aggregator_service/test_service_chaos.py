"""kill -9 of a real aggregator at a push, during a push, at a close and idle: the byte counters still add up.

One federation of three clients over four rounds, on SQLite and on PostgreSQL, whose server process
is SIGKILLed four times: after two of a round's three pushes were acknowledged; while the last push
of a round is on the wire (acknowledged or not, it is retried with its update id); right after the
push that completes a cohort was acknowledged (the close runs or has not yet committed); between two
rounds. Clients retry what was not acknowledged, and one retries a push that was, as a client whose
acknowledgement got lost does. The oracle is what the clients sent: every round's model tensors,
once per client, whatever was retried. The ``transfers`` rows, each round's ``round_metrics.bytes_up``,
the dashboard's ``/bandwidth`` and its Prometheus ``fedatoms_bytes_up_total`` must all say the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from fastapi.testclient import TestClient
from grpc_helpers import SECRET, Client, free_port, register, shards, wait_serving
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from aggregator_service import store
from dashboard_api.app import create_app
from dashboard_api.settings import DashboardSettings
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 4
TOML = f"""
enrollment_secret = "{SECRET}"
deadline_seconds = 600

[federation]
model = "digits-cnn"
factorization = "none"
tiers = [1.0]
fraction = 1.0
min_clients = 3
rounds = {ROUNDS}
batch_size = 32
lr = 0.05
"""


class Server:
    """``fedatoms aggregator serve`` in its own process on one port and database, killed and restarted."""

    def __init__(self, tmp_path: Path, url: str) -> None:
        self.config = tmp_path / "federation.toml"
        self.config.write_text(TOML)
        self.url, self.port, self.log = url, free_port(), tmp_path / "server.log"
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    def start(self, clients: list[Client] | None = None) -> pb_grpc.AggregatorStub:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "fedatoms", "aggregator", "serve", "--config", str(self.config)]
        cmd += ["--listen", f"127.0.0.1:{self.port}", "--database-url", self.url]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT)
        try:
            wait_serving(f"127.0.0.1:{self.port}")
        except TimeoutError:
            self.proc.kill()
            raise AssertionError(f"server did not start:\n{self.log.read_text()}") from None
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        stub = pb_grpc.AggregatorStub(self.channel)
        for c in clients or []:
            c.stub = stub
        return stub

    def kill(self) -> None:
        assert self.proc is not None and self.channel is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.channel.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            assert self.proc.wait(30) == 0, self.log.read_text()
        if self.channel is not None:
            self.channel.close()


def _train_task(client: Client, round_: int, deadline: float = 60.0):
    """The client's Train task for ``round_``, asking until the restarted server has closed the round before."""
    end = time.monotonic() + deadline
    while True:
        task = client.task()
        if task.WhichOneof("kind") == "train" and task.train.round == round_:
            return task
        assert time.monotonic() < end, f"no train task for round {round_}: {task}"
        time.sleep(0.05)


def _push_until_acknowledged(client: Client, round_: int, update_id: str) -> None:
    push = client.pushed[round_]
    reply = client.push(round_, push.tensors, update_id=update_id, num_samples=push.num_samples)
    assert reply.accepted, reply


def _ledger(url: str) -> tuple[dict[int, int], dict[int, int]]:
    """Per round: the summed ``push`` transfer rows, and ``round_metrics.bytes_up``."""
    engine = store.create_engine_for(url)
    try:
        with engine.connect() as conn:
            pushes = dict(
                conn.execute(
                    select(store.Transfer.round, func.sum(store.Transfer.bytes))
                    .where(store.Transfer.category == "push")
                    .group_by(store.Transfer.round)
                ).all()
            )
            metrics = dict(conn.execute(select(store.RoundMetrics.round, store.RoundMetrics.bytes_up)).all())
    finally:
        engine.dispose()
    return {int(r): int(b) for r, b in pushes.items()}, {int(r): int(b) for r, b in metrics.items()}


def _chaos(tmp_path: Path, url: str) -> None:
    server = Server(tmp_path, url)
    stub = server.start()
    clients = [register(stub, 1.0, d) for d in shards(3, 80)]
    sent: dict[int, int] = {}  # round → payload bytes its three clients sent, once each
    try:
        for r in range(1, ROUNDS + 1):
            tasks = {c.client_id: _train_task(c, r) for c in clients}
            for c in clients:
                c.fetch()
                c.train(tasks[c.client_id])
            sent[r] = sum(t.numel() * t.element_size() for c in clients for t in c.pushed[r].tensors.values())
            first, second, last = clients
            _push_until_acknowledged(first, r, f"u{r}-0")
            _push_until_acknowledged(second, r, f"u{r}-1")
            if r == 1:  # at a push: two acknowledged, the round open
                server.kill()
                server.start(clients)
                _push_until_acknowledged(second, r, f"u{r}-1")  # its acknowledgement "got lost": a duplicate
                _push_until_acknowledged(last, r, f"u{r}-2")
            elif r == 2:  # during a push: the cohort's last update on the wire when the process dies
                errors: list[BaseException] = []

                def push_last(c: Client = last, rr: int = r, box: list[BaseException] = errors) -> None:
                    try:
                        _push_until_acknowledged(c, rr, f"u{rr}-2")
                    except BaseException as exc:  # UNAVAILABLE when the kill came first
                        box.append(exc)

                pusher = threading.Thread(target=push_last)
                pusher.start()
                time.sleep(0.01)
                server.kill()
                pusher.join(30)
                server.start(clients)
                _push_until_acknowledged(last, r, f"u{r}-2")  # a retry, whether or not the first was stored
            elif r == 3:  # at a close: the cohort complete, the close running or not yet committed
                _push_until_acknowledged(last, r, f"u{r}-2")
                server.kill()
                server.start(clients)
                _train_task(first, r + 1)  # the restarted server closes round 3 and opens round 4
                server.kill()  # idle: between two rounds, nothing in flight
                server.start(clients)
            else:
                _push_until_acknowledged(last, r, f"u{r}-2")
        end = time.monotonic() + 60
        while clients[0].task().WhichOneof("kind") != "done":
            assert time.monotonic() < end, "the federation did not finish"
            time.sleep(0.05)
    finally:
        server.stop()

    pushes, bytes_up = _ledger(url)
    assert pushes == sent, (pushes, sent)  # each update counted once, none lost to a kill
    assert bytes_up == sent, (bytes_up, sent)  # every round's metrics row agrees with its transfers
    with TestClient(create_app(DashboardSettings(database_url=url))) as dashboard:
        totals = dashboard.get("/api/v1/bandwidth").json()["totals"]
        families = text_string_to_metric_families(dashboard.get("/metrics").text)
        prometheus = {s.name: s.value for f in families for s in f.samples}
    assert totals["bytes_up"] == sum(sent.values())
    assert prometheus["fedatoms_bytes_up_total"] == sum(sent.values())
    assert "event=federation_loaded" in server.log.read_text()


def test_kills_at_push_close_and_idle_lose_no_byte_sqlite(tmp_path: Path) -> None:
    _chaos(tmp_path, f"sqlite:///{tmp_path / 'fedatoms.db'}")


def test_kills_at_push_close_and_idle_lose_no_byte_postgres(tmp_path: Path, postgres_url: str) -> None:
    _chaos(tmp_path, postgres_url)
