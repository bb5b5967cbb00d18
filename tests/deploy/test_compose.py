"""deploy/compose.yaml for real: PostgreSQL, aggregator, dashboard and three client containers run a
3-round federation; the aggregator is killed mid-round, its restart policy brings it back, and the
federation finishes with every update of every round counted. Images: tests/deploy/run.sh."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator

import pytest
from deploy_stack import DEPLOY, ENV, PREFIX, free_port, get_json, get_text, inspect, logs, podman, wait_for

pytestmark = pytest.mark.deploy

ROUNDS = 3
CLIENTS = {"client-large": 1.0, "client-medium": 0.5, "client-small": 0.25}
ADMIN_TOKEN = "admin-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, str]]:
    project = f"fedatoms-test-{uuid.uuid4().hex[:8]}"
    dashboard_port = free_port()
    env = {
        **ENV,
        "POSTGRES_IMAGE": os.environ.get("FEDATOMS_TEST_POSTGRES_IMAGE", f"{PREFIX}postgres:latest"),
        "POSTGRES_PASSWORD": uuid.uuid4().hex,
        "FEDATOMS_ENROLLMENT_SECRET": uuid.uuid4().hex,
        "FEDATOMS_DASHBOARD_ADMIN_TOKEN": ADMIN_TOKEN,
        "FEDATOMS_ROUNDS": str(ROUNDS),
        # every client reports every round (asserted below), also on a loaded machine: a round waits for its
        # stragglers this long instead of the demo's 120 s before closing with its quorum
        "FEDATOMS_DEADLINE_SECONDS": "600",
        "FEDATOMS_AGGREGATOR_PORT": str(free_port()),
        "FEDATOMS_DASHBOARD_PORT": str(dashboard_port),
    }
    compose = ["podman-compose", "-p", project, "-f", str(DEPLOY / "compose.yaml")]
    up = subprocess.run([*compose, "up", "-d"], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        yield {"project": project, "url": f"http://127.0.0.1:{dashboard_port}"}
    finally:
        label = f"label=io.podman.compose.project={project}"
        for container in podman("ps", "-aq", "--filter", label, check=False).split():
            podman("rm", "-f", "-v", container, check=False)  # -v: the images' anonymous volumes
        subprocess.run([*compose, "down", "-v"], env=env, capture_output=True, timeout=300)
        for volume in podman("volume", "ls", "-q", "--filter", label, check=False).split():
            podman("volume", "rm", "-f", volume, check=False)
        podman("network", "rm", "-f", f"{project}_default", check=False)


def container(stack: dict[str, str], service: str) -> str:
    return f"{stack['project']}_{service}_1"


def federation(stack: dict[str, str]) -> dict:
    return get_json(stack["url"] + "/api/v1/federation", ADMIN_TOKEN)


def test_federation_survives_an_aggregator_kill(stack: dict[str, str]) -> None:
    aggregator = container(stack, "aggregator")
    try:
        # the dashboard answers from the host once the aggregator created the federation
        wait_for("dashboard /healthz", lambda: get_text(stack["url"] + "/healthz"), timeout=120)
        wait_for("round 2 open", lambda: (federation(stack)["open_round"] or 0) >= 2, timeout=600)
        # mid-round: kill the aggregator's process the way a crash or the OOM killer does. (`podman
        # kill` marks the container as stopped by its user, and podman then never restarts it.)
        pid = int(inspect(aggregator, "{{.State.Pid}}"))
        restarts = int(inspect(aggregator, "{{.RestartCount}}"))
        os.kill(pid, signal.SIGKILL)
        wait_for(
            "the restart policy restarts the aggregator",
            lambda: (
                int(inspect(aggregator, "{{.RestartCount}}")) > restarts
                and inspect(aggregator, "{{.State.Status}}") == "running"
            ),
            timeout=60,
        )
        # the federation finishes: every client exits 0 once it is told Done
        wait_for("federation done", lambda: federation(stack)["state"] == "done", timeout=900)
        done = federation(stack)
        for service in CLIENTS:
            name = container(stack, service)
            wait_for(f"{service} exited", lambda name=name: inspect(name, "{{.State.Status}}") == "exited", timeout=120)
            assert inspect(name, "{{.State.ExitCode}}") == "0", logs(name)
    except Exception:
        for service in ("aggregator", "dashboard", *CLIENTS):
            print(f"--- {service}\n{logs(container(stack, service))}")
        raise

    assert done["last_closed_round"] == ROUNDS and done["clients_registered"] == len(CLIENTS)
    assert "factorization" in done["config"]
    rounds = get_json(stack["url"] + "/api/v1/rounds?order=asc", ADMIN_TOKEN)["items"]
    closed = [r for r in rounds if r["state"] == "closed"]
    # nothing lost: every round closed with the whole cohort's updates, the killed one included
    assert len(closed) == ROUNDS, rounds
    assert all(r["reported"] == len(CLIENTS) and r["stragglers"] == 0 for r in closed), rounds
    clients = get_json(stack["url"] + "/api/v1/clients", ADMIN_TOKEN)["items"]
    # the declared profiles gave each client its own tier
    assert sorted(c["tier"] for c in clients) == sorted(CLIENTS.values())
    metrics = get_text(stack["url"] + "/metrics", ADMIN_TOKEN)
    assert f"fedatoms_current_round {float(ROUNDS)}" in metrics
    assert int(inspect(aggregator, "{{.RestartCount}}")) >= 1
    # the images' health checks pass (podman runs them on demand where systemd does not time them)
    for service in ("aggregator", "dashboard", "postgres"):
        podman("healthcheck", "run", container(stack, service))
