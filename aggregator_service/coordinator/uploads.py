"""Uploads: validating and storing a client's update, and late pushes.

An update is written outside the shared lock, so fetches and polls never wait on a commit;
the store re-checks in its transaction that the round is still open, so a close in between
refuses the update. It is acknowledged only after its commit. Nothing of it stays in memory
after that: the close reads the round's updates back from the store one at a time, so the
service's memory does not grow with the cohort.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

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

__all__ = ["Uploads"]

log = logging.getLogger("fedatoms.aggregator")


class _LatePush(FailedPrecondition):
    """A push for a round that is not open (see :meth:`Uploads._refuse_late`)."""


class Uploads:
    """PushUpdate; no lock of its own. ``close`` closes a round its push completed (the caller marked it closing)."""

    #: clients whose declared sample count is remembered; past it the memory starts over (a miss is one
    #: read), so the ids a long-running federation enrols and forgets never pile up
    DECLARED_CACHE = 65_536

    def __init__(self, shared: Shared, ledger: Ledger, close: Callable[[OpenRound, str], None]) -> None:
        self.shared = shared
        self.ledger = ledger
        self._close = close
        self._declared: dict[str, int] = {}  # client id → num_samples it registered with (never changes)

    def _declared_samples(self, client_id: str) -> int:
        """The sample count a client registered with (0: none declared), read once per client."""
        declared = self._declared.get(client_id)
        if declared is None:
            with self.shared.reader.connect() as conn:
                profile = conn.execute(select(store.Client.profile).where(store.Client.id == client_id)).scalar_one()
            declared = int((profile or {}).get("num_samples") or 0)
            if len(self._declared) >= self.DECLARED_CACHE:
                self._declared.clear()
            self._declared[client_id] = declared
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
        result, complete = self.store(
            client, round_, update_id, num_samples, metrics, tensors, control_delta, nbytes, tensor_bytes
        )
        if complete is not None:
            self.close_complete(complete)
        return result

    def close_complete(self, op: OpenRound) -> None:
        """Close the round :meth:`store` found complete (and marked closing)."""
        self._close(op, "cohort_complete")

    def store(
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
    ) -> tuple[PushResult, OpenRound | None]:
        """:meth:`push` without the close: the result, and the round to close (marked closing) when this update
        completed it. The caller drops the update's arrays before it closes the round."""
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
                bounds = shared.settings.update_bounds
                # what this client started from, when a norm bound measures its move (cached per tier and version)
                received = fed.received(client.tier) if bounds.max_norm is not None else start
        except _LatePush as late:  # answered outside the lock: it writes
            return self._refuse_late(client, round_, update_id, late), None
        model, deltas = check_tensors(spec, round_, due, tensors, control_delta, scaffold=scaffold)
        as_tensors = {n: torch.from_numpy(a) for n, a in model.items()}
        try:
            bounds.check(spec, as_tensors, start, received)
        except InvalidArgument:
            if not self._stored(client, round_, update_id):
                raise
            # a retry of an update stored under other bounds (the aggregator restarted since): bounds bind a push
            # under the settings it was checked by, so it is answered as a duplicate, with the scale it was told
        move_scale = bounds.move_scale(spec, as_tensors, received)  # the fold's clip, from the same round model
        del as_tensors
        size = nbytes if nbytes is not None else sum(a.nbytes for a in [*model.values(), *(deltas or {}).values()])
        if tensor_bytes is None:
            tensor_bytes = {}
            for n, a in [*model.items(), *(deltas or {}).items()]:
                tensor_bytes[n] = tensor_bytes.get(n, 0) + a.nbytes

        def write(s: Session) -> tuple[float | None, bool]:
            header, duplicate = store.store_update(
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
                move_scale=move_scale,
            )
            if not duplicate:  # its bytes in the same transaction: a kill loses both or neither
                self.ledger.write_push(s, client, round_, size, tensor_bytes)
            return header.move_scale, duplicate

        try:
            told, duplicate = shared.writes.run(write)
        except store.UpdateConflict as exc:
            raise FailedPrecondition(str(exc)) from exc
        except store.RoundStateError as exc:  # the round closed after the checks above: late after all
            refusal = FailedPrecondition(f"{exc}: poll GetTask")
            return self._refuse_late(client, round_, update_id, refusal, move_scale), None
        except (store.NotInCohort, store.NotFound) as exc:
            raise FailedPrecondition(f"{exc}: poll GetTask for the current task") from exc
        log.info(
            kv("update_stored", round=round_, client=client.id, duplicate=duplicate, tensors=len(model), bytes=size)
        )
        complete = None
        with shared.lock:
            now_open = shared.open  # the same round, or a reload of it, unless it closed (with this update:
            if now_open is not None and now_open.plan.round == round_:  # it committed first) or was abandoned
                now_open.reported.add(client.key)
                if not now_open.closing and now_open.reported.issuperset(now_open.plan.cohort):
                    now_open.closing, complete = True, now_open
        note = "duplicate of an update already stored" if duplicate else f"stored {len(model)} tensors, {size} bytes"
        if told is not None:  # a retry is answered what its first push was told, which the fold applies
            move_scale = told
        return PushResult(True, duplicate, round_, note, move_scale), complete

    def stored_already(self, client: ClientInfo, round_: int, update_id: str) -> PushResult | None:
        """A push that repeats an update already stored (its acknowledgement was lost on the way), answered from
        its header: on a bad link, reading the rest would cost the client its whole upload again. ``None``: not
        stored (yet), so the push is received as any other; a stored update's round it consumed still answers."""
        shared = self.shared
        with Session(shared.reader) as s, s.begin():
            found = store.retried_update(s, shared.fed_row, round_, client.id, update_id)
            if found is None:
                return None
            told = found.move_scale
        with shared.lock:
            still_open = shared.open is not None and shared.open.plan.round == round_
        log.info(kv("update_stored", round=round_, client=client.id, duplicate=True, from_header=True))
        note = (
            "duplicate of an update already stored"
            if still_open
            else f"duplicate of an update consumed by round {round_}"
        )
        return PushResult(True, True, round_, note, self._scale_told(told))

    def _scale_told(self, told: float | None, measured: float | None = None) -> float:
        """The move scale a duplicate is answered: what its first push was told, else the one just measured, else
        not known (0) on a clipping server, 1 on one that never clips (a version that kept no scale stored it)."""
        if told is not None:
            return told
        if measured is not None:
            return measured
        return 0.0 if self.shared.settings.update_bounds.clips else 1.0

    def _stored(self, client: ClientInfo, round_: int, update_id: str) -> bool:
        shared = self.shared
        with Session(shared.reader) as s, s.begin():
            return store.retried_update(s, shared.fed_row, round_, client.id, update_id) is not None

    def _refuse_late(
        self,
        client: ClientInfo,
        round_: int,
        update_id: str,
        refusal: FailedPrecondition,
        move_scale: float | None = None,
    ) -> PushResult:
        """A push for a round that is not open: a retry of an update that round consumed is a duplicate (its
        acknowledgement was lost, then its push closed the round); anything else is refused, and a straggler's
        push is counted in its round's ``late_pushes``. ``move_scale``: the fold's scale, when this push was
        checked against its round's model before the round closed."""
        shared = self.shared

        def write(s: Session) -> tuple[bool, float | None]:
            consumed = store.refuse_late_push(s, shared.fed_row, round_, client.id, update_id)
            return consumed is not None, None if consumed is None else consumed.move_scale

        consumed, told = shared.writes.run(write)
        if consumed:
            log.info(kv("update_stored", round=round_, client=client.id, duplicate=True, consumed=True))
            scale = self._scale_told(told, move_scale)  # what its push was told, and its round's fold applied
            return PushResult(True, True, round_, f"duplicate of an update consumed by round {round_}", scale)
        with shared.lock:
            # a round not opened yet (past the last ended one, abandoned too): no straggler, a confused client
            early = round_ > max(shared.current_round(), shared.last_ended)
        event = "early_push_refused" if early else "late_push_refused"
        log.warning(kv(event, round=round_, client=client.id, update_id=update_id))
        raise refusal
