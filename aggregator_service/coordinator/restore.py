"""Rebuilding the in-memory federation from the store: at start, and whenever memory may disagree with it.

A restarted aggregator continues the open round where it stood; a failed close, or a round
another process changed, is followed by a reload, so memory never runs ahead of what committed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from torch import Tensor

from aggregator_service import store
from aggregator_service.config import KEYS_SINCE, inert_keys, recorded_normalization, stored_keys
from aggregator_service.database_url import shown
from aggregator_service.logfmt import kv
from aggregator_service.rounds import Federation, RoundPlan
from aggregator_service.strategies import Strategy
from fedcore.datasource import describe

from .shared import OpenRound, Shared, client_keys

__all__ = ["load", "save_strategy_groups", "split_strategy_state", "strategy_population"]

log = logging.getLogger("fedatoms.aggregator")

# Keys of the federation config an operator may change between restarts (everything else defines the run).
_MUTABLE_CONFIG_KEYS = frozenset({"rounds"})

#: method keys whose default a later release changed: (the old default, the new one). A federation stored
#: with the old default and configured with the new one (an upgrade, the operator's settings unchanged)
#: keeps the old value, for the server and for the clients it trains, instead of being refused
_DEFAULTS_CHANGED: dict[str, tuple[Any, Any]] = {"atom_lr": ("scaled", "preconditioned"), "num_atoms": (9, None)}


def load(shared: Shared) -> None:
    """(Re)build the in-memory federation from the database; create it on first start."""
    for forget in shared.on_reload:
        forget()
    settings = shared.settings
    with shared.lock, shared.factory.begin() as s:
        row = store.get_federation(s, settings.federation_name)
        created = row is None
        if row is None:
            row = store.create_federation(
                s,
                settings.federation_name,
                _config_json(shared),
                settings.enrollment_secret,
                iterations=shared.iterations,
            )
        else:
            kept = {
                k: old
                for k, (old, new) in _DEFAULTS_CHANGED.items()
                if row.config.get(k) == old and getattr(shared.config, k) == new
            }
            if kept:
                log.warning(kv("federation_keeps_old_defaults", name=settings.federation_name, keeps=kept))
                shared.config = replace(shared.config, **kept)
            _record_benchmark_normalization(shared, row)
            stored_norm = row.config.get("normalization")
            if stored_norm is not None and shared.config.normalization is None:
                # recorded at creation (given, or a benchmark's with eval_data): the clients normalize by it
                # still, whether or not this start names it (eval_data turned off, say)
                shared.config = replace(shared.config, normalization=stored_norm)
            _check_config(shared, row.config)
            for key in _MUTABLE_CONFIG_KEYS:  # what the dashboard shows as planned follows the configuration
                if row.config.get(key) != getattr(shared.config, key):
                    row.config = {**row.config, key: getattr(shared.config, key)}
        total = strategy_population(s, row)
        unread = inert_keys(shared.config.interval_policy, shared.config.tiers, shared.config.cohort)
        predates = {k: v for k, v in KEYS_SINCE.items() if not created and k not in row.config and k not in unread}
        if predates:
            log.info(kv("federation_predates_keys", name=settings.federation_name, keeps=predates))
            shared.config = replace(shared.config, **predates)  # for the server and the clients it trains
        fed = shared.config.build_federation(num_clients_total=max(1, total))
        fed.bounds = settings.update_bounds
        if created:
            intervals = fed.policy.intervals()
            store.save_global_tensors(s, row, {n: (t, 0, intervals[n]) for n, t in fed.global_tensors.items()})
            json_state, groups = split_strategy_state(fed.strategy)
            save_strategy_groups(s, row, groups)
            store.save_engine_state(s, row, json_state, fed.policy.state_dict(), 0)
        else:
            _restore(s, row, fed)
        shared.fed_row, shared.federation = row, fed
        ended = s.scalar(
            select(func.max(store.Round.number)).where(
                store.Round.federation_id == row.id, store.Round.state.in_(("closed", "abandoned"))
            )
        )
        shared.last_ended = int(ended or 0)
        if shared.config.rounds < shared.last_ended:  # the record would read "3 planned" beside "6 closed"
            raise ValueError(
                f"rounds = {shared.config.rounds} is below the {shared.last_ended} rounds federation "
                f"{settings.federation_name!r} has already ended: rounds only grow (a higher value extends a "
                f"finished federation). Set rounds ≥ {shared.last_ended}"
            )
        if row.state == "done" and shared.last_ended < shared.config.rounds:  # rounds raised: it goes on
            row.state = "running"
            log.info(
                kv(
                    "federation_extended",
                    name=settings.federation_name,
                    after=shared.last_ended,
                    rounds=shared.config.rounds,
                )
            )
        elif row.state != "done" and shared.last_ended >= shared.config.rounds:  # ended before it was marked so
            row.state = "done"
        shared.set_state(row.state)
        shared.history_pruned_through = int(row.history_pruned_through or 0)
        shared.open = _load_open_round(s, row, fed)
        shared.settle()
    log.info(
        kv(
            "federation_loaded",
            name=settings.federation_name,
            created=created,
            round=shared.federation.round,
            open_round=shared.open.plan.round if shared.open else None,
            state=shared.state,
        )
    )


def split_strategy_state(strategy: Strategy) -> tuple[dict[str, Any], dict[str, dict[str, Tensor]]]:
    """The strategy's state as JSON, and its tensor groups by kind (``Strategy.state_tensors``, stored as blobs)."""
    state = strategy.state_dict()
    kinds = set(strategy.state_tensors)
    groups = {k: dict(state.get(k, {})) for k in strategy.state_tensors}
    return {k: v for k, v in state.items() if k not in kinds}, groups


