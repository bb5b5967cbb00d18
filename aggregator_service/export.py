"""Operator actions on a federation's database that need no running server: export, revoke, rebind."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sqlalchemy import func, inspect, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from aggregator_service import store
from aggregator_service.config import nested_rank_ratio_for, stored_keys, stored_spec
from aggregator_service.database_url import check_url, shown, unreadable
from aggregator_service.intervals import EveryRound
from aggregator_service.rounds import CohortSampler, Federation
from aggregator_service.strategies.fedavg import FedAvg
from fedcore.model_file import write_model_file
from fedcore.spec import ModelSpec
from fedcore.tiers import match_tier

__all__ = ["export_global_model", "rebind_certificate", "revoke"]


@contextmanager
def _existing_store(database_url: str, *, read_only: bool = False) -> Iterator[Session]:
    """One transaction on a store that exists and is migrated: a mistyped URL or path is one line, and
    creates nothing (SQLite would make an empty file of a path that names none). ``read_only``: on SQLite,
    begin DEFERRED, so the reads never take the write lock a running aggregator commits under."""
    url = check_url(database_url)
    shown = url.render_as_string(hide_password=True)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        if not Path(url.database).is_file():
            raise ValueError(f"no database at {url.database}: check --database-url")
    engine = store.create_engine_for(database_url, sqlite_begin="DEFERRED" if read_only else "IMMEDIATE")
    try:
        try:  # the migrations' own table, looked up without alembic (which logs as it opens a context)
            migrated = inspect(engine).has_table("alembic_version")
        except SQLAlchemyError as exc:
            raise unreadable(database_url, exc) from exc
        if not migrated:
            raise ValueError(f"{shown} holds no fedatoms store (never migrated): check --database-url")
        with store.session_factory(engine).begin() as s:
            yield s
    finally:
        engine.dispose()


def _federation(session: Session, name: str, url: str) -> store.Federation:
    fed = store.get_federation(session, name)
    if fed is None:
        raise ValueError(f"no federation {name!r} in {url}; check --database-url and the federation name")
    return fed


def export_global_model(
    database_url: str,
    round_: int | None,
    out: str | Path,
    federation_name: str = "default",
    tier: float | None = None,
) -> tuple[Path, int]:
    """Write the global model after round ``round_`` as a model file (:mod:`fedcore.model_file`); returns the
    file and the round. ``None``: the last closed round, whichever it is when the store is read (a running
    federation's rounds move on while an operator types).

    Safetensors with ``<module>.weight = α × D`` per atom layer, and metadata that rebuilds the
    module: the model reference, its arguments, the factorization, full-rank patterns, input shape,
    and the normalization when the federation gives one. The store keeps only the current global
    model, so ``round_`` must be the last closed round.

    ``tier`` γ < 1: the model a client of that tier runs instead, the global model cut to its rank by
    the server's own :meth:`Federation.tier_tensors` (what its fetch hands it); a tier the federation
    does not serve is refused. ``None`` or 1: the global model.
    """
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"{out} is a directory: give the model file's path, e.g. {out / 'model.safetensors'}")
    with _existing_store(database_url, read_only=True) as s:
        fed = _federation(s, federation_name, shown(database_url))
        last = s.scalar(
            select(func.max(store.Round.number)).where(
                store.Round.federation_id == fed.id, store.Round.state == "closed"
            )
        )
        last = int(last or 0)
        if round_ is None:
            round_ = last
        elif round_ != last:
            raise ValueError(
                f"round {round_} cannot be exported: the database holds the global model as of the last closed "
                f"round, {last}" + (" (no round has closed yet; round 0 is the initial model)" if last == 0 else "")
            )
        config = dict(fed.config)
        served = _served_tier(config, tier, federation_name)  # refused before the tensors are read
        loaded = store.load_global_tensors(s, fed)
    spec = stored_spec(config)
    tensors = {name: torch.from_numpy(array).contiguous() for name, (array, _v, _i) in loaded.items()}
    if served < 1.0:
        spec, tensors = _tier_model(config, spec, loaded, served)
    metadata = {"federation": federation_name, "round": str(round_), "normalization": config.get("normalization")}
    return write_model_file(out, spec, tensors, metadata), round_


def _served_tier(config: Mapping[str, Any], tier: float | None, federation_name: str) -> float:
    """``tier`` as the federation serves it; 1 (the global model) always is."""
    if tier is None:
        return 1.0
    tiers = sorted({1.0, *(float(t) for t in stored_keys(config).tiers)}, reverse=True)
    served = match_tier(tier, tiers)
    if served is None:
        listed = ", ".join(f"{t:g}" for t in tiers)
        raise ValueError(f"federation {federation_name!r} serves no tier {tier:g}: its tiers are {listed}")
    return served


def _tier_model(
    config: Mapping[str, Any], spec: ModelSpec, loaded: Mapping[str, tuple[np.ndarray, int, int]], tier: float
) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The tier's spec and tensors, cut by the very :class:`Federation` a server restores (its global tensors,
    versions and tier settings): a tensor no round has trained yet is cut as ``tier_init`` says, as a fetch
    cuts it. The strategy, policy and sampler are stand-ins; the cut reads none of them."""
    keys = stored_keys(config)
    federation = Federation(
        spec,
        FedAvg(),
        EveryRound(spec.tensors),
        CohortSampler(),
        tiers=keys.tiers,
        global_tensors={n: torch.from_numpy(array) for n, (array, _v, _i) in loaded.items()},
        tier_init=keys.tier_init,
        tier_average=keys.tier_average,
        nested_rank_ratio=nested_rank_ratio_for(keys.tiers, keys.tier_training),
    )
    federation.versions.update({n: int(version) for n, (_a, version, _i) in loaded.items() if n in federation.versions})
    return federation.tier_spec(tier), {n: t.contiguous() for n, t in federation.tier_tensors(tier).items()}


def revoke(database_url: str, client_id: str) -> None:
    """Revoke a client's token for good; its next call answers UNAUTHENTICATED ``token revoked``."""
    _on_client(database_url, client_id, store.revoke_client)


def rebind_certificate(database_url: str, client_id: str, cert: Path) -> str:
    """Bind a client's token to a renewed client certificate (mutual TLS); returns its SHA-256.

    From then on the token is honoured with ``cert`` only: the old certificate is refused with
    PERMISSION_DENIED, as any other. Works while the server runs (every call reads the binding).
    """
    try:
        digest = store.certificate_sha256(Path(cert).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read client certificate {cert}: {exc.strerror}") from exc
    except ValueError as exc:
        raise ValueError(f"{cert} is not a PEM certificate ({exc})") from exc
    _on_client(database_url, client_id, lambda s, cid: store.bind_certificate(s, cid, digest))
    return digest


def _on_client(database_url: str, client_id: str, action: Callable[[Session, str], bool]) -> None:
    """Run ``action(session, client_id)`` in one transaction; it returns False when there is no such client."""
    with _existing_store(database_url) as s:
        if not action(s, client_id):
            raise ValueError(f"no client {client_id!r} in {shown(database_url)}")
