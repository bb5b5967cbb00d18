"""Uploads: validating and storing a client's update, late pushes, and the open round's decoded updates.

An update is written outside the shared lock, so fetches and polls never wait on a commit;
the store re-checks in its transaction that the round is still open, so a close in between
refuses the update. It is acknowledged only after its commit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from sqlalchemy import select
from sqlalchemy.orm import Session

from aggregator_service import store
from aggregator_service.errors import FailedPrecondition, InvalidArgument
from aggregator_service.logfmt import kv
from aggregator_service.validation import check_header, check_tensors

from .answers import ClientInfo, PushResult
from .ledger import Ledger
from .shared import OpenRound, Shared

__all__ = ["DecodedUpdates", "Uploads"]

log = logging.getLogger("fedatoms.aggregator")

Arrays = dict[str, np.ndarray]


class DecodedUpdates:
    """The open round's updates as validated, kept so its close need not read back and decode every blob.

    Kept within a memory budget; the store still decides which updates count. Its one lock
    guards the kept arrays.
    """

    def __init__(self, budget_bytes: int = 256 * 2**20) -> None:
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self.kept: dict[tuple[str, str], tuple[Arrays, Arrays | None]] = {}  # (client id, update id) → arrays
        self._round: int | None = None
        self._bytes = 0

    def keep(self, round_: int, client_id: str, update_id: str, model: Arrays, deltas: Arrays | None) -> None:
        size = sum(a.nbytes for a in model.values()) + sum(a.nbytes for a in (deltas or {}).values())
        with self._lock:
            if self._round != round_:
                self._forget()
                self._round = round_
            if self._bytes + size <= self.budget_bytes:
                self.kept[(client_id, update_id)] = (model, deltas)
                self._bytes += size

    def of(self, round_: int) -> dict[tuple[str, str], tuple[Arrays, Arrays | None]] | None:
        """A copy of what is kept for ``round_``, or None."""
        with self._lock:
            return dict(self.kept) if self._round == round_ else None

    def forget(self) -> None:
        with self._lock:
            self._forget()

    def _forget(self) -> None:
        self.kept, self._round, self._bytes = {}, None, 0


class _LatePush(FailedPrecondition):
    """A push for a round that is not open (see :meth:`Uploads._refuse_late`)."""


class Uploads:
    """PushUpdate; no lock of its own. ``close`` closes a round its push completed (the caller marked it closing)."""

    def __init__(
        self, shared: Shared, ledger: Ledger, decoded: DecodedUpdates, close: Callable[[OpenRound, str], None]
    ) -> None:
        self.shared = shared
        self.ledger = ledger
        self.decoded = decoded
        self._close = close
        self._declared: dict[str, int] = {}  # client id → num_samples it registered with (never changes)

    def _declared_samples(self, client_id: str) -> int:
        """The sample count a client registered with (0: none declared), read once per client."""
        declared = self._declared.get(client_id)
        if declared is None:
            with self.shared.reader.connect() as conn:
                profile = conn.execute(select(store.Client.profile).where(store.Client.id == client_id)).scalar_one()
            declared = self._declared[client_id] = int((profile or {}).get("num_samples") or 0)
        return declared

    def push(
        self,
        client: ClientInfo,
        round_: int,
        update_id: str,
        num_samples: int,
        metrics: Mapping[str, float],
        tensors: Mapping[str, Any],
        control_delta: Mapping[str, Any] | None = None,
        nbytes: int | None = None,
        tensor_bytes: Mapping[str, int] | None = None,
    ) -> PushResult:
        """Validate and store one update; acknowledged only after the commit. Closes the round when complete."""
        shared = self.shared
        clean_metrics = check_header(update_id, num_samples, metrics)
        allowed = self._declared_samples(client.id) or shared.settings.max_client_samples
        if num_samples > allowed:
            raise InvalidArgument(
                f"num_samples {num_samples} is more than the {allowed} samples client {client.id} registered "
                "with: an update weighs what its client's data does"
            )
        try:
            with shared.settled():  # a push for a closing round is answered as the close decides
                op = shared.open
                fed = shared.federation
                if op is None or op.plan.round != round_:
                    current = f"round {op.plan.round} is open" if op else "no round is open"
                    raise _LatePush(
                        f"round {round_} is not open ({current}, last closed: {fed.round}); "
                        "the update came too late or is for another round: poll GetTask for the current task"
                    )
                if client.key not in op.plan.cohort:
                    raise FailedPrecondition(f"client {client.id} is not in round {round_}'s cohort: poll GetTask")
                spec = fed.tier_spec(client.tier)
                due = fed.tier_due(client.tier, op.plan.due)
                scaffold = bool(fed.strategy.client_config().get("scaffold"))
                start = dict(fed.global_tensors)  # the values this round began from (a close replaces, never mutates)
        except _LatePush as late:  # answered outside the lock: it writes
            return self._refuse_late(client, round_, update_id, late)
        model, deltas = check_tensors(spec, round_, due, tensors, control_delta, scaffold=scaffold)
        shared.settings.update_bounds.check(spec, {n: torch.from_numpy(a) for n, a in model.items()}, start)
        size = nbytes if nbytes is not None else sum(a.nbytes for a in [*model.values(), *(deltas or {}).values()])
        if tensor_bytes is None:
            tensor_bytes = {}
            for n, a in [*model.items(), *(deltas or {}).items()]:
                tensor_bytes[n] = tensor_bytes.get(n, 0) + a.nbytes

        def write(s: Session) -> bool:
            return store.store_update(
                s,
                shared.fed_row,
                round_,
                client.id,
                update_id,
                int(num_samples),
                clean_metrics,
                model,
                deltas,
                finite=True,  # check_tensors refused NaN and Inf
            )[1]

        upload = (round_, client.id, update_id)
        self.ledger.uploading(upload, client, size, tensor_bytes)
        try:
            duplicate = shared.writes.run(write)
        except store.UpdateConflict as exc:
            raise FailedPrecondition(f"{exc}; a retry must reuse the original update_id") from exc
        except store.RoundStateError as exc:  # the round closed after the checks above: late after all
            return self._refuse_late(client, round_, update_id, FailedPrecondition(f"{exc}: poll GetTask"))
        except (store.NotInCohort, store.NotFound) as exc:
            raise FailedPrecondition(f"{exc}: poll GetTask for the current task") from exc
        finally:
            uncounted = self.ledger.uploaded(upload)  # else a close counted it
        if not duplicate and uncounted:
            self.ledger.count(client, "push", round_, size, tensor_bytes)
        log.info(
            kv("update_stored", round=round_, client=client.id, duplicate=duplicate, tensors=len(model), bytes=size)
        )
        complete = None
        with shared.lock:
            now_open = shared.open  # the same round, or a reload of it, unless it closed (with this update:
            if now_open is not None and now_open.plan.round == round_:  # it committed first) or was abandoned
                now_open.reported.add(client.key)
                if not duplicate:
                    self.decoded.keep(round_, client.id, update_id, model, deltas)
                if not now_open.closing and now_open.reported.issuperset(now_open.plan.cohort):
                    now_open.closing, complete = True, now_open
        if complete is not None:
            self._close(complete, "cohort_complete")
        note = "duplicate of an update already stored" if duplicate else f"stored {len(model)} tensors, {size} bytes"
        return PushResult(True, duplicate, round_, note)

    def _refuse_late(self, client: ClientInfo, round_: int, update_id: str, refusal: FailedPrecondition) -> PushResult:
        """A push for a round that is not open: a retry of an update that round consumed is a duplicate (its
        acknowledgement was lost, then its push closed the round); anything else is refused, and a straggler's
        push is counted in its round's ``late_pushes``."""
        shared = self.shared

        def write(s: Session) -> bool:
            return store.refuse_late_push(s, shared.fed_row, round_, client.id, update_id) is not None

        if shared.writes.run(write):
            log.info(kv("update_stored", round=round_, client=client.id, duplicate=True, consumed=True))
            return PushResult(True, True, round_, f"duplicate of an update consumed by round {round_}")
        log.warning(kv("late_push_refused", round=round_, client=client.id, update_id=update_id))
        raise refusal