def save_strategy_groups(s: Session, row: store.Federation, groups: Mapping[str, Mapping[str, Tensor]]) -> None:
    """Write each tensor group of the strategy's state as strategy tensors of its kind."""
    for kind, tensors in groups.items():
        store.save_strategy_tensors(s, row, tensors, kind=kind)


def _config_json(shared: Shared) -> dict[str, Any]:
    return json.loads(json.dumps(shared.config.to_dict()))


def _record_benchmark_normalization(shared: Shared, row: store.Federation) -> None:
    """A federation stored before a benchmark's normalization was recorded (``eval_data`` a benchmark) trained
    on that benchmark's pixels all along: it gets the record now, instead of a refusal to restart."""
    current = shared.config.normalization
    if row.config.get("normalization") is None and current is not None:
        eval_data = shared.settings.eval_data
        if eval_data is not None and describe(eval_data) == "bundled":
            if current == recorded_normalization(eval_data):
                row.config = {**row.config, "normalization": current}
                log.info(kv("federation_normalization_recorded", dataset=eval_data, **current))


def _check_config(shared: Shared, stored: Mapping[str, Any]) -> None:
    current = _config_json(shared)
    was = stored_keys(stored)
    # a key neither the stored method nor the configured one reads is no part of either (an older release
    # accepted one set to no effect; a new config refuses it, so the operator removes it to restart)
    unread = set(inert_keys(was.interval_policy, was.tiers, was.cohort)) & set(
        inert_keys(shared.config.interval_policy, shared.config.tiers, shared.config.cohort)
    )
    differ = sorted(
        k
        for k in set(stored) | set(current)
        if k not in _MUTABLE_CONFIG_KEYS
        and k not in unread
        and (k in stored or k not in KEYS_SINCE)
        and stored.get(k) != current.get(k)
    )
    if differ:
        settings = shared.settings
        detail = ", ".join(f"{k}: stored {stored.get(k)!r}, configured {current.get(k)!r}" for k in differ[:6])
        raise ValueError(
            f"federation {settings.federation_name!r} in {shown(settings.database_url)} was created with a "
            f"different method ({detail}). Use the original [federation] settings, or a new federation_name "
            "to start another federation in the same database"
        )


def _restore(s: Session, row: store.Federation, fed: Federation) -> None:
    loaded = store.load_global_tensors(s, row)
    missing = set(fed.spec.names) - set(loaded)
    if missing:
        raise ValueError(f"the database lacks global tensors {sorted(missing)[:5]}; was it written by another model?")
    for name in fed.spec.names:
        array, version, _interval = loaded[name]
        fed.global_tensors[name] = torch.from_numpy(array)
        fed.versions[name] = version
    if row.policy_state:
        fed.policy.load_state_dict(row.policy_state)
    strategy_state = dict(row.strategy_state or {})
    for kind in fed.strategy.state_tensors:
        tensors = store.load_strategy_tensors(s, row, kind)
        if tensors:
            strategy_state[kind] = {n: torch.from_numpy(a) for n, a in tensors.items()}
    if strategy_state:
        fed.strategy.load_state_dict(strategy_state)
    last_closed = s.scalar(
        select(func.max(store.Round.number)).where(store.Round.federation_id == row.id, store.Round.state == "closed")
    )
    fed.round = int(last_closed or 0)
    latest = s.scalar(
        select(store.Round).where(store.Round.federation_id == row.id).order_by(store.Round.number.desc()).limit(1)
    )
    # a kept cohort continues after a restart; an abandoned round's cohort is resampled
    kept = latest is not None and latest.state != "abandoned"
    fed.cohort = tuple(sorted(client_keys(s, latest.cohort).values())) if kept and latest is not None else ()


def _load_open_round(s: Session, row: store.Federation, fed: Federation) -> OpenRound | None:
    rnd = store.get_open_round(s, row)
    if rnd is None:
        return None
    keys = client_keys(s, rnd.cohort)
    plan = RoundPlan(rnd.number, tuple(sorted(keys.values())), tuple(rnd.due), bool(rnd.continue_unsynced))
    fed.cohort = plan.cohort
    reported = {keys[c] for c in store.reported_clients(s, row, rnd.number) if c in keys}
    return OpenRound(plan, rnd.deadline, bool(rnd.extended), {k: i for i, k in keys.items()}, reported)


def strategy_population(s: Session, row: store.Federation) -> int:
    """SCAFFOLD's, FedDyn's and FedDC's N: every client the federation enrolled, revoked ones included.

    Their server state is a mean over all clients (``c = (1/N) Σ c_i``), and the sum keeps each client's
    last contribution, a revoked client's too: the papers' m, which a client that is never sampled again
    does not change. Counting only the clients enrolled now divided the same sum by fewer.
    """
    return max(1, store.count_clients(s, row))
