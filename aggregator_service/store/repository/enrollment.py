"""Federations (enrollment secret, lifecycle, engine state) and clients (tokens, presence)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import ssl
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, func, or_, select, update
from sqlalchemy.orm import Session

from ..models import FEDERATION_STATES, Client, Federation, UTCDateTime
from ._common import FederationExists, _attached, _aware, _count, _json, _now, _page

__all__ = [
    "ENROLLMENT_PBKDF2_ITERATIONS",
    "authenticate",
    "check_enrollment_secret",
    "count_clients",
    "create_federation",
    "get_client",
    "get_federation",
    "hash_secret",
    "hash_token",
    "list_clients",
    "online_clients",
    "register_client",
    "revoke_client",
    "save_engine_state",
    "set_federation_state",
    "touch_client",
    "verify_secret",
]

# OWASP's 2023 figure for PBKDF2-HMAC-SHA256; ~0.15 s per check on one core. Stored with the hash,
# so raising it later only affects federations created afterwards.
ENROLLMENT_PBKDF2_ITERATIONS = 600_000


# --------------------------------------------------------------------------- federations


def hash_secret(secret: str, *, iterations: int = ENROLLMENT_PBKDF2_ITERATIONS) -> str:
    """``pbkdf2_sha256$<iterations>$<salt hex>$<digest hex>`` with a fresh 16-byte salt."""
    if iterations < 1:
        raise ValueError(f"iterations must be ≥ 1, got {iterations}")
    salt = secrets.token_bytes(16)
    digest = hashlib.pbkdf2_hmac("sha256", secret.encode(), salt, iterations)
    return f"pbkdf2_sha256${iterations}${salt.hex()}${digest.hex()}"


def verify_secret(secret: str, encoded: str) -> bool:
    """Constant-time check of ``secret`` against a :func:`hash_secret` string; malformed hashes never match."""
    try:
        scheme, iterations, salt, digest = encoded.split("$")
        if scheme != "pbkdf2_sha256":
            return False
        expected = bytes.fromhex(digest)
        actual = hashlib.pbkdf2_hmac("sha256", secret.encode(), bytes.fromhex(salt), int(iterations))
    except ValueError:
        return False
    return hmac.compare_digest(actual, expected)


def create_federation(
    session: Session,
    name: str,
    config: Mapping[str, Any],
    enrollment_secret: str,
    *,
    iterations: int = ENROLLMENT_PBKDF2_ITERATIONS,
    now: datetime | None = None,
) -> Federation:
    """A new running federation at round 0; only a salted PBKDF2 hash of ``enrollment_secret`` is stored."""
    if not name or not name.strip():
        raise ValueError("a federation needs a non-empty name")
    if not enrollment_secret:
        raise ValueError("the enrollment secret must not be empty")
    if session.scalar(select(Federation.id).where(Federation.name == name)) is not None:
        raise FederationExists(f"federation {name!r} already exists")
    t = _now(now)
    fed = Federation(
        name=name,
        config=_json(dict(config), "config"),
        state="running",
        current_round=0,
        enrollment_secret_hash=hash_secret(enrollment_secret, iterations=iterations),
        strategy_state={},
        policy_state={},
        created_at=t,
        updated_at=t,
    )
    session.add(fed)
    session.flush()
    return fed


def check_enrollment_secret(fed: Federation, secret: str) -> bool:
    return bool(secret) and verify_secret(secret, fed.enrollment_secret_hash)


def get_federation(session: Session, name: str) -> Federation | None:
    return session.scalar(select(Federation).where(Federation.name == name))


def set_federation_state(session: Session, fed: Federation, state: str) -> Federation:
    if state not in FEDERATION_STATES:
        raise ValueError(f"unknown federation state {state!r}; choose one of {', '.join(FEDERATION_STATES)}")
    row = _attached(session, fed)
    row.state = state
    session.flush()
    return row


def save_engine_state(
    session: Session,
    fed: Federation,
    strategy_state: Mapping[str, Any],
    policy_state: Mapping[str, Any],
    current_round: int,
) -> Federation:
    """Persist the JSON parts of ``Strategy.state_dict()`` / ``IntervalPolicy.state_dict()``.

    Tensors in a strategy's state (SCAFFOLD's controls) go to :func:`save_strategy_tensors`.
    """
    row = _attached(session, fed)
    row.strategy_state = _json(dict(strategy_state), "strategy_state")
    row.policy_state = _json(dict(policy_state), "policy_state")
    row.current_round = _count(current_round, "current_round")
    session.flush()
    return row


# --------------------------------------------------------------------------- clients


def hash_token(token: str) -> str:
    """SHA-256 hex of a bearer token: tokens are 256-bit random, so no salt or stretching is needed."""
    return hashlib.sha256(token.encode()).hexdigest()


def certificate_sha256(pem: str | bytes) -> str:
    """SHA-256 (hex) of a PEM certificate's DER bytes: how a token is bound to a client certificate."""
    text = pem.decode("ascii") if isinstance(pem, bytes) else pem
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(text)).hexdigest()


