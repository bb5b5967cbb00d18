"""Closing rounds: folding the stored updates into a new global model, its metrics, and the deadlines.

A close is the heaviest thing the service does (every update decoded and folded, the server
evaluation), and every client waits on it, so it runs under no lock GetTask, Heartbeat or
Push take, and in no write transaction:

1. under the shared lock, the round is marked ``closing`` (pushes and held GetTask long polls wait
   for the outcome, :meth:`Shared.settled`; a GetTask that is not held is answered Wait at once;
   heartbeats and fetches go on with the last global model);
2. a copy of the engine folds the round's updates, read in a read transaction, and closes; the
   server evaluates the new model;
3. one short write transaction locks the round, checks that the stored updates are exactly the
   ones folded (a push that committed meanwhile means folding again), and writes everything the
   close produced, as before, in one commit;
4. under the shared lock, the copy replaces the engine and the round is no longer open.

A failed close leaves the engine untouched and reloads from the store; the round stays open, and
a second failure of the same round with the same cause abandons it (:meth:`Closing.close`). A
deadline that finds the round no longer open in the store (another aggregator closed or abandoned
it) reloads too (``event=round_changed_elsewhere``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from datetime import datetime, timedelta
from typing import Any

import torch
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from aggregator_service import store
from aggregator_service.config import AggregatorSettings
from aggregator_service.logfmt import kv
from aggregator_service.low_priority import at_lowest_priority
from aggregator_service.metrics import total_dispersion
from aggregator_service.rounds import Federation, RoundOutcome
from aggregator_service.server_evaluation import evaluate_round
from aggregator_service.updates import ClientUpdate
from fedcore.keys import client_key
from fedwire.allocator import release_free_memory

from .ledger import Counts, Ledger
from .restore import load, save_strategy_groups, split_strategy_state, strategy_population
from .shared import OpenRound, Shared

__all__ = ["Closing"]

log = logging.getLogger("fedatoms.aggregator")


def load_eval_data(settings: AggregatorSettings) -> Any:
    """The server's ``eval_data`` fitted to the model, labels checked, or ``None`` without one."""
    if not settings.eval_data:
        return None
    from fedcore.datasource import evaluation_set
    from fedcore.model_input import Normalization

    norm = settings.federation.normalization
    return evaluation_set(
        settings.eval_data,
        settings.federation.spec.input_shape,
        settings.federation.spec.num_classes,
        None if norm is None else Normalization.from_dict(norm),
        settings.eval_data_dir,
        input_dtype=settings.federation.spec.input_dtype,
    )


