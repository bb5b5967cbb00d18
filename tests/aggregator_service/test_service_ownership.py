"""One aggregator per federation: a second `fedatoms aggregator serve` on the same federation refuses to start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_helpers import SECRET, free_port, wait_serving
from links import LinkProxy
from sqlalchemy.engine import make_url
from support import postgres_base, postgres_schema

from aggregator_service import store
from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'agg.db'}"
        return
    with postgres_schema(postgres_base()) as scoped:
        yield scoped


def _cmd(tmp_path: Path, url: str, port: int) -> list[str]:
    config = tmp_path / "federation.toml"
    config.write_text(f'enrollment_secret = "{SECRET}"\n\n[federation]\nmodel = "digits-cnn"\n')
    return [
        sys.executable, "-m", "fedatoms", "aggregator", "serve", "--config", str(config),
        "--listen", f"127.0.0.1:{port}", "--database-url", url,
    ]  # fmt: skip


def _start(cmd: list[str], log: Path, env: dict[str, str] = ENV) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    try:
        wait_serving(cmd[cmd.index("--listen") + 1])
    except TimeoutError:
        proc.kill()
        raise AssertionError(f"aggregator did not start:\n{log.read_text()}") from None
    return proc


def _registers(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = pb_grpc.AggregatorStub(channel).Register(
            pb.RegisterRequest(profile=pb.CapabilityProfile(num_samples=10), enrollment_secret=SECRET), timeout=30
        )
    return bool(reply.token)


def test_second_aggregator_on_the_same_federation_refuses_to_start(tmp_path: Path, url: str) -> None:
    first_port = free_port()
    first = _start(_cmd(tmp_path, url, first_port), tmp_path / "first.log")
    others: list[subprocess.Popen] = []
    try:
        second = subprocess.run(
            _cmd(tmp_path, url, free_port()), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
        )
        assert second.returncode == 1, second.stderr
        assert "event=federation_busy" in second.stderr and "served by another aggregator" in second.stderr
        if url.startswith("sqlite"):
            assert f"pid {first.pid}" in second.stderr  # the lock file names the holder
        assert _registers(first_port)  # the first one serves on, untouched

        # another federation on the same database is another lock
        other_port = free_port()
        env = {**ENV, "FEDATOMS_FEDERATION_NAME": "other"}
        others.append(_start(_cmd(tmp_path, url, other_port), tmp_path / "other.log", env))
        assert _registers(other_port)

        # a killed holder leaves no lock behind: its successor starts on the same database
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        successor_port = free_port()
        others.append(_start(_cmd(tmp_path, url, successor_port), tmp_path / "successor.log"))
        assert _registers(successor_port)
    finally:
        for proc in [first, *others]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)


def test_the_lock_is_exclusive_within_one_process_too(url: str) -> None:
    with store.exclusive_federation(url, "default"):
        with pytest.raises(store.FederationBusy, match="served by another aggregator"):
            with store.exclusive_federation(url, "default"):
                pass
        with store.exclusive_federation(url, "default-2"):  # another federation is free
            pass
    with store.exclusive_federation(url, "default"):  # released on leaving the block
        pass


def _kill_lock_session(url: str, federation: str) -> None:
    """End the PostgreSQL session that holds ``federation``'s advisory lock (a restart or a network cut)."""
    from sqlalchemy import text

    engine = store.create_engine_for(url)
    try:
        with engine.connect() as conn:
            key = conn.execute(
                text("SELECT hashtextextended(current_database() || '/' || current_schema() || '/' || :n, 0)"),
                {"n": federation},
            ).scalar_one()
            pids = (
                conn.execute(
                    text(
                        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                        "AND classid = :hi AND objid = :lo AND objsubid = 1"
                    ),
                    {"hi": (key >> 32) & 0xFFFFFFFF, "lo": key & 0xFFFFFFFF},
                )
                .scalars()
                .all()
            )
            assert len(pids) == 1, pids
            conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pids[0]})
            conn.commit()
    finally:
        engine.dispose()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """Only PostgreSQL's advisory lock can be lost while its holder lives (a flock cannot)."""
    with postgres_schema(postgres_base()) as scoped:
        yield scoped


def test_a_lock_whose_session_ended_is_taken_again_or_given_up(pg_url: str) -> None:
    url = pg_url
    with store.exclusive_federation(url, "default") as lock:
        assert lock.check() is False  # held
        _kill_lock_session(url, "default")
        assert lock.check() is True  # its session ended: taken again
        assert lock.check() is False
        _kill_lock_session(url, "default")
        with store.exclusive_federation(url, "default"):  # another aggregator got it first
            with pytest.raises(store.FederationBusy, match="took the lock after this one's session ended"):
                lock.check()


def _through(url: str, proxy: LinkProxy, password: str | None = None) -> str:
    u = make_url(url).set(host="127.0.0.1", port=proxy.port)
    return (u.set(password=password) if password else u).render_as_string(hide_password=False)


def test_a_lock_the_database_cannot_confirm_says_so_and_is_taken_again_when_it_answers(pg_url: str) -> None:
    """Before, the failed reconnect raised OperationalError out of the server's loop: exit 1 on any database
    restart longer than one check."""
    upstream = make_url(pg_url).port or 5432
    proxy = LinkProxy(upstream)
    try:
        with store.exclusive_federation(_through(pg_url, proxy), "default") as lock:
            assert lock.check() is False
            proxy.go_down()
            with pytest.raises(store.LockUnconfirmed, match="the database does not answer"):
                lock.check()
            with pytest.raises(store.LockUnconfirmed):
                lock.check()  # still away
            proxy.come_back()
            assert lock.check() is True  # taken again
            assert lock.check() is False
    finally:
        proxy.close()


def test_the_aggregator_outlives_a_database_restart_and_never_logs_its_password(pg_url: str, tmp_path: Path) -> None:
    """PostgreSQL away for 8 s (more than one 5 s lock check), then back: the aggregator keeps serving, says
    so once, takes its lock again, and registers a client. The URL's password (trust auth accepts any)
    appears nowhere in its log."""
    upstream = make_url(pg_url).port or 5432
    proxy = LinkProxy(upstream)
    port, log = free_port(), tmp_path / "server.log"
    proc = _start(_cmd(tmp_path, _through(pg_url, proxy, "s3cret-pw"), port), log)
    try:
        assert _registers(port)
        proxy.go_down()
        deadline = time.monotonic() + 30
        while "event=database_unreachable" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(3)
        assert proc.poll() is None, log.read_text()[-3000:]
        proxy.come_back()
        deadline = time.monotonic() + 30
        while "event=federation_lock_retaken" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        assert "event=federation_lock_retaken" in log.read_text()
        assert _registers(port)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        proxy.close()
    text_ = log.read_text()
    assert text_.count("event=database_unreachable") == 1
    assert "s3cret-pw" not in text_ and "event=serving" in text_
