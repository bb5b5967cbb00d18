"""``history_rounds``: a transfer or an evaluation reported late for a pruned round adds to its sums only, in the
process that pruned it and in one restarted on its database; the dashboard shows what an unpruned one does.

The coordinator keeps the retention watermark (``federations.history_pruned_through``) in memory: read
when it loads, moved by its own closes. A stale copy would write ``transfers`` and ``tensor_metrics`` rows
for a round whose history is gone (too low), or drop them for a round that keeps it (too high).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient
from grpc_helpers import Client, register, shards, small_federation
from sqlalchemy import Connection, event, select
from support import postgres_base, postgres_schema

from aggregator_service import store
from aggregator_service.coordinator import Coordinator
from aggregator_service.coordinator.answers import ClientInfo
from dashboard_api.app import create_app
from dashboard_api.settings import DashboardSettings
from fedwire.v1 import aggregator_pb2 as pb

LATE = 40  # bytes of each late evaluation fetch


@contextmanager
def _connect(url: str) -> Iterator[Connection]:
    engine = store.create_engine_for(url)
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def _late_fetch(coordinator: Coordinator, client: Client, round_: int, tensor: str) -> None:
    """An evaluation fetch of ``round_``'s model, counted now and written by the next flush."""
    info = ClientInfo(client.client_id, client.tier, "late", client.key)
    coordinator.record_download(info, LATE, {tensor: LATE}, round_=round_, category="eval_fetch")
    coordinator.flush()


@contextmanager
def _watermark_reads(coordinator: Coordinator) -> Iterator[list[str]]:
    """The statements the coordinator's engine runs meanwhile that read the retention watermark."""
    engine = coordinator.factory.kw["bind"]
    seen: list[str] = []

    def before(conn, cursor, statement, parameters, context, executemany) -> None:
        if "history_pruned_through" in statement:
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", before)


@contextmanager
def _failing_prune_commit(coordinator: Coordinator) -> Iterator[list[int]]:
    """The commit of the next transaction that moves the retention watermark fails (before it reaches the
    database); yields the in-memory watermark as it was then: what a concurrent ledger write would read."""
    engine = coordinator.factory.kw["bind"]
    seen: list[int] = []

    def before(conn, cursor, statement, parameters, context, executemany) -> None:
        if statement.lstrip().upper().startswith("UPDATE") and "history_pruned_through" in statement:
            conn.info["moves_watermark"] = True

    def commit(conn) -> None:
        if conn.info.pop("moves_watermark", False) and not seen:
            seen.append(coordinator.shared.history_pruned_through)
            raise RuntimeError("the commit failed")

    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "commit", commit)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", before)
        event.remove(engine, "commit", commit)


def _watermark(url: str) -> int:
    with _connect(url) as conn:
        return conn.execute(select(store.Federation.history_pruned_through)).scalar_one()


def _ledger(url: str, client_id: str) -> dict[str, Any]:
    """The rounds with ``transfers`` and ``tensor_metrics`` rows, the ``eval_fetch`` transfers and their sums
    per round, and the client's lifetime bytes down."""
    t, rb = store.Transfer, store.RoundBytes
    with _connect(url) as conn:
        return {
            "detail": (
                set(conn.execute(select(t.round).distinct()).scalars()),
                set(conn.execute(select(store.TensorMetric.round).distinct()).scalars()),
            ),
            "eval_transfers": conn.execute(
                select(t.round, t.client_id, t.bytes).where(t.category == "eval_fetch")
            ).all(),
            "eval_sums": dict(conn.execute(select(rb.round, rb.bytes).where(rb.category == "eval_fetch")).all()),
            "bytes_down": conn.execute(select(store.Client.bytes_down).where(store.Client.id == client_id)).scalar(),
        }


def _late_transfers_skip_pruned_rounds(start_service, url: str) -> None:
    federation = small_federation(rounds=5)
    service = start_service(url, federation=federation, history_rounds=1)
    clients = [register(service.stub, 1.0, d) for d in shards(2)]
    for round_ in (1, 2, 3):
        for c in clients:
            got, reply = c.round_trip()
            assert got == round_ and reply.accepted
        assert service.coordinator.federation.round == round_
    tensor = federation.spec.names[0]
    a, b = clients
    before = _ledger(url, a.client_id)
    assert before["detail"] == ({3}, {3})  # round 3's close pruned rounds 1 and 2 (round 2's close, round 1)
    assert before["eval_sums"] == {}

    # the process whose close pruned round 2: a late transfer of it adds to its sums only
    with _watermark_reads(service.coordinator) as reads:
        _late_fetch(service.coordinator, a, 2, tensor)
    assert reads == []  # the coordinator knows the watermark: its ledger writes read nothing for it
    after = _ledger(url, a.client_id)
    assert after["detail"] == ({3}, {3})
    assert after["eval_transfers"] == []
    assert after["eval_sums"] == {2: LATE}
    assert after["bytes_down"] == before["bytes_down"] + LATE

    # a coordinator started on the database an earlier process pruned: the same
    service.stop()
    again = start_service(url, federation=federation, history_rounds=1)
    before = _ledger(url, b.client_id)
    _late_fetch(again.coordinator, b, 1, tensor)
    _late_fetch(again.coordinator, b, 2, tensor)
    after = _ledger(url, b.client_id)
    assert after["detail"] == ({3}, {3})
    assert after["eval_transfers"] == []
    assert after["eval_sums"] == {1: LATE, 2: 2 * LATE}
    assert after["bytes_down"] == before["bytes_down"] + 2 * LATE

    # a round that keeps its history still gets its rows
    _late_fetch(again.coordinator, b, 3, tensor)
    after = _ledger(url, b.client_id)
    assert after["eval_transfers"] == [(3, b.client_id, LATE)]
    assert after["eval_sums"] == {1: LATE, 2: 2 * LATE, 3: LATE}
    assert after["bytes_down"] == before["bytes_down"] + 3 * LATE


