"""The aggregator's log is valid logfmt, or JSON lines, that a client cannot forge or flood.

A real ``fedatoms aggregator serve`` process (``--log-format logfmt`` and ``json``) is sent
client names built to break a log line: quotes, spaces and ``key=value`` text that would forge
``event=federation_lock_lost`` in a naive logfmt writer, a backslash, non-ASCII, the longest name
accepted; and names the service refuses at the door (a newline with a forged line after it, a NUL,
300 kB), which must not reach the log at all. The log is then parsed line by line with an
independent reader: a regex over ``key=value`` and ``key="json string"``, or ``json.loads``.

A database that stays away does not flood the log either: the deadline ticker logs one traceback,
then a counted line a minute, then its recovery.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_helpers import SECRET
from sqlalchemy.engine import make_url
from support import free_port, wait_serving

from aggregator_service.server import DeadlineTicker
from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

_PAIR = re.compile(r'([a-z_]+)=("(?:[^"\\]|\\.)*"|[^ "]+)')


def _parse_logfmt(line: str) -> dict[str, str]:
    """key=value pairs of one logfmt line; the whole line must be made of them."""
    pairs = _PAIR.findall(line)
    rebuilt = " ".join(f"{k}={v}" for k, v in pairs)
    assert rebuilt == line, f"not logfmt: {line!r}"
    return {k: json.loads(v) if v.startswith('"') else v for k, v in pairs}


def _parse_json(line: str) -> dict[str, str]:
    record = json.loads(line)
    assert isinstance(record, dict), line
    return record


FORGED = 'edge" level=ERROR event=federation_lock_lost detail="x'
HOSTILE = [FORGED, 'back\\slash "quoted" é ✓', "y" * 128]
REFUSED = [
    "edge\nts=2026-01-01T00:00:00.000 level=ERROR logger=fedatoms.aggregator event=federation_lock_lost",
    "nul\x00byte",
    "x" * 300_000,
]


@pytest.mark.parametrize("log_format", ["logfmt", "json"])
def test_client_controlled_values_cannot_forge_or_flood_log_lines(tmp_path, log_format) -> None:
    config = tmp_path / "federation.toml"
    config.write_text(f'enrollment_secret = "{SECRET}"\n')
    log, target = tmp_path / "server.log", f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "fedatoms", "aggregator", "serve", "--config", str(config), "--listen", target]
    cmd += ["--database-url", f"sqlite:///{tmp_path / 'agg.db'}", "--log-format", log_format]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(cmd, cwd=root, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    wait_serving(target)
    codes = []
    try:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.AggregatorStub(channel)
            for name in HOSTILE + REFUSED:
                request = pb.RegisterRequest(
                    profile=pb.CapabilityProfile(device_name="d", num_samples=10),
                    enrollment_secret=SECRET,
                    client_name=name,
                )
                try:
                    stub.Register(request)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
    finally:
        server.terminate()
        server.wait(30)
    assert codes == [grpc.StatusCode.OK] * len(HOSTILE) + [grpc.StatusCode.INVALID_ARGUMENT] * len(REFUSED)
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    parse = _parse_json if log_format == "json" else _parse_logfmt
    records = [parse(line) for line in lines]  # every line of the process, not only ours
    assert not any(r.get("event") == "federation_lock_lost" for r in records)
    registered = [r for r in records if r.get("event") == "client_registered"]
    assert [r["name"] for r in registered] == HOSTILE  # logged whole, escaped
    assert "nul\\u0000byte" not in text and "nul\x00byte" not in text  # refused names never reach the log
    assert "x" * 200 not in text
    assert max(len(line) for line in lines) < 2_000
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}", r["ts"]) for r in records)
    assert {r["level"] for r in records} <= {"DEBUG", "INFO", "WARNING", "ERROR"}


def test_a_failing_tick_logs_one_traceback_then_a_counted_line_a_minute_then_its_recovery(
    start_service, sqlite_url, caplog
) -> None:
    """Every tick fails with the same real SQLite error (the federations table renamed away under the
    running aggregator) for 150 ticks, a second apart on the ticker's clock: one traceback, not 150."""
    svc = start_service(sqlite_url)
    now = [0.0]
    ticker = DeadlineTicker(svc.coordinator, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="fedatoms.aggregator")
    db = sqlite3.connect(make_url(sqlite_url).database, timeout=30, isolation_level=None)
    try:
        db.execute("ALTER TABLE federations RENAME TO federations_away")
        for _ in range(150):
            ticker.tick_once()
            now[0] += 1.0
        db.execute("ALTER TABLE federations_away RENAME TO federations")
    finally:
        db.close()
    ticker.tick_once()
    ticker.tick_once()  # running again: nothing more to say

    records = [r for r in caplog.records if r.getMessage().startswith(("event=tick_failed", "event=tick_recovered"))]
    lines = [r.getMessage() for r in records]
    assert [line.split(" error=")[0] for line in lines] == [
        "event=tick_failed failures=1",
        "event=tick_failed failures=61",
        "event=tick_failed failures=121",
        "event=tick_recovered failures=150",
    ], lines
    assert [r.exc_info is not None for r in records] == [True, False, False, False]
    assert all("no such table: federations" in line for line in lines[:3]), lines
    assert "\n" not in "".join(lines)
    assert svc.coordinator.state == "running"


def test_a_round_closed_line_carries_the_servers_evaluation(sqlite_url, caplog) -> None:
    """With eval_data the server scores every new model; its round_closed line said only who reported, so an
    operator reading the log had to open the dashboard for the accuracy. The line now carries the figures the
    round's metrics row stores, the same numbers (logfmt repr) the dashboard and /metrics show."""
    from grpc_helpers import register, round_metric, shards, small_federation, start_aggregator

    from aggregator_service import store

    svc = start_aggregator(sqlite_url, small_federation(tiers=[1.0], factorization="none"), eval_data="digits")
    try:
        with caplog.at_level(logging.INFO, logger="fedatoms.aggregator"):
            for client in [register(svc.stub, 1.0, d) for d in shards(2, 60)]:
                client.round_trip()
    finally:
        svc.stop()
    (line,) = [r.getMessage() for r in caplog.records if "event=round_closed" in r.getMessage()]
    pairs = dict(_PAIR.findall(line))
    assert float(pairs["test_accuracy"]) == round_metric(sqlite_url, 1, store.RoundMetrics.test_accuracy)
    assert float(pairs["test_loss"]) == round_metric(sqlite_url, 1, store.RoundMetrics.test_loss)