def register_client(
    session: Session,
    fed: Federation,
    profile: Mapping[str, Any],
    tier: float,
    name: str | None = None,
    *,
    cert_sha256: str | None = None,
    now: datetime | None = None,
) -> tuple[Client, str]:
    """Enroll a device; returns the client and its bearer token (shown once: only its hash is stored).

    ``cert_sha256`` binds the token to the client certificate the device registered with (mutual TLS).
    """
    if not (0.0 < float(tier) <= 1.0):
        raise ValueError(f"tier must be in (0, 1], got {tier}")
    t = _now(now)
    client_id = uuid.uuid4().hex
    token = secrets.token_urlsafe(32)
    # next in registration order; a concurrent registration on another replica fails the unique
    # index (federation_id, number) and the caller retries
    number = session.scalar(select(func.coalesce(func.max(Client.number) + 1, 0)).where(Client.federation_id == fed.id))
    client = Client(
        id=client_id,
        federation_id=fed.id,
        number=int(number or 0),
        name=name or f"client-{client_id[:8]}",
        token_hash=hash_token(token),
        cert_sha256=cert_sha256,
        profile=_json(dict(profile), "profile"),
        tier=float(tier),
        registered_at=t,
        last_seen=t,
        rounds_joined=0,
        bytes_up=0,
        bytes_down=0,
    )
    session.add(client)
    session.flush()
    return client, token


def authenticate(session: Session, token: str) -> Client | None:
    """The client holding ``token``, or ``None`` for an empty, unknown or revoked token."""
    if not token:
        return None
    digest = hash_token(token)
    client = session.scalar(select(Client).where(Client.token_hash == digest))
    if client is None or client.revoked_at is not None or not hmac.compare_digest(client.token_hash, digest):
        return None
    return client


def get_client(session: Session, client_id: str) -> Client | None:
    return session.get(Client, client_id)


def revoke_client(session: Session, client_id: str, *, now: datetime | None = None) -> bool:
    """Revoke a client's token for good; ``False`` when no such client (revoking twice keeps the first time)."""
    client = session.get(Client, client_id)
    if client is None:
        return False
    if client.revoked_at is None:
        client.revoked_at = _now(now)
        session.flush()
    return True


def bind_certificate(session: Session, client_id: str, cert_sha256: str) -> bool:
    """Bind a client's token to another certificate (a renewed one); ``False`` when no such client."""
    client = session.get(Client, client_id)
    if client is None:
        return False
    if client.revoked_at is not None:
        raise ValueError(f"client {client_id} is revoked: enroll the device again instead")
    client.cert_sha256 = cert_sha256
    session.flush()
    return True


def touch_client(session: Session, client: Client, now: datetime | None = None) -> Client:
    """Record that ``client`` was heard from (every authenticated call, and Heartbeat)."""
    row = _attached(session, client)
    row.last_seen = _now(now)
    session.flush()
    return row


def touch_clients(session: Session, times: Mapping[str, datetime]) -> None:
    """Record when each client (by id) was last heard from, in one statement run once per client. A time
    older than the stored one changes nothing: a batch of deferred refreshes written after a newer one (a
    client that came back online is written at once) must not make the client look away for longer."""
    if not times:
        return
    table = Client.__table__
    seen = bindparam("seen_at", type_=UTCDateTime())
    statement = (
        update(table)
        .where(table.c.id == bindparam("client_id"), or_(table.c.last_seen.is_(None), table.c.last_seen < seen))
        .values(last_seen=seen)
    )
    session.execute(statement, [{"client_id": cid, "seen_at": _aware(t, "last_seen")} for cid, t in times.items()])


def online_clients(session: Session, fed: Federation, since: datetime) -> list[Client]:
    """Unrevoked clients heard from at or after ``since``, by id (the cohort sampler's candidates)."""
    return list(
        session.scalars(
            select(Client)
            .where(
                Client.federation_id == fed.id,
                Client.revoked_at.is_(None),
                Client.last_seen >= _aware(since, "since"),
            )
            .order_by(Client.id)
        )
    )


def list_clients(session: Session, fed: Federation, offset: int = 0, limit: int = 100) -> list[Client]:
    """Clients in registration order, revoked ones included (the dashboard shows them as such)."""
    offset, limit = _page(offset, limit)
    return list(
        session.scalars(
            select(Client)
            .where(Client.federation_id == fed.id)
            .order_by(Client.registered_at, Client.id)
            .offset(offset)
            .limit(limit)
        )
    )


def count_clients(session: Session, fed: Federation, *, include_revoked: bool = True) -> int:
    q = select(func.count()).select_from(Client).where(Client.federation_id == fed.id)
    if not include_revoked:
        q = q.where(Client.revoked_at.is_(None))
    return int(session.scalar(q) or 0)
