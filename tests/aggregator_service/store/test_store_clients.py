"""Federations and clients: hashed secrets and tokens, authentication, revocation, presence."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from aggregator_service import store

T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


def _every_value(session) -> list[object]:
    values: list[object] = []
    for table in store.Base.metadata.sorted_tables:
        for row in session.execute(select(table)):
            values.extend(row)
    return values


def test_secret_and_tokens_never_stored(db):
    secret = "correct horse battery staple"
    with db.factory.begin() as s:
        fed = store.create_federation(s, "f", {"k": 1}, secret, iterations=1_000, now=T0)
        tokens = [store.register_client(s, fed, {"cpu": 4}, 0.5, now=T0)[1] for _ in range(3)]
        store.open_round(s, fed, 1, ["x"], [], False, T0 + timedelta(minutes=1), now=T0)
    with db.factory() as s:
        values = _every_value(s)
    assert len(values) > 40
    for needle in (secret, *tokens):
        for v in values:
            if isinstance(v, str):
                assert needle not in v
            elif isinstance(v, bytes | bytearray | memoryview):
                assert needle.encode() not in bytes(v)
    with db.factory() as s:
        stored = store.get_federation(s, "f")
        assert stored is not None
        assert stored.enrollment_secret_hash.startswith("pbkdf2_sha256$1000$")
        assert {c.token_hash for c in store.list_clients(s, stored)} == {store.hash_token(t) for t in tokens}


def test_enrollment_secret_check(db):
    with db.factory.begin() as s:
        fed = store.create_federation(s, "f", {}, "s3cret", iterations=1_000)
    with db.factory() as s:
        fed = store.get_federation(s, "f")
        assert fed is not None
        assert store.check_enrollment_secret(fed, "s3cret")
        assert not store.check_enrollment_secret(fed, "s3cret ")
        assert not store.check_enrollment_secret(fed, "")
        assert store.get_federation(s, "nope") is None


def test_default_pbkdf2_hash_and_salt():
    default = store.hash_secret("same")
    assert default.split("$")[1] == str(store.ENROLLMENT_PBKDF2_ITERATIONS)
    assert store.verify_secret("same", default)
    a, b = store.hash_secret("same", iterations=1_000), store.hash_secret("same", iterations=1_000)
    assert a != b  # per-federation salt
    assert store.verify_secret("same", a) and store.verify_secret("same", b)
    assert not store.verify_secret("other", a)
    assert not store.verify_secret("same", "garbage") and not store.verify_secret("same", "md5$1$00$00")


def test_create_federation_refuses_duplicates_and_empty_secret(db):
    with db.factory.begin() as s:
        store.create_federation(s, "f", {}, "x", iterations=1_000)
    with db.factory.begin() as s:
        with pytest.raises(store.FederationExists):
            store.create_federation(s, "f", {}, "y", iterations=1_000)
        with pytest.raises(ValueError, match="secret"):
            store.create_federation(s, "g", {}, "", iterations=1_000)


def test_register_authenticate_revoke(db, world):
    cid = world.clients[0]
    token = world.tokens[cid]
    with db.factory.begin() as s:
        client = store.authenticate(s, token)
        assert client is not None and client.id == cid and client.tier == 1.0
        assert client.profile == {"device": client.profile["device"]}
        assert client.name == f"client-{cid[:8]}"
        assert client.registered_at == world.t0 and client.registered_at.tzinfo is not None
        assert store.authenticate(s, token + "x") is None
        assert store.authenticate(s, "") is None
        assert store.revoke_client(s, cid, now=world.t0 + timedelta(hours=1))
        assert not store.revoke_client(s, "no-such-client")
    with db.factory.begin() as s:
        assert store.authenticate(s, token) is None  # revoked → None
        assert store.revoke_client(s, cid)  # again: still revoked, first time kept
        client = store.get_client(s, cid)
        assert client is not None and client.revoked_at == world.t0 + timedelta(hours=1)
        other = store.authenticate(s, world.tokens[world.clients[1]])
        assert other is not None and other.id == world.clients[1]


def test_register_validates_tier_and_names(db, world):
    with db.factory.begin() as s:
        with pytest.raises(ValueError, match="tier"):
            store.register_client(s, world.fed, {}, 0.0)
        client, token = store.register_client(s, world.fed, {"cpu": 1}, 0.25, name="pi-zero")
        assert client.name == "pi-zero" and len(client.id) == 32 and len(token) >= 40
        assert store.count_clients(s, world.fed) == 4


def test_touch_and_online_clients(db, world):
    a, b, c = world.clients
    with db.factory.begin() as s:
        for cid, minutes in ((a, 10), (b, 1)):
            client = store.get_client(s, cid)
            assert client is not None
            store.touch_client(s, client, world.t0 + timedelta(minutes=minutes))
        store.revoke_client(s, c)
    with db.factory() as s:
        since = world.t0 + timedelta(minutes=5)
        assert [x.id for x in store.online_clients(s, world.fed, since)] == [a]
        assert [x.id for x in store.online_clients(s, world.fed, world.t0)] == sorted([a, b])
        seen = store.get_client(s, a)
        assert seen is not None and seen.last_seen == world.t0 + timedelta(minutes=10)
        assert [x.id for x in store.list_clients(s, world.fed, 0, 2)] + [
            x.id for x in store.list_clients(s, world.fed, 2, 2)
        ] == sorted(world.clients, key=lambda i: (world.t0, i))
        assert store.count_clients(s, world.fed, include_revoked=False) == 2


def test_touch_accepts_a_row_from_another_session(db, world):
    with db.factory() as s:
        client = store.get_client(s, world.clients[0])
    assert client is not None
    with db.factory.begin() as s:
        store.touch_client(s, client, world.t0 + timedelta(days=1))
    with db.factory() as s:
        again = store.get_client(s, world.clients[0])
        assert again is not None and again.last_seen == world.t0 + timedelta(days=1)


def test_batched_touches_never_move_a_last_seen_time_back(db, world):
    """A batch of deferred refreshes can be written after a newer time was (a flush that waited behind a close,
    while the client's return to online was written at once): the newer time stays."""
    a, b, c = world.clients
    later, earlier = world.t0 + timedelta(minutes=10), world.t0 + timedelta(minutes=3)
    with db.factory.begin() as s:
        store.touch_clients(s, {a: later})
    with db.factory.begin() as s:
        store.touch_clients(s, {a: earlier, b: earlier})  # a's is older than the stored one
    with db.factory.begin() as s:
        store.touch_clients(s, {c: later})
        store.touch_clients(s, {})
    with db.factory() as s:
        seen = {cid: store.get_client(s, cid).last_seen for cid in (a, b, c)}  # type: ignore[union-attr]
    assert seen == {a: later, b: earlier, c: later}
    with db.factory.begin() as s, pytest.raises(ValueError, match="timezone-aware"):
        store.touch_clients(s, {a: datetime(2031, 1, 1)})


def test_naive_datetimes_are_refused(db, world):
    with db.factory.begin() as s:
        client = store.get_client(s, world.clients[0])
        assert client is not None
        with pytest.raises(ValueError, match="timezone-aware"):
            store.touch_client(s, client, datetime(2030, 1, 1))


def test_federation_state_and_engine_state(db, world):
    with db.factory.begin() as s:
        fed = store.get_federation(s, "digits")
        assert fed is not None
        store.set_federation_state(s, fed, "paused")
        store.save_engine_state(s, fed, {"controls": []}, {"policy": "fedlama", "intervals": {"w": 2}}, 7)
        with pytest.raises(ValueError, match="unknown federation state"):
            store.set_federation_state(s, fed, "sleeping")
        with pytest.raises(ValueError, match="standard JSON"):
            store.save_engine_state(s, fed, {"x": float("nan")}, {}, 7)
    with db.factory() as s:
        fed = store.get_federation(s, "digits")
        assert fed is not None
        assert (fed.state, fed.current_round) == ("paused", 7)
        assert fed.policy_state == {"policy": "fedlama", "intervals": {"w": 2}}
        assert fed.strategy_state == {"controls": []}
        assert fed.updated_at != fed.created_at == world.t0  # onupdate stamped the change