class Closing:
    """Round closes and deadlines; no lock of its own: the open round's ``closing`` mark admits one close."""

    def __init__(self, shared: Shared, ledger: Ledger, eval_data: Any = None) -> None:
        self.shared = shared
        self.ledger = ledger
        self._eval_data: Any = eval_data if eval_data is not None else load_eval_data(shared.settings)
        # (round, cause) of the last failed close, and what was done about it; closes never overlap
        self._last_failure: tuple[int, str] | None = None
        self._action = "retry"

    def close(self, op: OpenRound, reason: str) -> None:
        """Close ``op``, which the caller marked ``closing``.

        A failure is logged with its cause and the round stays open for the next tick to try again;
        a second failure of the same round with the same cause abandons it (its updates are deleted,
        nothing is aggregated, the next GetTask samples a new cohort), so a close that cannot succeed,
        say an update whose factors overflow float32 when multiplied out, never spins. Failures of
        the database itself (a lock, a lost connection) are retried, never a reason to abandon.
        """
        try:
            at_lowest_priority(lambda: self._close(op, reason), name=f"close-{op.plan.round}")
        except Exception as exc:
            log.error(
                kv("round_close_failed", round=op.plan.round, cause=_cause(exc), action=self._action), exc_info=True
            )
        finally:
            with self.shared.lock:
                op.closing = False
                self.shared.settle()

    def _after_failure(self, round_: int, exc: Exception) -> None:
        """Retry or abandon a failed close; decided before the engine is reloaded, so no other close overlaps."""
        cause = _cause(exc)
        repeated = self._last_failure == (round_, cause) and not isinstance(exc, SQLAlchemyError | OSError)
        self._last_failure = (round_, cause)
        self._action = "retry"
        if repeated:
            shared = self.shared
            try:
                with shared.factory.begin() as s:
                    store.lock_round(s, shared.fed_row, round_)
                    self._abandon(s, round_, shared.clock())
            except Exception:  # the round is not open any more, or the database failed: the next tick decides
                log.exception(kv("round_abandon_failed", round=round_))
            else:
                self._action = "abandoned"

    def _abandon(self, s: Session, round_: int, now: datetime) -> None:
        """Abandon the open round in ``s``; the last of ``rounds`` ends the federation with it, as a close would."""
        shared = self.shared
        store.abandon_round(s, shared.fed_row, round_, now=now)
        if round_ >= shared.config.rounds:
            store.set_federation_state(s, shared.fed_row, "done")

    def _forget_open(self) -> None:
        """The open round is gone (abandoned, committed): no cohort; it counts toward ``rounds`` (under the lock)."""
        shared = self.shared
        if shared.open is not None:
            shared.last_ended = max(shared.last_ended, shared.open.plan.round)
            if shared.last_ended >= shared.config.rounds:
                shared.set_state("done")
        shared.open = None
        shared.federation.cohort = ()
        shared.settle()

    def _close(self, op: OpenRound, reason: str) -> RoundOutcome:
        shared, plan = self.shared, op.plan
        while True:
            drained: Counts = {}
            pruned_through: int | None = None
            try:
                release_free_memory()  # what the round's pushes left in the heap, before the close adds to it
                with shared.lock:
                    fed = shared.federation.fork()
                folded = self._fold(fed, op)
                release_free_memory()
                outcome = fed.close()
                round_metrics = self._round_metrics(fed, outcome)
                json_state, strategy_groups = split_strategy_state(fed.strategy)
                done = outcome.round >= shared.config.rounds
                keep = shared.settings.history_rounds
                # a close that prunes holds the gate alone until the watermark it committed is in memory
                with shared.prune_gate.prune() if keep is not None else nullcontext():
                    with shared.factory.begin() as s:
                        rnd = store.lock_round(s, shared.fed_row, plan.round)
                        # a push that committed after the read must be folded too: fold again
                        refold = rnd.state == "open" and _stored(s, shared.fed_row, plan.round) != folded
                        if not refold:
                            drained = self.ledger.write(s)  # the round's metrics sum its bytes
                            store.close_round(
                                s,
                                shared.fed_row,
                                plan.round,
                                new_tensors={
                                    n: (t, fed.versions[n], outcome.intervals[n])
                                    for n, t in outcome.result.tensors.items()
                                },
                                intervals=outcome.intervals,
                                round_metrics=round_metrics,
                                tensor_metrics=_tensor_metrics(fed, outcome),
                                transfers=[],
                                strategy_state=json_state,
                                policy_state=fed.policy.state_dict(),
                                strategy_tensors={},
                                next_round=None if done else plan.round + 1,
                            )
                            save_strategy_groups(s, shared.fed_row, strategy_groups)
                            if keep is not None:
                                pruned_through = store.prune_history(s, shared.fed_row, plan.round, keep)
                    # the watermark the ledger's writes read moves only now, committed (set before the commit, a
                    # write could skip the detail rows of rounds whose prune then rolls back), and before the gate
                    # lets writes in again (one that read the old one could write rows of a round just pruned)
                    if pruned_through is not None:
                        shared.history_pruned_through = pruned_through
            except Exception as exc:
                self.ledger.unwrite(drained)
                self._after_failure(plan.round, exc)
                load(shared)  # the transaction rolled back (or the round was abandoned): follow the store
                raise
            if not refold:
                break
            log.info(kv("round_close_refolded", round=plan.round))
        with shared.lock:
            shared.federation, shared.open, shared.last_ended = fed, None, plan.round
            if done:
                shared.set_state("done")
        log.info(
            kv(
                "round_closed",
                round=plan.round,
                reason=reason,
                reported=outcome.reported,
                cohort=len(plan.cohort),
                # the server's evaluation on eval_data, where it has one: an operator reading the log sees it
                **{k: round_metrics[k] for k in ("test_accuracy", "test_loss") if round_metrics.get(k) is not None},
            )
        )
        return outcome

    def _fold(self, fed: Federation, op: OpenRound) -> set[tuple[str, str]]:
        """Fold the round's stored updates into ``fed``; the (client id, update id) of each folded."""
        shared, plan = self.shared, op.plan
        folded: set[tuple[str, str]] = set()
        with Session(shared.reader) as s, s.begin():
            members = {
                cid: (client_key(number), float(tier))
                for cid, number, tier in s.execute(
                    select(store.Client.id, store.Client.number, store.Client.tier).where(
                        store.Client.id.in_(list(op.ids.values()))
                    )
                ).all()
            }
            if hasattr(fed.strategy, "num_clients_total"):  # SCAFFOLD's, FedDyn's, FedDC's N
                fed.strategy.num_clients_total = strategy_population(s, shared.fed_row)
            fed.begin(plan)
            for header, tensors, deltas in store.iter_round_updates(s, shared.fed_row, plan.round, lazy=True):
                folded.add((header.client_id, header.update_id))
                key, tier = members[header.client_id]
                fed.fold(
                    ClientUpdate(
                        client_id=key,
                        num_samples=header.num_samples,
                        tier=tier,
                        spec=fed.tier_spec(tier),
                        tensors=_AsTensors(tensors),
                        control_delta=None if deltas is None else _AsTensors(deltas),
                        metrics=dict(header.metrics or {}),
                        move_scale=header.move_scale,
                    )
                )
        return folded

    def _round_metrics(self, fed: Federation, outcome: RoundOutcome) -> dict[str, Any]:
        weights = {n: v for n, v in outcome.result.dispersion.items() if fed.spec.tensor(n).role != "buffer"}
        metrics: dict[str, Any] = {
            "dispersion": _finite_or_none(total_dispersion(weights)),
            "latent_clients": outcome.latent_clients,
            "extra": {
                "effective_dispersion": _finite_dict(outcome.result.effective_dispersion),
                "client_metrics": _finite_dict(outcome.result.metrics),
                "reported": outcome.reported,
                "cohort": len(outcome.cohort),
            },
        }
        if self._eval_data is not None:
            result = evaluate_round(fed, self._eval_data)
            metrics["test_accuracy"], metrics["test_loss"] = result.accuracy, _finite_or_none(result.loss)
            if result.tier_accuracy:
                metrics["extra"]["tier_accuracy"] = result.tier_accuracy
        return metrics

    def tick(self, now: datetime | None = None) -> None:
        """Deadlines: close with the quorum, else extend once, else abandon (the next GetTask resamples)."""
        shared = self.shared
        now = now or shared.clock()
        shared.refresh_state()
        with shared.lock:
            op = shared.open
            try:
                reason = self._due(now)
            except (store.RoundStateError, store.NotFound) as exc:
                # the database says the round is no longer open (another aggregator closed or abandoned it
                # while this one's lock session was gone): follow the database, not fail every tick on it
                changed: Exception | None = exc
            else:
                changed = None
                op = shared.open
                if reason is None or op is None:
                    return
                op.closing = True
        if changed is not None or op is None or reason is None:
            log.warning(
                kv("round_changed_elsewhere", round=op.plan.round if op else None, detail=str(changed), action="reload")
            )
            load(shared)
            return
        self.close(op, reason)

    def _due(self, now: datetime) -> str | None:
        """Why the open round must close now, if it must; extends or abandons it otherwise (under the lock)."""
        shared = self.shared
        op = shared.open
        if op is None or op.closing or shared.state != "running":
            return None
        if op.reported.issuperset(op.plan.cohort):
            return "cohort_complete"  # an earlier close attempt failed: try again
        if now < op.deadline:
            return None
        r, needed = op.plan.round, self._quorum(len(op.plan.cohort))
        if len(op.reported) >= needed:
            return "deadline_quorum"
        deadline = now + timedelta(seconds=shared.settings.deadline_seconds)
        with shared.factory.begin() as s:
            # A push commits before it re-takes the lock to count itself (group commit): read who
            # reported from the store, in the transaction that would extend or abandon the round,
            # so an acknowledged update is never abandoned with a quorum that was in fact met.
            store.lock_round(s, shared.fed_row, r)
            keys = {cid: key for key, cid in op.ids.items()}
            op.reported.update(keys[c] for c in store.reported_clients(s, shared.fed_row, r) if c in keys)
            met = len(op.reported) >= needed
            if not met and not op.extended:
                store.extend_round(s, shared.fed_row, r, deadline)
            elif not met:
                self._abandon(s, r, now)
        if met:
            return "deadline_quorum"
        if not op.extended:
            op.deadline, op.extended = deadline, True
            log.warning(kv("round_extended", round=r, reported=len(op.reported), needed=needed))
        else:
            self._forget_open()
            log.warning(kv("round_abandoned", round=r, reported=len(op.reported), needed=needed))
        return None

    def _quorum(self, cohort_size: int) -> int:
        return max(1, math.ceil(self.shared.settings.quorum * cohort_size - 1e-9))


