"""SQLite WAL checkpoints: a writer engine's commits never run one; its own thread does, off their path."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from support import wait_until

from aggregator_service import store
from aggregator_service.low_priority import NICE
from aggregator_service.store.wal import BACKSTOP_PAGES

AUTOCHECKPOINT_PAGES = 1000  # SQLite's default wal_autocheckpoint
PAGE = 65536  # the store's page size


def _engine(tmp_path: Path, **kwargs: object) -> tuple[Engine, Path]:
    path = tmp_path / "wal.db"
    engine = store.create_engine_for(f"sqlite:///{path}", **kwargs)  # type: ignore[arg-type]
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS blobs (id INTEGER PRIMARY KEY, data BLOB)")
    return engine, path


def _write(engine: Engine, nbytes: int) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO blobs (data) VALUES (zeroblob(:n))"), {"n": nbytes})


def _nice(tid: int | None) -> int:
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16])  # the 19th field of stat, counted after the command name's closing parenthesis


def test_writer_engine_moves_automatic_checkpoints_out_of_reach_and_readers_keep_them(tmp_path):
    writer, _ = _engine(tmp_path)
    reader = store.create_engine_for(f"sqlite:///{tmp_path / 'wal.db'}", sqlite_begin="DEFERRED")
    try:
        with writer.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == BACKSTOP_PAGES  # out of reach
        assert writer.wal_checkpointer.running  # type: ignore[attr-defined]
        if sys.platform.startswith("linux"):  # the thread yields to serving: its own nice value is the lowest
            thread = next(t for t in threading.enumerate() if t.name == "wal-checkpoint:wal.db")
            assert wait_until(lambda: _nice(thread.native_id) == NICE)
        with reader.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == AUTOCHECKPOINT_PAGES
        assert not hasattr(reader, "wal_checkpointer")
    finally:
        writer.dispose()
        reader.dispose()


def test_a_commit_past_the_autocheckpoint_size_leaves_the_checkpoint_to_the_thread(tmp_path):
    """Past 1000 pages SQLite's own commit would copy the WAL into the database file before returning; a writer
    engine's commit returns with the frames in the WAL alone, and the thread copies them."""
    engine, path = _engine(tmp_path)
    checkpointer = engine.wal_checkpointer  # type: ignore[attr-defined]
    try:
        checkpointer.stop()  # so that only the commit could have checkpointed
        before = path.stat().st_size
        nbytes = (AUTOCHECKPOINT_PAGES + 100) * PAGE
        _write(engine, nbytes)
        assert os.stat(f"{path}-wal").st_size > nbytes  # committed, in the WAL
        assert path.stat().st_size == before  # and not copied by the commit
        checkpointer.start()
        # the file grows while the checkpoint runs: wait for its end
        assert wait_until(lambda: checkpointer.checkpoints >= 1, timeout=30), "the thread never checkpointed"
        assert path.stat().st_size > nbytes
    finally:
        engine.dispose()


def test_the_same_commit_checkpoints_inside_commit_when_asked(tmp_path):
    """The control for the test above: with ``sqlite_checkpoint="commit"`` that commit copies the WAL itself."""
    engine, path = _engine(tmp_path, sqlite_checkpoint="commit")
    try:
        assert not hasattr(engine, "wal_checkpointer")
        nbytes = (AUTOCHECKPOINT_PAGES + 100) * PAGE
        _write(engine, nbytes)
        assert path.stat().st_size > nbytes
    finally:
        engine.dispose()


def test_the_thread_checkpoints_small_commits_and_stops_with_the_engine(tmp_path):
    engine, path = _engine(tmp_path)
    checkpointer = engine.wal_checkpointer  # type: ignore[attr-defined]
    _write(engine, 2 * PAGE * 16)  # far below the automatic checkpoint's 1000 pages
    copied = wait_until(lambda: path.stat().st_size > 2 * PAGE * 16, timeout=30)
    assert copied, "the small commit was never checkpointed"
    engine.dispose()
    assert not checkpointer.running
    with engine.connect():  # a disposed engine that connects again checkpoints again
        assert checkpointer.running
    engine.dispose()
    assert not checkpointer.running


def test_a_checkpoint_behind_an_open_reader_is_tried_again(tmp_path):
    """A reader on an older snapshot keeps later frames from being copied; once it ends, they are."""
    engine, path = _engine(tmp_path)
    reader = store.create_engine_for(f"sqlite:///{path}", sqlite_begin="DEFERRED")
    try:
        with reader.connect() as r, r.begin():  # BEGIN DEFERRED
            r.exec_driver_sql("SELECT count(*) FROM blobs").scalar()  # the snapshot starts here
            _write(engine, 64 * PAGE)
            time.sleep(0.5)  # several of the thread's turns, all held back by the snapshot
            assert path.stat().st_size < 64 * PAGE
        copied = wait_until(lambda: path.stat().st_size > 64 * PAGE, timeout=30)
        assert copied, "the frames were never copied after the reader"
    finally:
        engine.dispose()
        reader.dispose()


def test_an_unknown_checkpoint_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="sqlite_checkpoint"):
        store.create_engine_for(f"sqlite:///{tmp_path / 'x.db'}", sqlite_checkpoint="never")  # type: ignore[arg-type]
