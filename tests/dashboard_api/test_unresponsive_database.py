"""A database that does not answer: every read fails within ``database_timeout_seconds``, the probes stay up.

Two ways PostgreSQL stops answering, both real: a table ``/metrics`` reads held under an ACCESS EXCLUSIVE lock
by another session (the server is up, the query waits), and a TCP listener that accepts and never replies (the
connection attempt waits). Before the reads were bounded, both hung ``/metrics`` and ``/readyz`` until the client
gave up (psycopg waits 130 s to connect, a lock forever): a Prometheus scrape (10 s) saw a timeout, never
``fedatoms_database_up 0``. The bounds asserted are generous (15 s): they tell "answered" from "hung".
"""

from __future__ import annotations

import socket
import sqlite3
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from dashboard_helpers import LiveServer, metric_samples, new_federation, start_dashboard
from support import postgres_base, postgres_schema, wait_until

from aggregator_service import store
from dashboard_api.settings import DashboardSettings

#: an answer within this proves the read was bounded (the dashboard's own bound is 3 s by default)
ANSWERED_WITHIN = 15.0


class Blackhole:
    """A TCP listener on an ephemeral loopback port that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()
        self.closed = False

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/test"

    @property
    def accepted(self) -> int:
        with self.lock:
            return len(self.held)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with self.lock:
                self.held.append(conn)

    def close(self) -> None:
        """Once: stop listening and drop every held connection: the clients waiting on them fail at once."""
        if self.closed:
            return
        self.closed = True
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone leaves it blocked, still listening)
        self.sock.close()
        self.thread.join(timeout=10)
        with self.lock:
            for conn in self.held:
                conn.close()


@pytest.fixture
def blackhole() -> Iterator[Blackhole]:
    hole = Blackhole()
    yield hole
    hole.close()


def test_a_locked_table_fails_the_scrape_within_the_bound_then_it_recovers() -> None:
    with postgres_schema(postgres_base()) as url:
        new_federation(url)
        live = start_dashboard(DashboardSettings(database_url=url))
        holder = store.create_engine_for(url)
        try:
            with httpx.Client(base_url=live.base_url, timeout=ANSWERED_WITHIN) as http:
                assert metric_samples(http.get("/metrics").text)["fedatoms_database_up"] == 1
                with holder.connect() as conn:
                    conn.exec_driver_sql("LOCK TABLE round_metrics IN ACCESS EXCLUSIVE MODE")  # held until rollback
                    r = http.get("/metrics")  # hung here, past any scrape timeout
                    assert r.status_code == 200
                    m = metric_samples(r.text)
                    assert m["fedatoms_database_up"] == 0 and "fedatoms_federation_found" not in m
                    conn.rollback()
                assert wait_until(lambda: metric_samples(http.get("/metrics").text)["fedatoms_database_up"] == 1, 30)
        finally:
            holder.dispose()
            live.stop()


def test_a_database_that_never_answers_fails_metrics_and_readiness_within_the_bound(blackhole: Blackhole) -> None:
    live = start_dashboard(DashboardSettings(database_url=blackhole.url))
    try:
        with httpx.Client(base_url=live.base_url, timeout=ANSWERED_WITHIN) as http:
            metrics = http.get("/metrics")
            ready = http.get("/readyz")
            rest = http.get("/api/v1/federation")
    finally:
        live.stop()
    assert blackhole.accepted >= 1  # they did try that database
    assert metrics.status_code == 200 and metric_samples(metrics.text)["fedatoms_database_up"] == 0
    assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
    assert rest.status_code == 503 and "OperationalError" in rest.json()["detail"]


def test_liveness_answers_while_every_worker_thread_waits_on_the_database(blackhole: Blackhole) -> None:
    """``/healthz`` and the page ran in AnyIO's 40 worker threads, which reads stuck on a slow database fill: the
    liveness probe failed and the orchestrator restarted a dashboard that had nothing wrong with it."""
    live = start_dashboard(DashboardSettings(database_url=blackhole.url, database_timeout_seconds=120))
    stuck = 50  # more than the 40 threads: some wait for a thread too
    try:
        with ThreadPoolExecutor(stuck) as pool:
            reads = [pool.submit(httpx.get, f"{live.base_url}/api/v1/federation", timeout=180) for _ in range(stuck)]
            try:
                # every worker thread is connecting to the blackhole (one connection each, 40 threads)
                assert wait_until(lambda: blackhole.accepted >= 40, 60), blackhole.accepted
                with httpx.Client(base_url=live.base_url, timeout=ANSWERED_WITHIN) as http:
                    assert http.get("/healthz").json() == {"status": "ok"}
                    assert http.head("/healthz").status_code == 200
                    page = http.get("/")
                    assert page.status_code == 200 and "<html" in page.text.lower()
                assert not any(r.done() for r in reads)  # the reads were still stuck meanwhile
            finally:
                blackhole.close()  # the stuck connections drop: the reads fail now
            answers = [r.result() for r in reads]
    finally:
        live.stop()
    assert {a.status_code for a in answers} == {503}


def test_a_locked_sqlite_file_says_so(tmp_path: Path) -> None:
    """The 503 said "unavailable or not migrated … check that the aggregator has started", hiding the cause."""
    url = f"sqlite:///{tmp_path / 'fedatoms.db'}"
    new_federation(url)
    locker = sqlite3.connect(tmp_path / "fedatoms.db", isolation_level=None)
    locker.execute("PRAGMA locking_mode=EXCLUSIVE")
    locker.execute("BEGIN EXCLUSIVE")  # holds the file: no other connection reads it
    live: LiveServer = start_dashboard(DashboardSettings(database_url=url, database_timeout_seconds=0.5))
    try:
        r = httpx.get(f"{live.base_url}/api/v1/federation", timeout=ANSWERED_WITHIN)
    finally:
        locker.close()
        live.stop()
    assert r.status_code == 503
    assert "database is locked" in r.json()["detail"]
