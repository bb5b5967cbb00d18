"""The token lookup agrees with the ORM on SQLite (raw sqlite3) and PostgreSQL (Core), and never reads stale."""

from __future__ import annotations

import threading

import pytest

from aggregator_service import store
from aggregator_service.token_lookup import TokenLookup, TokenRow


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")


def test_lookup_matches_the_orm_and_sees_every_commit(url: str) -> None:
    store.upgrade(url)
    engine = store.create_engine_for(url)
    try:
        factory = store.session_factory(engine)
        with factory.begin() as s:
            fed = store.create_federation(s, "f", {}, "secret", iterations=1_000)
            row, token = store.register_client(s, fed, {}, 0.25, "pi-kitchen", cert_sha256="ab" * 32)
            other, other_token = store.register_client(s, fed, {}, 1.0)
            client_id, other_id = row.id, other.id
        lookup = TokenLookup(engine)
        got = lookup(store.hash_token(token))
        with factory() as s:
            c = store.get_client(s, client_id)
            assert c is not None
            expected = TokenRow(
                c.id, c.federation_id, c.revoked_at, c.tier, c.name, c.number, c.last_seen, c.cert_sha256
            )
        assert got == expected
        assert got is not None and got.last_seen.tzinfo is not None and got.revoked_at is None
        assert lookup(store.hash_token("no-such-token")) is None

        with factory.begin() as s:  # a commit by another connection after this thread's first lookup
            assert store.revoke_client(s, client_id)
        again = lookup(store.hash_token(token))
        assert again is not None and again.revoked_at is not None  # no stale read: revocation is immediate

        seen: list[TokenRow | None] = []  # another thread gets its own connection, same answers
        worker = threading.Thread(target=lambda: seen.append(lookup(store.hash_token(other_token))))
        worker.start()
        worker.join()
        assert seen[0] is not None and seen[0].id == other_id and seen[0].revoked_at is None
    finally:
        engine.dispose()