def test_late_transfers_skip_pruned_rounds_sqlite(start_service, sqlite_url) -> None:
    _late_transfers_skip_pruned_rounds(start_service, sqlite_url)


@pytest.mark.usefixtures("postgres_url")
def test_late_transfers_skip_pruned_rounds_postgres(start_service, postgres_url) -> None:
    _late_transfers_skip_pruned_rounds(start_service, postgres_url)


def _a_failed_close_leaves_the_watermark(start_service, url: str) -> None:
    """A close whose commit fails after its prune: the watermark in memory never runs ahead of the committed one.
    On PostgreSQL nothing keeps a ledger write out of the close's commit; one that read the pruned round's
    watermark would skip that round's detail rows, which the rolled-back prune would then never have deleted."""
    service = start_service(url, federation=small_federation(rounds=5), history_rounds=1)
    shared = service.coordinator.shared
    clients = [register(service.stub, 1.0, d) for d in shards(2)]
    for c in clients:
        assert c.round_trip()[0] == 1
    assert shared.history_pruned_through == _watermark(url) == 0
    with _failing_prune_commit(service.coordinator) as seen:
        for c in clients:  # the last push closes round 2, which prunes round 1: its commit fails
            got, reply = c.round_trip()
            assert got == 2 and reply.accepted
    assert seen == [0]  # while the close committed: the old watermark
    assert shared.history_pruned_through == _watermark(url) == 0
    assert service.coordinator.federation.round == 1  # round 2 is still open

    service.coordinator.tick()  # the close again, committed
    assert service.coordinator.federation.round == 2
    assert shared.history_pruned_through == _watermark(url) == 1


def test_a_failed_close_leaves_the_watermark_sqlite(start_service, sqlite_url) -> None:
    _a_failed_close_leaves_the_watermark(start_service, sqlite_url)


@pytest.mark.usefixtures("postgres_url")
def test_a_failed_close_leaves_the_watermark_postgres(start_service, postgres_url) -> None:
    _a_failed_close_leaves_the_watermark(start_service, postgres_url)


@contextmanager
def _paused_flush(coordinator: Coordinator) -> Iterator[tuple[threading.Thread, threading.Event]]:
    """A ledger flush in another thread, paused in its transaction once it has read the watermark and added to a
    round's sums (its first statement), until the event yielded is set; the thread is joined afterwards."""
    engine = coordinator.factory.kw["bind"]
    paused, go = threading.Event(), threading.Event()
    flush = threading.Thread(target=coordinator.flush, daemon=True)

    def after(conn, cursor, statement, parameters, context, executemany) -> None:
        if threading.current_thread() is flush and statement.lstrip().upper().startswith("INSERT INTO ROUND_BYTES"):
            paused.set()
            assert go.wait(timeout=60), "the flush was never let go"

    event.listen(engine, "after_cursor_execute", after)
    try:
        flush.start()
        assert paused.wait(timeout=30), "the flush wrote nothing"
        yield flush, go
    finally:
        go.set()
        flush.join(timeout=60)
        event.remove(engine, "after_cursor_execute", after)


@pytest.mark.usefixtures("postgres_url")
def test_a_write_in_flight_goes_with_the_prune(start_service, postgres_url) -> None:
    """A ledger flush of a late transfer of round 2, in flight (watermark read, not committed) while round 3's
    close prunes round 2. Had the close gone on (on PostgreSQL nothing in the database stops it), the flush
    would write round 2's rows after the prune's ``DELETE``, and leave them. The close waits for it at the
    prune gate, and its prune deletes them. (On SQLite the flush holds the database's write lock: no close
    can begin.)"""
    url = postgres_url
    federation = small_federation(rounds=5)
    service = start_service(url, federation=federation, history_rounds=1)
    a, b = clients = [register(service.stub, 1.0, d) for d in shards(2)]
    for round_ in (1, 2):
        for c in clients:
            assert c.round_trip()[0] == round_
    assert a.round_trip()[0] == 3
    tensor = federation.spec.names[0]
    info = ClientInfo(a.client_id, a.tier, "late", a.key)
    service.coordinator.flush()  # the paused flush writes only the late transfer: nothing b's push waits for
    service.coordinator.record_download(info, LATE, {tensor: LATE}, round_=2, category="eval_fetch")
    gate = service.coordinator.shared.prune_gate
    closed: list[int] = []
    with _paused_flush(service.coordinator) as (flush, go):
        close = threading.Thread(target=lambda: closed.append(b.round_trip()[0]), daemon=True)
        close.start()  # b's push closes round 3
        deadline = time.monotonic() + 30
        while gate.closes_waiting == 0 and close.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        waited = gate.closes_waiting
        go.set()
        close.join(timeout=60)
    assert closed == [3] and not flush.is_alive()
    after = _ledger(url, a.client_id)
    assert after["detail"] == ({3}, {3})
    assert after["eval_transfers"] == []
    assert after["eval_sums"] == {2: LATE}
    assert waited == 1  # the close waited for the flush


