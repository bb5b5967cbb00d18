"""Holding the one-aggregator-per-federation lock on a database that moves on or hangs.

* A lock taken again after its PostgreSQL session ended may follow another aggregator that held it meanwhile
  and moved the federation on: the server reloads from the database and serves the database's open round
  (before: it served its stale round forever, every push refused and every tick failing).
* A deadline that finds its round no longer open in the database reloads instead of failing every tick.
* A database that hangs (a proxy that stops forwarding) never holds SIGTERM: the lock check runs on a thread
  of its own and every shutdown step that needs the database is bounded.
* :func:`store.federation_served` tells, without taking part, whether a live process holds the lock.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from grpc_helpers import SECRET, free_port, register, shards, wait_serving
from sqlalchemy import select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session
from support import postgres_base, postgres_schema
from test_service_ownership import _kill_lock_session

from aggregator_service import store
from aggregator_service.coordinator import Coordinator
from aggregator_service.server import LockWatch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _until(what: Callable[[], object], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.1)


def _rounds(url: str) -> dict[int, str]:
    """Round number → state, as the database says (the oracle)."""
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            return dict(s.execute(select(store.Round.number, store.Round.state)).all())
    finally:
        engine.dispose()


def _abandon_behind_its_back(url: str, round_: int) -> None:
    """What another aggregator does to a round whose deadline passed: abandon it, in its own transaction."""
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s, s.begin():
            fed = store.get_federation(s, "default")
            assert fed is not None
            store.abandon_round(s, fed, round_, now=datetime.now(UTC))
    finally:
        engine.dispose()


def test_a_retaken_lock_reloads_and_serves_the_round_the_database_moved_to(start_service, postgres_url) -> None:
    """Aggregator A serves round 1; while its lock session is gone, another aggregator (B, a coordinator of its
    own on the same database) abandons round 1 and opens round 2. A takes its lock back: it must serve round 2,
    and round 2 must close, as the database says."""
    url = postgres_url
    svc = start_service(url)
    clients = [register(svc.stub, 1.0, d) for d in shards(2)]
    for c in clients:
        task = c.task()
        assert task.WhichOneof("kind") == "train" and task.train.round == 1
    stop = threading.Event()
    with store.exclusive_federation(url, "default") as lock:
        watch = LockWatch(lock, svc.coordinator, stop, interval=0.2)
        watch.start()
        try:
            # B: abandons A's round 1, loads the federation, opens round 2 for the same online clients
            _abandon_behind_its_back(url, 1)
            b = Coordinator(svc.settings, store.session_factory(store.create_engine_for(url)), enrollment_iterations=1)
            with b.shared.lock:
                b.tasks._try_open()
            assert _rounds(url) == {1: "abandoned", 2: "open"}
            _kill_lock_session(url, "default")  # A's session ended (B held the lock meanwhile, then stopped)
            _until(lambda: watch.reloads >= 1, 30, "the retaken lock did not reload the federation")
            assert not watch.lost

            for c in clients:  # A serves the database's open round, not its stale one
                task = c.task()
                assert task.WhichOneof("kind") == "train" and task.train.round == 2, task
            for c in clients:
                c.fetch()
                push = c.train(task)
                reply = c.push(2, push.tensors, num_samples=push.num_samples, metrics=push.metrics)
                assert reply.accepted, reply
            _until(lambda: _rounds(url).get(2) == "closed", 60, f"round 2 did not close: {_rounds(url)}")
        finally:
            stop.set()
            watch.join(10)


def test_a_deadline_on_a_round_the_database_ended_reloads_instead_of_failing_every_tick(
    start_service, postgres_url
) -> None:
    url = postgres_url
    svc = start_service(url, deadline_seconds=60)
    clients = [register(svc.stub, 1.0, d) for d in shards(2)]
    for c in clients:
        assert c.task().train.round == 1
    _abandon_behind_its_back(url, 1)  # another aggregator's deadline, in the window where both served
    later = datetime.now(UTC) + timedelta(hours=1)
    svc.coordinator.tick(later)  # before: RoundStateError "round 1 is abandoned", every tick
    assert svc.coordinator.open_round is None
    svc.coordinator.tick(later)  # nothing stale left to trip on
    for c in clients:
        task = c.task()
        assert task.WhichOneof("kind") == "train" and task.train.round == 2, task
    assert _rounds(url) == {1: "abandoned", 2: "open"}


class FreezableProxy:
    """A TCP forwarder to PostgreSQL that a test can freeze: every connection stays open and nothing moves either
    way (a stopped backend, a link that swallows packets): the client's kernel sees no error at all."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.frozen = threading.Event()
        self.held: dict[int, int] = {}  # connection index → client→server bytes held since the freeze
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        index = 0
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            self._socks += [down, up]
            threading.Thread(target=self._pump, args=(down, up, index), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, None), daemon=True).start()
            index += 1

    def _pump(self, src: socket.socket, dst: socket.socket, index: int | None) -> None:
        try:
            while data := src.recv(65536):
                if self.frozen.is_set():
                    if index is not None:
                        self.held[index] = self.held.get(index, 0) + len(data)
                    continue  # swallowed: the sender's kernel acknowledged it, nobody answers
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


