"""Helpers of the container tests: podman with the repository's containers.conf, waits with deadlines."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ENV = {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(DEPLOY / "podman" / "containers.conf"))}
PREFIX = "localhost/fedatoms-"


def podman(*args: str, check: bool = True, timeout: float = 120) -> str:
    done = subprocess.run(["podman", *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return done.stdout.strip()


def inspect(container: str, template: str) -> str:
    return podman("inspect", "--format", template, container, check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, token: str | None = None) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=5) as reply:
        return json.load(reply)


def get_text(url: str, token: str | None = None) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=5) as reply:
        return reply.read().decode()


def wait_for(what: str, predicate: Callable[[], Any], timeout: float, interval: float = 1.0) -> Any:
    """Poll ``predicate`` until it returns something true (errors count as not yet); its value.

    Raises TimeoutError naming ``what`` and the last error at the deadline.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except Exception as exc:
            last = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f} s (last: {last!r})")
        time.sleep(interval)


def logs(container: str, tail: int = 40) -> str:
    done = subprocess.run(["podman", "logs", "--tail", str(tail), container], env=ENV, capture_output=True, text=True)
    return done.stdout + done.stderr