# --------------------------------------------------------------------------- late evaluation reports

#: what each client reports of each round: (global accuracy, personalized accuracy or None, num_samples)
_REPORTS = {0: (0.5, 0.6, 10), 1: (0.8, None, 30), 2: (0.1, 0.3, 1000)}


def _report(client: Client, round_: int, which: int) -> bool:
    accuracy, personal, n = _REPORTS[which]
    request = pb.EvaluationReport(
        round=round_, global_accuracy=accuracy + round_ / 100, global_loss=1.0 + which, num_samples=n
    )
    if personal is not None:
        request.personalized_accuracy = personal + round_ / 100
    return client.stub.ReportEvaluation(request, metadata=client.auth).recorded


def _federation_with_late_reports(
    start_service, url: str, history_rounds: int | None
) -> tuple[list[dict[str, Any]], list[bool], list[float]]:
    """Three clients, three rounds; the third reports each round after the next one closed, the others
    before, and retries of counted reports come after their round's history went. Returns ``/api/v1/rounds``
    what each report's reply said (``recorded``) and ``/metrics``' mean client accuracy after rounds 2 and 3 closed."""
    service = start_service(url, federation=small_federation(rounds=5, min_clients=3), history_rounds=history_rounds)
    clients = [register(service.stub, 1.0, d) for d in shards(3)]
    recorded, gauges = [], []
    with TestClient(create_app(DashboardSettings(database_url=url))) as api:
        for round_ in (1, 2, 3):
            for c in clients:
                assert c.round_trip()[0] == round_
            assert service.coordinator.federation.round == round_
            if round_ > 1:  # late: round − 1 closed, and with history_rounds = 1 pruned, before it comes
                recorded += [_report(clients[2], round_ - 1, 2), _report(clients[2], 1, 2)]  # and a retry
                # /metrics before round_'s reports: the latest evaluated round is a pruned one
                lines = api.get("/metrics").text.splitlines()
                gauges += [
                    float(line.split()[1]) for line in lines if line.startswith("fedatoms_mean_client_accuracy ")
                ]
            recorded += [_report(c, round_, i) for i, c in enumerate(clients[:2])]
        recorded.append(_report(clients[0], 2, 0))  # a retry of a report counted before round 2 was pruned
        assert _watermark(url) == (0 if history_rounds is None else 2)
        service.stop()
        return api.get("/api/v1/rounds").json()["items"], recorded, gauges


def _late_reports_count_in_pruned_rounds(start_service, pruned_url: str, unpruned_url: str) -> None:
    """The oracle is the same federation unpruned: every figure of ``/rounds`` agrees, late reports included."""
    unpruned, unpruned_recorded, unpruned_gauges = _federation_with_late_reports(start_service, unpruned_url, None)
    pruned, pruned_recorded, pruned_gauges = _federation_with_late_reports(start_service, pruned_url, 1)
    assert [r["number"] for r in pruned] == [r["number"] for r in unpruned] == [1, 2, 3]
    assert [r["evaluations"] for r in unpruned] == [3, 3, 2]
    for got, want in zip(pruned, unpruned, strict=True):
        assert got["evaluations"] == want["evaluations"], got["number"]
        for key in ("mean_client_accuracy", "personalized_accuracy"):
            assert got[key] == pytest.approx(want[key], rel=1e-12, abs=0), (got["number"], key)
    assert len(unpruned_gauges) == 2 and pruned_gauges == pytest.approx(unpruned_gauges, rel=1e-12, abs=0)
    assert pruned_recorded == unpruned_recorded == [True, True, True, False, True, True, True, False, True, True, False]


def test_late_reports_count_in_pruned_rounds_sqlite(start_service, tmp_path) -> None:
    _late_reports_count_in_pruned_rounds(
        start_service, f"sqlite:///{tmp_path / 'pruned.db'}", f"sqlite:///{tmp_path / 'unpruned.db'}"
    )


def test_late_reports_count_in_pruned_rounds_postgres(start_service) -> None:
    base = postgres_base()
    with postgres_schema(base) as pruned, postgres_schema(base) as unpruned:
        _late_reports_count_in_pruned_rounds(start_service, pruned, unpruned)
