"""deploy/kubernetes/ for real through ``podman kube play``: the same 3-round federation as the
compose test, its workloads taken from the manifests.

podman 4.3 plays Pods, Deployments, ConfigMaps and PersistentVolumeClaims, but no StatefulSet, Job
or Service, names a Deployment's pod ``<name>-pod-0``, and publishes every container port on the
host (the host's PostgreSQL has 5432). So each workload's pod template is
played as a Pod named after its Service (the name the other manifests connect to, as a Service
gives it in a cluster), the StatefulSet's claim template as a PersistentVolumeClaim, and the Job
as a Pod that restarts on failure. The Secret is a podman secret (podman reads secretKeyRef there).
Only the images (local), the round count and the host ports are changed.
"""

from __future__ import annotations

import base64
import copy
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from deploy_stack import DEPLOY, PREFIX, free_port, get_json, inspect, logs, podman, wait_for

pytestmark = pytest.mark.deploy

KUBERNETES = DEPLOY / "kubernetes"
ROUNDS = 3
ADMIN_TOKEN = "admin-" + uuid.uuid4().hex
PROFILES = {"large": 1.0, "medium": 0.5, "small": 0.25}


def _documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    return [d for name in kustomization["resources"] for d in yaml.safe_load_all((KUBERNETES / name).read_text())]


def _pod(name: str, template: dict[str, Any], restart: str) -> dict[str, Any]:
    spec = copy.deepcopy(template["spec"])
    spec["restartPolicy"] = restart
    for container in spec["containers"]:
        container["image"] = container["image"].replace(
            "docker.io/library/postgres:15-bookworm", f"{PREFIX}postgres:latest"
        )
        # podman publishes every containerPort on the host (its own number when no hostPort): a free one
        for port in container.get("ports", []):
            port.update(hostPort=free_port(), hostIP="127.0.0.1")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": template["metadata"]["labels"]},
        "spec": spec,
    }


def play_documents(dashboard_port: int) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    out: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": generator["name"]},
            "data": {name: (KUBERNETES / name).read_text() for name in generator["files"]},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "fedatoms-profiles"},
            "data": {f"{p}.toml": (DEPLOY / "compose" / "profiles" / f"{p}.toml").read_text() for p in PROFILES},
        },
    ]
    for doc in _documents():
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "StatefulSet":
            pod = _pod(name, doc["spec"]["template"], "Always")
            for claim in doc["spec"]["volumeClaimTemplates"]:
                claim_name = f"{claim['metadata']['name']}-{name}"
                out.append(
                    {
                        "apiVersion": "v1",
                        "kind": "PersistentVolumeClaim",
                        "metadata": {"name": claim_name},
                        "spec": claim["spec"],
                    }
                )
                pod["spec"].setdefault("volumes", []).append(
                    {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim_name}}
                )
        elif kind == "Deployment":
            pod = _pod(name, doc["spec"]["template"], "Always")
        elif kind == "Job":
            pod = _pod(name, doc["spec"]["template"], "OnFailure")
        else:
            continue
        container = pod["spec"]["containers"][0]
        if name == "aggregator":
            container["env"].append({"name": "FEDATOMS_FEDERATION__ROUNDS", "value": str(ROUNDS)})
            # every client reports every round (asserted below), also on a loaded machine: a round waits for
            # its stragglers this long instead of the demo's 120 s before closing with its quorum
            container["env"].append({"name": "FEDATOMS_DEADLINE_SECONDS", "value": "600"})
        if name == "dashboard":
            container["ports"][0].update(hostPort=dashboard_port, hostIP="127.0.0.1")
        out.append(pod)
    for index, (profile, _tier) in enumerate(PROFILES.items()):
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"client-{profile}"},
                "spec": {
                    "restartPolicy": "OnFailure",
                    "containers": [
                        {
                            "name": "client",
                            "image": f"{PREFIX}client:latest",
                            "args": [
                                "--server",
                                "aggregator:50051",
                                "--dataset",
                                "digits",
                                "--partition-index",
                                str(index),
                                "--num-partitions",
                                str(len(PROFILES)),
                                "--classes-per-client",
                                "4",
                                "--profile",
                                f"/etc/fedatoms/profiles/{profile}.toml",
                            ],
                            "env": [
                                {
                                    "name": "FEDATOMS_ENROLLMENT_SECRET",
                                    "valueFrom": {
                                        "secretKeyRef": {"name": "fedatoms-secrets", "key": "enrollment-secret"}
                                    },
                                }
                            ],
                            "volumeMounts": [
                                {"name": "profiles", "mountPath": "/etc/fedatoms/profiles", "readOnly": True}
                            ],
                        }
                    ],
                    "volumes": [{"name": "profiles", "configMap": {"name": "fedatoms-profiles"}}],
                },
            }
        )
    return out


