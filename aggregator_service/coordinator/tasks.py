"""Tasks and cohorts: what a polling client is told to do, opening rounds, and the model it downloads.

Rounds are planned exactly as the in-process simulator plans them: the same cohort sampler,
each client's task seeded with ``derive_seed(seed, round, client key)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session
from torch import Tensor

from aggregator_service import store
from aggregator_service.errors import FailedPrecondition
from aggregator_service.logfmt import kv
from fedcore.keys import client_key, derive_seed

from .answers import ClientInfo, Done, Train, Wait
from .restore import load
from .shared import OpenRound, Shared, client_ids

__all__ = ["Tasks"]

log = logging.getLogger("fedatoms.aggregator")


class Tasks:
    """GetTask, Heartbeat, FetchModel and pausing; no lock of its own (it reads the shared state)."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self._holds = threading.BoundedSemaphore(max(1, shared.settings.long_poll_waiters))

    def heartbeat(self, client: ClientInfo) -> tuple[float, int, int]:
        """``(server time, current round, last closed round)``; authentication refreshed last-seen."""
        shared = self.shared
        with shared.lock:
            current, closed = shared.current_round(), shared.federation.round
        return shared.clock().timestamp(), current, closed

    def round_outcome(self, round_: int) -> str:
        """What became of round ``round_``: ``open`` (or closing), ``closed``, ``abandoned`` or ``unknown``.

        A client that pushed for a round keeps its strategy state's step aside until it learns this
        (``HeartbeatRequest.round``); the open round is answered from memory, any other from the store,
        which keeps every round's row for the federation's life."""
        shared = self.shared
        with shared.lock:
            if shared.open is not None and shared.open.plan.round == round_:
                return "open"
        with Session(shared.reader) as s, s.begin():
            state = s.scalar(
                select(store.Round.state).where(
                    store.Round.federation_id == shared.fed_row.id, store.Round.number == round_
                )
            )
        if state == "open":  # opened by the store, not yet by this process (a reload in flight)
            return "open"
        return state if state in ("closed", "abandoned") else "unknown"

    def get_task(self, client: ClientInfo, wait_seconds: float = 0.0) -> Wait | Train | Done:
        """The client's task; with ``wait_seconds`` > 0 (a long poll), a Wait is held back until the answer
        changes or that long (capped at ``long_poll_seconds``).

        The rule that keeps held calls from starving the others: at most ``long_poll_waiters`` calls are
        held at once (the server's thread pool has that many threads more than its workers); a call
        past that bound is answered at once, with the usual retry-after. A call that is not held is never
        made to wait for a close in flight either: it is answered with a Wait, since no client can train
        before the close ends, while a held call waits on and answers with what the close led to.
        """
        shared = self.shared
        wait_seconds = min(wait_seconds, shared.settings.long_poll_seconds)
        if wait_seconds <= 0 or not self._holds.acquire(blocking=False):
            with shared.lock:
                if shared.open is not None and shared.open.closing:
                    # answered now, not after the close: whatever the close's outcome, nothing can be trained
                    # until it ends and the next round opens, so every client's answer is a Wait
                    return Wait(self._retry(), f"round {shared.open.plan.round} is closing")
                return self._task(client, self._retry())
        try:
            end = time.monotonic() + wait_seconds
            with shared.settled():
                while True:
                    task = self._task(client, 0.0)
                    remaining = end - time.monotonic()
                    if not isinstance(task, Wait) or remaining <= 0 or shared.stopping:
                        return task
                    shared.wait_change(shared.generation, remaining)
        finally:
            self._holds.release()

    def _task(self, client: ClientInfo, retry: float) -> Wait | Train | Done:
        """The answer now (under the settled lock); a Wait says ``retry`` seconds."""
        shared, config = self.shared, self.shared.config
        fed = shared.federation
        if shared.state == "done" or shared.last_ended >= config.rounds:  # an abandoned round counts
            return Done(f"federation finished after {shared.last_ended} rounds", fed.round)
        if shared.state == "paused":
            return Wait(retry, "federation paused by the operator")
        if shared.open is None:
            self._try_open()
        if shared.open is None:
            return Wait(retry, f"waiting for at least {config.min_clients} online clients")
        op, fed = shared.open, shared.federation
        r = op.plan.round
        if client.key not in op.plan.cohort:
            return Wait(retry, f"not selected for round {r}")
        if client.key in op.reported:
            return Wait(retry, f"round {r} update received; waiting for the round to close")
        strategy_config = dict(fed.strategy.client_config())
        if config.fp16:  # push in fp16 too, as the in-process transport does
            strategy_config["fp16_transport"] = True
        return Train(
            round=r,
            due=fed.tier_due(client.tier, op.plan.due),
            train_config=config.train_config(),
            strategy_config=strategy_config,
            continue_unsynced=op.plan.continue_unsynced,
            seed=derive_seed(config.seed, r, client.key),
            deadline=op.deadline,
            personal_atoms=config.personal_atoms,
            local=fed.local_tier_tensors(client.tier),
        )

    def _retry(self) -> float:
        settings = self.shared.settings
        if settings.poll_interval_seconds is not None:
            return float(settings.poll_interval_seconds)
        return float(min(5.0, settings.heartbeat_timeout_seconds / 4))

    def _try_open(self) -> None:
        shared = self.shared
        now = shared.clock()
        since = now - timedelta(seconds=shared.settings.heartbeat_timeout_seconds)
        fed, row = shared.federation, shared.fed_row
        with shared.factory.begin() as s:
            candidates = {client_key(c.number): c.id for c in store.online_clients(s, row, since)}
            if len(candidates) < shared.config.min_clients:
                return
            last = s.scalar(select(func.max(store.Round.number)).where(store.Round.federation_id == row.id))
            number = int(last or 0) + 1
            kept = dict(zip(fed.cohort, client_ids(s, row, fed.cohort), strict=True))
            plan = fed.plan(number, list(candidates))
            ids = {k: candidates.get(k) or kept[k] for k in plan.cohort}
            deadline = now + timedelta(seconds=shared.settings.deadline_seconds)
            try:
                cohort_ids = [ids[k] for k in plan.cohort]
                store.open_round(s, row, plan.round, cohort_ids, plan.due, plan.continue_unsynced, deadline)
            except store.RoundStateError:
                s.rollback()
                load(shared)  # another process opened or changed rounds: follow the database
                return
        shared.open = OpenRound(plan, deadline, False, ids)
        shared.settle()  # held polls of the new cohort answer now
        log.info(kv("round_opened", round=plan.round, cohort=len(plan.cohort), due=len(plan.due)))

    def fetch(
        self, client: ClientInfo, held: Mapping[str, int], include_server_control: bool = False
    ) -> tuple[list[tuple[str, Tensor, int]], list[tuple[str, Tensor, int]]]:
        """``(model tensors newer than held, server control)`` for the client's tier, in spec order."""
        with self.shared.lock:
            fed = self.shared.federation
            newer = fed.fetch(client.tier, held)
            order = fed.tier_spec(client.tier).names
            model = [(n, *newer[n]) for n in order if n in newer]
            control: list[tuple[str, Tensor, int]] = []
            if include_server_control and fed.strategy.client_config().get("scaffold"):
                sc = fed.strategy.server_control(fed.spec) or {}
                version = fed.round if fed.round > 0 else 0
                control = [(n, t, version) for n, t in sc.items()]
        return model, control

    def set_paused(self, paused: bool) -> None:
        """Pause (GetTask answers Wait, deadlines stop) or resume the federation."""
        shared = self.shared
        with shared.settled(), shared.factory.begin() as s:
            if shared.state == "done":
                raise FailedPrecondition("the federation is done; it cannot be paused or resumed")
            store.set_federation_state(s, shared.fed_row, "paused" if paused else "running")
            shared.set_state("paused" if paused else "running")
            shared.settle()
