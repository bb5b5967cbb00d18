"""The coordinator as the servicer sees it: one object, whose calls each go to the room that does the job.

It owns the shared state (:class:`.shared.Shared`: the federation engine, the open round, the
state, the lock over them) and wires the rooms together; it decides nothing itself.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from aggregator_service import store
from aggregator_service.config import AggregatorSettings
from aggregator_service.rounds import Federation, RoundPlan

from .closing import Closing, load_eval_data
from .evaluations import Evaluations
from .ledger import Ledger
from .registry import Registry
from .restore import load
from .shared import Shared
from .tasks import Tasks
from .uploads import Uploads

__all__ = ["Coordinator"]


class Coordinator:
    """Rounds of one federation, durable in the store; thread-safe."""

    def __init__(
        self,
        settings: AggregatorSettings,
        factory: sessionmaker[Session],
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        enrollment_iterations: int = store.ENROLLMENT_PBKDF2_ITERATIONS,
        eval_data: Any = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.factory = factory
        self.shared = shared = Shared(settings, factory, clock, enrollment_iterations)
        self.registry = Registry(shared)
        self.ledger = Ledger(shared)
        self.closing = Closing(shared, self.ledger, eval_data)
        self.uploads = Uploads(shared, self.ledger, close=self.closing.close)
        self.tasks = Tasks(shared)
        self.evaluations = Evaluations(shared)
        # what the servicer calls, each answered by its room
        self.register = self.registry.register
        self.authenticate = self.registry.authenticate
        self.heartbeat = self.tasks.heartbeat
        self.round_outcome = self.tasks.round_outcome
        self.get_task = self.tasks.get_task
        self.set_paused = self.tasks.set_paused
        self.fetch = self.tasks.fetch
        self.download_round = self.ledger.download_round
        self.record_download = self.ledger.record_download
        self.push = self.uploads.push
        self.store_update = self.uploads.store
        self.stored_already = self.uploads.stored_already
        self.close_complete = self.uploads.close_complete
        self.report_evaluation = self.evaluations.report_evaluation
        load(shared)

    @classmethod
    def from_settings(cls, settings: AggregatorSettings, **kwargs: Any) -> Coordinator:
        """Read the evaluation data (refused before the database is touched), migrate the database to the
        newest schema, connect, and load (or create) the federation."""
        eval_data = load_eval_data(settings)
        store.upgrade(settings.database_url)
        factory = store.session_factory(store.create_engine_for(settings.database_url))
        return cls(settings, factory, eval_data=eval_data, **kwargs)

    # -- the shared state

    @property
    def federation(self) -> Federation:
        return self.shared.federation

    @property
    def state(self) -> str:
        return self.shared.state

    @property
    def open_round(self) -> RoundPlan | None:
        with self.shared.lock:
            return self.shared.open.plan if self.shared.open else None

    def reload(self) -> None:
        """Rebuild the in-memory federation from the database, once no close is in flight: another aggregator
        may have moved the federation on (it held the lock while this one's lock session was gone)."""
        with self.shared.settled():
            load(self.shared)

    def flush(self) -> None:
        """Write counted transfers and deferred last-seen times now (the ticker: every second; shutdown)."""
        self.ledger.flush(self.registry.drain_touches())

    def tick(self, now: datetime | None = None) -> None:
        """Deadlines: close with the quorum, else extend once, else abandon (the next GetTask resamples)."""
        now = now or self.clock()
        self.flush()
        self.closing.tick(now)
