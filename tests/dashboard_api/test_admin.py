"""Admin actions through the dashboard, honoured by the aggregator still serving the federation; tokens."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import httpx
import pytest
from dashboard_helpers import ADMIN_TOKEN, Federation, start_dashboard
from sqlalchemy import update

from aggregator_service import store
from dashboard_api.settings import DashboardSettings

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ACTIONS = ["/federation/pause", "/federation/resume", "/clients/{spare}/revoke"]


def _eventually(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Wait for the aggregator's ticker to re-read the database (it does every second)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"the aggregator never {what}")
        time.sleep(0.1)


def _state(federation: Federation) -> str:
    with federation.session() as (_s, fed):
        return fed.state


@pytest.mark.parametrize("path", ACTIONS)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer not-the-admin-token"}, {"Authorization": "Basic x"}])
def test_admin_actions_refuse_missing_or_wrong_tokens(
    api: httpx.Client, federation: Federation, path: str, headers: dict[str, str]
) -> None:
    r = api.post(path.format(spare=federation.spare.client_id), headers=headers)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "admin token" in r.json()["detail"]
    assert _state(federation) == "running"
    assert api.get(f"/clients/{federation.spare.client_id}").json()["revoked"] is False


def test_pause_and_resume_are_honoured_by_the_aggregator(api: httpx.Client, federation: Federation) -> None:
    member = federation.clients[1]  # in round 4's cohort, not reported yet
    r = api.post("/federation/pause", headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"name": "default", "state": "paused", "previous_state": "running"}
    assert _state(federation) == "paused" and api.get("/federation").json()["state"] == "paused"
    _eventually(lambda: member.task().WhichOneof("kind") == "wait", "told clients to wait")
    assert "paused" in member.task().wait.reason
    assert api.post("/federation/pause", headers=ADMIN).json()["previous_state"] == "paused"  # idempotent

    r = api.post("/federation/resume", headers=ADMIN)
    assert r.status_code == 200 and r.json()["state"] == "running"
    _eventually(lambda: member.task().WhichOneof("kind") == "train", "resumed training")


def test_an_admin_action_waits_for_a_write_the_aggregator_commits_meanwhile(
    api: httpx.Client, federation: Federation
) -> None:
    """A pause read the federation in a deferred SQLite transaction and then wrote; when the aggregator committed
    in between (it writes every round), SQLite refused the write at once (SQLITE_BUSY_SNAPSHOT, no busy wait)
    and the dashboard answered 503 "unavailable". Another writer here holds the write lock, as a round's close
    does, and commits while the pause waits: the pause goes through, after it."""
    writer = store.create_engine_for(federation.url)  # the aggregator's kind of engine
    answers: list[httpx.Response] = []
    try:
        with writer.connect() as conn:
            tx = conn.begin()
            conn.execute(update(store.Client).values(last_seen=store.utcnow()))
            pausing = threading.Thread(target=lambda: answers.append(api.post("/federation/pause", headers=ADMIN)))
            pausing.start()
            time.sleep(1.0)  # the pause is waiting now (SQLite) or done (PostgreSQL: no lock between these rows)
            tx.commit()
            pausing.join(30)
    finally:
        writer.dispose()
    assert [a.status_code for a in answers] == [200], [a.text for a in answers]
    assert _state(federation) == "paused"
    assert api.post("/federation/resume", headers=ADMIN).status_code == 200
    member = federation.clients[1]  # the next tests need the aggregator to have read "running" back
    _eventually(lambda: member.task().WhichOneof("kind") == "train", "resumed training")


def test_revoke_is_honoured_by_the_aggregator(api: httpx.Client, federation: Federation) -> None:
    spare = federation.spare
    assert spare.task().WhichOneof("kind") in ("wait", "train")  # its token works
    r = api.post(f"/clients/{spare.client_id}/revoke", headers=ADMIN)
    assert r.status_code == 200
    body = r.json()
    assert body["revoked"] and body["revoked_at"] and not body["online"] and body["name"] == "spare"
    with pytest.raises(grpc.RpcError) as info:
        spare.task()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in info.value.details()
    again = api.post(f"/clients/{spare.client_id}/revoke", headers=ADMIN).json()
    assert again["revoked_at"] == body["revoked_at"]  # the first revocation stands
    assert [c["name"] for c in api.get("/clients?status=revoked").json()["items"]] == ["spare"]
    summary = api.get("/federation").json()
    assert (summary["clients_registered"], summary["clients_revoked"]) == (3, 1)
    r = api.post("/clients/0123456789abcdef0123456789abcdef/revoke", headers=ADMIN)
    assert r.status_code == 404 and "no client" in r.json()["detail"]


def test_a_finished_federation_cannot_be_paused(api: httpx.Client, federation: Federation) -> None:
    for c in federation.clients[1:]:  # the rest of round 4's cohort reports: the last round closes
        rnd, reply = c.round_trip()
        assert rnd == 4 and reply.accepted
    assert _state(federation) == "done"
    for path in ("/federation/pause", "/federation/resume"):
        r = api.post(path, headers=ADMIN)
        assert r.status_code == 409 and "done" in r.json()["detail"]
    assert _state(federation) == "done"


def test_without_an_admin_token_admin_actions_are_unavailable(federation: Federation) -> None:
    live = start_dashboard(DashboardSettings(database_url=federation.url))
    try:
        r = httpx.post(f"{live.base_url}/api/v1/federation/pause", headers=ADMIN)
        assert r.status_code == 503 and "admin_token" in r.json()["detail"]
        assert httpx.get(f"{live.base_url}/api/v1/federation").status_code == 200  # reads stay open
    finally:
        live.stop()


def test_a_read_token_guards_reads_and_metrics(federation: Federation) -> None:
    read = "read-token-0c4d9a7e5b3f2a18"
    live = start_dashboard(DashboardSettings(database_url=federation.url, read_token=read, admin_token=ADMIN_TOKEN))
    try:
        for path in ("/api/v1/rounds", "/api/v1/clients", "/metrics"):
            r = httpx.get(f"{live.base_url}{path}")
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), path
            wrong = httpx.get(f"{live.base_url}{path}", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and "wrong" in wrong.json()["detail"]
            for token in (read, ADMIN_TOKEN):
                assert httpx.get(f"{live.base_url}{path}", headers={"Authorization": f"Bearer {token}"}).is_success
        assert httpx.get(f"{live.base_url}/healthz").status_code == 200  # probes need no token
        assert httpx.get(f"{live.base_url}/readyz").status_code == 200
    finally:
        live.stop()
