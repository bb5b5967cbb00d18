"""What every room reads: the federation engine, its open round and its state, under one lock.

That lock is the one GetTask, Heartbeat, Fetch and Push take, so nothing heavy runs under it:
a close computes on a copy of the engine and swaps the result in (see :mod:`.closing`). While
a close is in flight its round is marked ``closing``; callers whose answer depends on how the
close ends wait for it in :meth:`Shared.settled`, and get the answer they would have got had
the close run under the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from aggregator_service import store
from aggregator_service.config import AggregatorSettings
from aggregator_service.group_commit import GroupCommit
from aggregator_service.rounds import Federation, RoundPlan
from fedcore.keys import client_key, client_number

from .prune_gate import PruneGate

__all__ = ["OpenRound", "Shared", "client_ids", "client_keys"]


@dataclass
class OpenRound:
    plan: RoundPlan  # cohort as engine keys
    deadline: datetime
    extended: bool
    ids: dict[str, str]  # engine key → client id, for the cohort
    reported: set[str] = field(default_factory=set)  # engine keys
    closing: bool = False  # a close is computing this round: its outcome is not decided yet


class Shared:
    """The federation's in-memory state, its store handles, and the lock that guards the state."""

    fed_row: store.Federation
    federation: Federation

    def __init__(
        self,
        settings: AggregatorSettings,
        factory: sessionmaker[Session],
        clock: Callable[[], datetime],
        enrollment_iterations: int,
    ) -> None:
        self.settings = settings
        self.config = settings.federation
        self.clock = clock
        self.factory = factory
        self.reader = _reader_for(factory)
        self.prune_gate = PruneGate()  # no write of per-client history in flight while a close prunes it
        # pushes and evaluation reports: one commit per batch
        self.writes = GroupCommit(factory, guard=self.prune_gate.write)
        self.iterations = enrollment_iterations
        self.lock = threading.RLock()
        self._settled = threading.Condition(self.lock)
        self.open: OpenRound | None = None
        # the latest round that ended, closed or abandoned: an abandoned round counts toward ``rounds``
        # (``federation.round`` is the latest closed, the model's)
        self.last_ended = 0
        self.state = "running"
        self._state_changes = 0  # in-process changes of ``state`` (:meth:`set_state`)
        # ``federations.history_pruned_through``: read at load, moved only by this process's closes
        # (``prune_history``, set once the close has committed: never ahead of the database), passed to every
        # ledger write
        self.history_pruned_through = 0
        # bumped by every change a long-polling GetTask may be waiting for (:meth:`settle`)
        self.generation = 0
        self.stopping = False  # the server shuts down: held calls answer now
        self.on_reload: list[Callable[[], None]] = []  # what must forget the open round when it is reloaded

    @contextmanager
    def settled(self) -> Iterator[None]:
        """The lock, once no close is in flight: for answers that depend on whether the round closed."""
        with self.lock:
            while self.open is not None and self.open.closing:
                self._settled.wait()
            yield

    def settle(self) -> None:
        """Wake the callers waiting in :meth:`settled` or :meth:`wait_change` (the caller holds the lock).

        Called whenever what GetTask answers may have changed: a close ended, a round opened or was
        abandoned, the federation was reloaded, paused, resumed, or a client enrolled.
        """
        self.generation += 1
        self._settled.notify_all()

    def wait_change(self, seen: int, timeout: float) -> None:
        """Wait (the caller holds the lock, released while waiting) until :meth:`settle` ran after the
        caller read ``generation == seen``, or ``timeout`` seconds passed; then until no close is in flight."""
        self._settled.wait_for(lambda: self.generation != seen or self.stopping, timeout)
        while self.open is not None and self.open.closing:
            self._settled.wait()

    def stop_waiting(self) -> None:
        """Answer every held call now, and hold none from here on (shutdown)."""
        with self.lock:
            self.stopping = True
            self.settle()

    def current_round(self) -> int:
        """The open round, else the last closed (the caller holds the lock)."""
        return self.open.plan.round if self.open else self.federation.round

    def set_state(self, state: str) -> None:
        """The federation's state as this process just made it (the caller holds the lock)."""
        self.state = state
        self._state_changes += 1

    def refresh_state(self) -> None:
        """Follow the state another process (the dashboard) may have written: read without the write lock
        (SQLite's reader engine) and outside the shared lock, which is taken only to change it. A change this
        process made meanwhile (a pause, the last round's close) is newer than what was read: it stands."""
        with self.lock:
            changes = self._state_changes
        with self.reader.connect() as conn:
            state = conn.execute(select(store.Federation.state).where(store.Federation.id == self.fed_row.id)).scalar()
        with self.lock:
            if state is not None and state != self.state and self._state_changes == changes:
                self.set_state(state)
                self.settle()


def client_keys(s: Session, ids: Any) -> dict[str, str]:
    """Client id → engine key, for the given ids."""
    rows = s.execute(select(store.Client.id, store.Client.number).where(store.Client.id.in_(list(ids)))).all()
    return {cid: client_key(number) for cid, number in rows}


def client_ids(s: Session, fed: store.Federation, keys: Any) -> list[str]:
    """Engine key → client id, in the order given."""
    numbers = [client_number(k) for k in keys]
    found = dict(
        s.execute(
            select(store.Client.number, store.Client.id).where(
                store.Client.federation_id == fed.id, store.Client.number.in_(numbers)
            )
        ).all()
    )
    return [found[n] for n in numbers]


def _reader_for(factory: sessionmaker[Session]) -> Engine:
    """An engine for reads that take no lock: on a SQLite file, one that begins DEFERRED (WAL readers
    never wait for the writer); elsewhere the writer's own engine."""
    bind = factory.kw["bind"]
    if bind.dialect.name != "sqlite" or bind.url.database in (None, "", ":memory:"):
        return bind
    return store.create_engine_for(bind.url, sqlite_begin="DEFERRED")
