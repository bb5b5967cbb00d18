"""deploy/ checked without containers, on every run: Kubernetes manifests (kubernetes-validate
--strict, offline), the compose file (docker-compose or podman-compose config), the systemd units
(systemd-analyze verify, whose warnings go to stderr with exit 0), and the dashboard without torch.
Each test skips, saying why, where its tool is missing."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from support import free_port, wait_serving

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"


def tool(name: str) -> str:
    """The tool next to this interpreter (the venv's) or on PATH; skips the test without it."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed")
    return found


def manifests() -> list[Path]:
    return sorted(p for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")


def test_kubernetes_manifests_validate_strictly() -> None:
    validate = tool("kubernetes-validate")
    done = subprocess.run([validate, "--strict", *map(str, manifests())], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed" in done.stdout + done.stderr


def test_kustomization_names_every_manifest_and_file() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in manifests()]
    for generator in kustomization["configMapGenerator"]:
        for name in generator["files"]:
            assert (KUBERNETES / name.split("=")[-1]).is_file()
    # secrets.env is the operator's (never committed); the example names the same keys the manifests read,
    # an optional one commented out
    lines = (KUBERNETES / "secrets.example.env").read_text().splitlines()
    example = {line.split("=")[0] for line in lines if line and not line.startswith("#")}
    commented = {line[1:].split("=")[0] for line in lines if re.fullmatch(r"#[a-z-]+=.*", line)}
    used, optional = set(), set()
    for path in manifests():
        for doc in yaml.safe_load_all(path.read_text()):
            used |= _secret_keys(doc)
            optional |= _secret_keys(doc, optional=True)
    assert used - optional == example and optional == commented, (used, optional, example, commented)
    assert {"secrets.env", "tls"} <= _ignored(DEPLOY / "kubernetes" / "secrets.env", DEPLOY / "tls" / "server.key")


def _ignored(*paths: Path) -> set[str]:
    """Which of ``paths`` git ignores (by name, or a directory's name): the operator's secrets, never committed."""
    done = subprocess.run(["git", "check-ignore", *map(str, paths)], capture_output=True, text=True, cwd=ROOT)
    return {Path(line).name for line in done.stdout.splitlines()} | {
        Path(line).parent.name for line in done.stdout.splitlines()
    }


def _secret_keys(node: object, optional: bool = False) -> set[str]:
    """The keys of fedatoms-secrets that ``node`` reads (``optional``: only those marked optional)."""
    if isinstance(node, dict):
        ref = node.get("secretKeyRef")
        named = isinstance(ref, dict) and ref.get("name") == "fedatoms-secrets"
        keys = {ref["key"]} if named and (ref.get("optional") is True or not optional) else set()
        return keys.union(*(_secret_keys(v, optional) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_secret_keys(v, optional) for v in node))
    return set()


def _aggregator_container() -> dict:
    documents = yaml.safe_load_all((KUBERNETES / "aggregator.yaml").read_text())
    spec = next(d for d in documents if d["kind"] == "Deployment")["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    return spec["template"]["spec"]["containers"][0]


def test_aggregator_probes_keep_a_paused_aggregator_alive() -> None:
    container = _aggregator_container()
    assert container["readinessProbe"]["grpc"].get("service", "") == ""  # the whole server: SERVING while paused
    assert container["livenessProbe"]["exec"]["command"] == ["fedatoms-grpc-health", "live"]  # any status


# resident memory of an idle `fedatoms aggregator serve` (deploy/kubernetes/federation.toml, torch
# 2.13.0+cpu as in the image, PostgreSQL): /proc/PID/status VmRSS, measured; 589 MB (~562 MiB)
AGGREGATOR_IDLE_RSS = 589_000_000


def _quantity(text: str) -> float:
    """A Kubernetes memory quantity in bytes: ``512Mi``, ``1Gi``, ``600M``, ``1e9``."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text.removesuffix(suffix)) * factor
    return float(text)


def test_aggregator_memory_request_covers_its_idle_footprint() -> None:
    """A request below what the process holds idle lets the scheduler overcommit the node: under pressure
    the aggregator, over its request from the start, is the first to be evicted."""
    resources = _aggregator_container()["resources"]
    request, limit = _quantity(resources["requests"]["memory"]), _quantity(resources["limits"]["memory"])
    assert request >= 1.5 * AGGREGATOR_IDLE_RSS, resources  # room for rounds on top of idle
    assert limit > request, resources


def test_compose_file_is_valid() -> None:
    env = {
        **os.environ,
        "POSTGRES_PASSWORD": "p",
        "FEDATOMS_ENROLLMENT_SECRET": "s",
        "FEDATOMS_DASHBOARD_ADMIN_TOKEN": "t" * 16,
    }
    compose = DEPLOY / "compose.yaml"
    if not shutil.which("docker-compose"):
        pytest.skip(
            "docker-compose is not installed (apt-get install docker-compose; podman-compose 1.0 has no config)"
        )
    command = ["docker-compose", "-f", str(compose), "config"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    assert {"postgres", "aggregator", "dashboard"} <= set(services)
    clients = [s for name, s in services.items() if name.startswith("client-")]
    assert len(clients) >= 3 and all(s["restart"] == "on-failure" for s in clients)
    assert services["aggregator"]["restart"] == "always" and services["postgres"]["restart"] == "always"
    assert "ports" not in services["postgres"]  # the host's 5432 stays free
    # plaintext gRPC (tokens) and plain HTTP stay on the host's loopback unless the operator publishes them
    assert services["aggregator"]["ports"] == ["127.0.0.1:50051:50051/tcp"]
    assert services["dashboard"]["ports"] == ["127.0.0.1:8080:8080/tcp"]
    tls = [*command[:3], "-f", str(DEPLOY / "compose.tls.yaml"), "config"]
    done = subprocess.run(tls, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and "WARNING" not in done.stderr, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    assert services["aggregator"]["environment"]["FEDATOMS_TLS_KEY"] == "/etc/fedatoms/tls/server.key"
    assert all("--tls-ca" in s["command"] for name, s in services.items() if name.startswith("client-"))


def test_systemd_units_verify_without_warnings(tmp_path: Path) -> None:
    analyze = tool("systemd-analyze")
    fedatoms = tool("fedatoms")
    # verify checks that ExecStart exists: point the units at this checkout's installed command
    units = []
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        copy = tmp_path / unit.name
        copy.write_text(_installed(unit.read_text(), fedatoms))
        units.append(str(copy))
    assert len(units) == 3
    done = subprocess.run([analyze, "verify", *units], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def _installed(text: str, fedatoms: str) -> str:
    """A unit's text with the venv's commands at this checkout's (the venv's python beside its fedatoms)."""
    venv = "/opt/fedatoms/venv/bin/"
    return text.replace(f"{venv}fedatoms", fedatoms).replace(f"{venv}python", str(Path(fedatoms).parent / "python"))


def _unit_command(unit: str, key: str, fedatoms: str) -> list[str]:
    line = next(x for x in (DEPLOY / "systemd" / unit).read_text().splitlines() if x.startswith(f"{key}="))
    return shlex.split(_installed(line.removeprefix(f"{key}="), fedatoms))


def test_the_systemd_recipe_migrates_and_serves_with_its_env_file(tmp_path: Path) -> None:
    """docs/deploy.md's files as installed: the Kubernetes federation.toml and fedatoms.env as shipped,
    with only the database (SQLite here) and the port changed; both units' commands run with them."""
    fedatoms = tool("fedatoms")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDATOMS_")}
    for line in (DEPLOY / "systemd" / "fedatoms.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    listen = env.get("FEDATOMS_LISTEN") or tomllib.loads((KUBERNETES / "federation.toml").read_text())["listen"]
    host, _, _ = listen.rpartition(":")
    env["FEDATOMS_LISTEN"] = f"{host}:{free_port()}"
    env["FEDATOMS_DATABASE_URL"] = f"sqlite:///{tmp_path / 'fedatoms.db'}"
    toml = tmp_path / "federation.toml"
    toml.write_text((KUBERNETES / "federation.toml").read_text())

    def command(key: str) -> list[str]:
        cmd = _unit_command("fedatoms-aggregator.service", key, fedatoms)
        return [str(toml) if arg == "/etc/fedatoms/federation.toml" else arg for arg in cmd]

    done = subprocess.run(command("ExecStartPre"), capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "schema at" in done.stdout
    log = (tmp_path / "aggregator.log").open("wb")
    server = subprocess.Popen(command("ExecStart"), env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_serving(env["FEDATOMS_LISTEN"])
    finally:
        server.terminate()
        server.wait(30)
    assert server.returncode == 0, (tmp_path / "aggregator.log").read_text()[-2000:]


def test_the_client_unit_runs_client_run_and_restarts_by_its_exit_codes() -> None:
    """fedatoms-client.service's command, its variables filled from client.env as systemd fills them, is one
    `fedatoms client run` takes; a stop (SIGTERM) counts as success, and the exits a restart cannot mend (bad
    flags or data, a refused secret or token, diverged training, a tier too large for the memory) stay stopped."""
    from client_agent.agent import EXIT_CODES
    from fedatoms.cli import build_parser

    unit = (DEPLOY / "systemd" / "fedatoms-client.service").read_text()
    env = {}
    for line in (DEPLOY / "systemd" / "client.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    command = _unit_command("fedatoms-client.service", "ExecStart", "fedatoms")
    filled = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], arg) for arg in command]
    args = build_parser().parse_args(filled[1:])
    assert (args.command, args.server, args.data) == ("client", env["FEDATOMS_SERVER"], env["FEDATOMS_CLIENT_DATA"])
    assert "FEDATOMS_ENROLLMENT_SECRET" in env  # the first start enrolls with it
    directives = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert directives["SuccessExitStatus"].split() == [str(EXIT_CODES["interrupted"])]
    prevent = {EXIT_CODES[k] for k in ("usage", "unauthenticated", "diverged", "out_of_memory")}
    assert {int(c) for c in directives["RestartPreventExitStatus"].split()} == prevent
    assert directives["Restart"] == "on-failure"  # 0: the federation is done
    assert args.state_dir == "/var/lib/fedatoms-client" and directives["StateDirectory"] == "fedatoms-client"


def test_dashboard_app_imports_without_torch() -> None:
    check = "import sys, dashboard_api.app; sys.exit(3 if 'torch' in sys.modules else 0)"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_dashboard_image_entry_serves_without_torch() -> None:
    # what the dashboard image runs, with torch made unimportable: it builds the app and parses `serve`
    check = (
        "import sys, runpy; sys.modules['torch'] = None\n"
        "from dashboard_api.app import create_app\n"
        "from dashboard_api.settings import DashboardSettings\n"
        "create_app(DashboardSettings(database_url='sqlite:///unused.db', listen='0.0.0.0:8080'))\n"
        "sys.argv = ['fedatoms-dashboard', 'serve', '--help']\n"
        "runpy.run_path('deploy/images/dashboard_entry.py', run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "--database-url" in done.stdout, done.stderr[-2000:]
