"""Operator actions on a federation's database that need no running server: export, revoke, rebind."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from sqlalchemy import func, inspect, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session

from aggregator_service import store
from aggregator_service.config import stored_spec
from fedcore.model_file import write_model_file

__all__ = ["export_global_model", "rebind_certificate", "revoke"]


@contextmanager
def _existing_store(database_url: str) -> Iterator[Session]:
    """One transaction on a store that exists and is migrated: a mistyped URL or path is one line, and
    creates nothing (SQLite would make an empty file of a path that names none)."""
    try:
        url = make_url(database_url)
    except ArgumentError as exc:
        raise ValueError(f"{database_url!r} is not a database URL (e.g. sqlite:///fedatoms.db)") from exc
    shown = url.render_as_string(hide_password=True)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        if not Path(url.database).is_file():
            raise ValueError(f"no database at {url.database}: check --database-url")
    engine = store.create_engine_for(database_url)
    try:
        try:  # the migrations' own table, looked up without alembic (which logs as it opens a context)
            migrated = inspect(engine).has_table("alembic_version")
        except SQLAlchemyError as exc:
            first = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
            raise ValueError(f"cannot read the database {shown}: {first}") from exc
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
    database_url: str, round_: int | None, out: str | Path, federation_name: str = "default"
) -> tuple[Path, int]:
    """Write the global model after round ``round_`` as a model file (:mod:`fedcore.model_file`); returns the
    file and the round. ``None``: the last closed round, whichever it is when the store is read (a running
    federation's rounds move on while an operator types).

    Safetensors with ``<module>.weight = α × D`` per atom layer, and metadata that rebuilds the
    module: the model reference, its arguments, the factorization, full-rank patterns, input shape,
    and the normalization when the federation gives one. The store keeps only the current global
    model, so ``round_`` must be the last closed round.
    """
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"{out} is a directory: give the model file's path, e.g. {out / 'model.safetensors'}")
    with _existing_store(database_url) as s:
        fed = _federation(s, federation_name, database_url)
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
        loaded = store.load_global_tensors(s, fed)
        config = dict(fed.config)
    spec = stored_spec(config)
    tensors = {name: torch.from_numpy(array).contiguous() for name, (array, _v, _i) in loaded.items()}
    metadata = {"federation": federation_name, "round": str(round_), "normalization": config.get("normalization")}
    return write_model_file(out, spec, tensors, metadata), round_


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
            raise ValueError(f"no client {client_id!r} in {database_url}")