def test_sigterm_stops_the_aggregator_while_its_lock_check_hangs_on_the_database(tmp_path: Path) -> None:
    with postgres_schema(postgres_base()) as pg_url:
        proxy = FreezableProxy(make_url(pg_url).port or 5432)
        through = make_url(pg_url).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        config = tmp_path / "federation.toml"
        config.write_text(f'enrollment_secret = "{SECRET}"\n\n[federation]\nmodel = "digits-cnn"\n')
        port, log = free_port(), tmp_path / "server.log"
        cmd = [
            sys.executable, "-m", "fedatoms", "aggregator", "serve", "--config", str(config),
            "--listen", f"127.0.0.1:{port}", "--database-url", through,
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log.open("ab"), stderr=subprocess.STDOUT)
        try:
            wait_serving(f"127.0.0.1:{port}")
            proxy.frozen.set()
            # the lock's connection is the process's first: wait until a check is stuck on it
            _until(lambda: proxy.held.get(0, 0) > 0, 30, "no lock check reached the frozen database")
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"still running 60 s after SIGTERM:\n{log.read_text()[-3000:]}") from None
            out = log.read_text()
            assert "event=shutdown_requested" in out and "event=stopped" in out, out[-3000:]
            assert proc.returncode == 0, out[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            proxy.close()


_HOLDER = """
import sys, time
from aggregator_service import store
with store.exclusive_federation(sys.argv[1], "default"):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_federation_served_follows_a_live_holder(backend: str, tmp_path: Path) -> None:
    def check(url: str) -> None:
        assert store.federation_served(url, "default") is False  # never served
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, url], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            assert store.federation_served(url, "default") is True
            assert store.federation_served(url, "other") is False
            with pytest.raises(store.FederationBusy):  # the probe took nothing from the holder
                with store.exclusive_federation(url, "default"):
                    pass
        finally:
            holder.kill()
            holder.wait(10)
        _until(lambda: not store.federation_served(url, "default"), 30, "a killed holder still serves")
        with store.exclusive_federation(url, "default"):  # and this process's own hold shows too
            assert store.federation_served(url, "default") is True

    if backend == "sqlite":
        check(f"sqlite:///{tmp_path / 'agg.db'}")
    else:
        with postgres_schema(postgres_base()) as url:
            check(url)


_PROBER = """
import sys
from aggregator_service import store
print("probing", flush=True)
while True:
    store.federation_served(sys.argv[1], "default")
"""


def test_probing_a_sqlite_lock_never_makes_a_starting_aggregator_busy(tmp_path: Path) -> None:
    """A probe that took the lock, even for an instant, would make a start racing it refuse to start. The prober
    is another process (a dashboard), probing without pause while this one starts and stops 3000 times."""
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    with store.exclusive_federation(url, "default"):
        pass  # the lock file exists
    prober = subprocess.Popen(
        [sys.executable, "-c", _PROBER, url], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True
    )
    try:
        assert prober.stdout is not None and prober.stdout.readline().strip() == "probing"
        for _ in range(3000):
            with store.exclusive_federation(url, "default"):  # never FederationBusy
                pass
        assert prober.poll() is None  # it probed all along
    finally:
        prober.kill()
        prober.wait(10)
