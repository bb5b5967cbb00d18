"""Group commit on a real SQLite file: shared transactions, results per write, a bad write fails alone."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, event, insert, select
from sqlalchemy.orm import Session, sessionmaker
from support import wait_until

from aggregator_service.group_commit import GroupCommit

meta = MetaData()
rows = Table("rows", meta, Column("id", Integer, primary_key=True), Column("name", String, unique=True))


@pytest.fixture()
def factory(tmp_path: Path) -> sessionmaker[Session]:
    engine = create_engine(f"sqlite:///{tmp_path / 'g.db'}", connect_args={"timeout": 30, "check_same_thread": False})
    meta.create_all(engine)
    commits: list[int] = []
    event.listen(engine, "commit", lambda conn: commits.append(1))
    f = sessionmaker(engine)
    f.commits = commits  # type: ignore[attr-defined]
    return f


def _names(factory: sessionmaker[Session]) -> list[str]:
    with factory() as s:
        return sorted(s.scalars(select(rows.c.name)))


def _adder(name: str):
    def write(s: Session) -> int:
        return int(s.execute(insert(rows).values(name=name).returning(rows.c.id)).scalar_one())

    return write


def _hold_leader(group: GroupCommit, release: threading.Event) -> threading.Thread:
    """A first write that waits for ``release``: writes started meanwhile queue for the next batches."""

    def slow(s: Session) -> str:
        release.wait(5)
        s.execute(insert(rows).values(name="slow"))
        return "slow"

    leader = threading.Thread(target=group.run, args=(slow,))
    leader.start()
    assert wait_until(lambda: group._busy), "the first write never started"
    return leader


def _start(group: GroupCommit, outcome: dict[str, object], writes: dict[str, Any]) -> list[threading.Thread]:
    """Each write run by its own thread, started in order; its result, or its error, in ``outcome``."""

    def run(key: str, write) -> None:
        try:
            outcome[key] = group.run(write)
        except Exception as exc:
            outcome[key] = exc

    threads = [threading.Thread(target=run, args=(k, w)) for k, w in writes.items()]
    for t in threads:
        t.start()
    return threads


def _queued(group: GroupCommit, n: int) -> None:
    assert wait_until(lambda: len(group._queue) >= n), f"{len(group._queue)} of {n} writes queued"


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), f"{t.name} still running"


def test_concurrent_writes_share_commits_and_each_gets_its_result(factory) -> None:
    group = GroupCommit(factory, max_batch=8)
    release = threading.Event()
    leader = _hold_leader(group, release)
    results: dict[str, int] = {}

    def client(i: int) -> None:
        results[f"n{i}"] = group.run(_adder(f"n{i}"))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    _queued(group, 20)
    release.set()
    _join([leader, *threads])
    assert _names(factory) == sorted([*(f"n{i}" for i in range(20)), "slow"])
    with factory() as s:
        assert results == {name: pk for name, pk in s.execute(select(rows.c.name, rows.c.id)) if name != "slow"}
    assert (group.writes, group.batches) == (21, 1 + 3)  # the leader alone, then 20 queued writes in batches of ≤ 8
    assert len(factory.commits) == 4  # type: ignore[attr-defined]


def test_a_failing_write_fails_alone_and_the_batch_still_commits(factory) -> None:
    group = GroupCommit(factory)
    group.run(_adder("taken"))
    release = threading.Event()
    leader = _hold_leader(group, release)
    outcome: dict[str, object] = {}
    followers = _start(group, outcome, {"a": _adder("a"), "dup": _adder("taken"), "b": _adder("b")})
    _queued(group, 3)
    release.set()
    _join([leader, *followers])
    assert isinstance(outcome["a"], int) and isinstance(outcome["b"], int)
    assert "UNIQUE" in str(outcome["dup"])  # the duplicate's own error
    assert _names(factory) == ["a", "b", "slow", "taken"]
    assert (group.batches, group.writes) == (4, 4)  # taken, slow, then a and b alone after the shared batch failed


def test_max_batch_must_be_positive(factory) -> None:
    with pytest.raises(ValueError, match="max_batch"):
        GroupCommit(factory, max_batch=0)


def test_the_guard_is_held_around_each_transaction_from_before_it_begins(factory) -> None:
    """A guard (the prune gate) entered after BEGIN could wait for a holder that waits for this transaction's
    locks; it must span begin to commit, once per transaction, the retries of a failed batch included."""
    events: list[str] = []
    engine = factory.kw["bind"]
    event.listen(engine, "begin", lambda conn: events.append("begin"))
    event.listen(engine, "commit", lambda conn: events.append("commit"))
    event.listen(engine, "rollback", lambda conn: events.append("rollback"))

    class Guard:
        def __enter__(self) -> None:
            events.append("enter")

        def __exit__(self, *exc: object) -> None:
            events.append("exit")

    group = GroupCommit(factory, guard=Guard)
    group.run(_adder("taken"))
    assert events == ["enter", "begin", "commit", "exit"]
    events.clear()
    release = threading.Event()
    leader = _hold_leader(group, release)
    outcome: dict[str, object] = {}
    followers = _start(group, outcome, {"a": _adder("a"), "dup": _adder("taken")})
    _queued(group, 2)
    release.set()
    _join([leader, *followers])
    # the leader; the batch of two, rolled back; each again alone (the duplicate rolled back)
    ok, failed = ["enter", "begin", "commit", "exit"], ["enter", "begin", "rollback", "exit"]
    assert events == [*ok, *failed, *ok, *failed]