class _AsTensors(Mapping[str, torch.Tensor]):
    """A stored update's arrays as tensors, each read from the store when looked up (never kept): a
    strategy that folds module by module holds one layer of the update, not the whole of it."""

    def __init__(self, stored: Mapping[str, Any]) -> None:
        self._stored = stored
        self.shapes = stored.shapes  # type: ignore[attr-defined]

    def __getitem__(self, name: str) -> torch.Tensor:
        return torch.from_numpy(self._stored[name])

    def __contains__(self, name: object) -> bool:
        return name in self._stored

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _stored(s: Session, fed: store.Federation, round_: int) -> set[tuple[str, str]]:
    """(client id, update id) of the round's stored updates."""
    rows = s.execute(
        select(store.Update.client_id, store.Update.update_id).where(
            store.Update.federation_id == fed.id, store.Update.round == round_
        )
    ).all()
    return {(cid, uid) for cid, uid in rows}


def _tensor_metrics(fed: Federation, outcome: RoundOutcome) -> list[dict[str, Any]]:
    rows = []
    for t in fed.spec.tensors:
        row: dict[str, Any] = {
            "name": t.name,
            "role": t.role,
            "interval": outcome.intervals[t.name],
            "version": fed.versions[t.name],
        }
        for key, source in (("d_l", outcome.discrepancy), ("dispersion", outcome.result.dispersion)):
            value = source.get(t.name)
            if value is not None and math.isfinite(value):
                row[key] = value
        rows.append(row)
    return rows


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _finite_dict(values: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if math.isfinite(v)}
