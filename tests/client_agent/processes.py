"""Real processes for the agent tests: `fedatoms aggregator serve` and `fedatoms client run`, with their logs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session
from support import free_port, wait_serving  # noqa: F401  (re-exported for the agent tests)

from aggregator_service import store

ROOT = Path(__file__).resolve().parents[2]
SECRET = "agent-test-enrollment-secret"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def federation_toml(path: Path, **federation: object) -> Path:
    """A server config: fast polling, generous deadlines, and the given [federation] keys."""
    lines = [
        f'enrollment_secret = "{SECRET}"',
        "deadline_seconds = 600",
        "poll_interval_seconds = 0.1",
        "",
        "[federation]",
    ]
    for key, value in federation.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = f'"{value}"'
        else:
            text = repr(value)
        lines.append(f"{key} = {text}")
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Aggregator:
    config: Path
    port: int
    url: str
    log: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] | None = None  # instead of ENV (e.g. a PYTHONPATH that finds a test's model)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Aggregator:
        cmd = [sys.executable, "-m", "fedatoms", "aggregator", "serve", "--config", str(self.config)]
        cmd += ["--listen", self.target, "--database-url", self.url]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=self.env or ENV, stdout=self.log.open("ab"), stderr=subprocess.STDOUT
        )
        try:
            wait_serving(self.target)
        except TimeoutError:
            self.proc.kill()
            raise AssertionError(f"aggregator did not start:\n{self.log.read_text()}") from None
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)


def start_agent(target: str, state_dir: Path, index: int, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fedatoms", "client", "run", "--server", target, "--enrollment-secret", SECRET]
    cmd += ["--partition-index", str(index), "--num-partitions", "5", "--state-dir", str(state_dir), "--no-progress"]
    cmd += list(extra)
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def wait_for(log: Path, pattern: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> re.Match:
    """Block until ``pattern`` appears in ``log``; fails with the log when it does not."""
    deadline = time.monotonic() + timeout
    rx = re.compile(pattern)
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        match = rx.search(text)
        if match:
            return match
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"{pattern!r} not in {log.name} after {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def closed_rounds(url: str) -> int:
    engine = store.create_engine_for(url)
    try:
        with Session(engine) as s:
            return int(
                s.scalar(select(func.count()).select_from(store.Round).where(store.Round.state == "closed")) or 0
            )
    finally:
        engine.dispose()


def wait_closed(url: str, rounds: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while closed_rounds(url) < rounds:
        if time.monotonic() > deadline:
            raise AssertionError(f"round {rounds} did not close within {timeout:.0f} s")
        time.sleep(0.1)