@pytest.fixture(scope="module")
def played(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    password = uuid.uuid4().hex
    secrets = {
        "postgres-password": password,
        "database-url": f"postgresql+psycopg://fedatoms:{password}@postgres:5432/fedatoms",
        "enrollment-secret": uuid.uuid4().hex,
        "admin-token": ADMIN_TOKEN,
    }
    port = free_port()
    documents = play_documents(port)
    play = tmp_path_factory.mktemp("kube") / "play.yaml"
    play.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    network = f"fedatoms-kube-{uuid.uuid4().hex[:8]}"
    pods = [d["metadata"]["name"] for d in documents if d["kind"] == "Pod"]
    claims = [d["metadata"]["name"] for d in documents if d["kind"] == "PersistentVolumeClaim"]
    # podman reads a secretKeyRef from a podman secret holding a JSON map of base64 values
    encoded = json.dumps({k: base64.b64encode(v.encode()).decode() for k, v in secrets.items()})
    secret_file = play.with_name("secrets.json")
    secret_file.write_text(encoded)
    podman("secret", "rm", "fedatoms-secrets", check=False)
    podman("secret", "create", "fedatoms-secrets", str(secret_file))
    secret_file.unlink()
    podman("network", "create", network)
    try:
        podman("kube", "play", "--network", network, str(play), timeout=300)
        yield {"url": f"http://127.0.0.1:{port}", "pods": pods, "play": play}
    finally:
        for pod in pods:
            for container in podman("ps", "-aq", "--filter", f"pod={pod}", check=False).split():
                podman("rm", "-f", "-v", container, check=False, timeout=120)  # -v: the images' anonymous volumes
            podman("pod", "rm", "-f", pod, check=False, timeout=120)
        # claims, and the volumes podman makes of ConfigMaps
        for volume in claims + [d["metadata"]["name"] for d in documents if d["kind"] == "ConfigMap"]:
            podman("volume", "rm", "-f", volume, check=False)
        podman("secret", "rm", "fedatoms-secrets", check=False)
        podman("network", "rm", "-f", network, check=False)


def test_kube_play_runs_the_federation(played: dict[str, Any]) -> None:
    url = played["url"]
    try:
        wait_for(
            "migrations job done",
            lambda: inspect("fedatoms-migrate-migrate", "{{.State.Status}}") == "exited",
            timeout=300,
        )
        assert inspect("fedatoms-migrate-migrate", "{{.State.ExitCode}}") == "0"
        wait_for(
            "federation done", lambda: get_json(url + "/api/v1/federation", ADMIN_TOKEN)["state"] == "done", timeout=900
        )
        for profile in PROFILES:
            name = f"client-{profile}-client"
            wait_for(f"{name} exited", lambda name=name: inspect(name, "{{.State.Status}}") == "exited", timeout=120)
            assert inspect(name, "{{.State.ExitCode}}") == "0", logs(name)
    except Exception:
        for pod in played["pods"]:
            for name in podman("ps", "-a", "--filter", f"pod={pod}", "--format", "{{.Names}}", check=False).split():
                if not name.endswith("-infra"):
                    print(f"--- {name}\n{logs(name)}")
        raise
    rounds = get_json(url + "/api/v1/rounds", ADMIN_TOKEN)["items"]
    assert [r["state"] for r in rounds] == ["closed"] * ROUNDS
    assert all(r["reported"] == len(PROFILES) for r in rounds)
    clients = get_json(url + "/api/v1/clients", ADMIN_TOKEN)["items"]
    assert sorted(c["tier"] for c in clients) == sorted(PROFILES.values())
    # readiness and liveness differ: the aggregator's liveness check passes (any health status)
    podman("healthcheck", "run", "aggregator-aggregator")
