"""The aggregator's log is valid logfmt that a client cannot forge or flood.

A real ``fedatoms aggregator serve`` process registers clients whose names carry a newline with a
forged ``event=federation_lock_lost``, a NUL and 300 kB; its log is then parsed line by line with
an independent logfmt reader (a regex over ``key=value`` and ``key="json string"``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_helpers import SECRET
from support import free_port, wait_serving

from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

_PAIR = re.compile(r'([a-z_]+)=("(?:[^"\\]|\\.)*"|[^ "]+)')


def _parse(line: str) -> dict[str, str]:
    """key=value pairs of one logfmt line; the whole line must be made of them."""
    pairs = _PAIR.findall(line)
    rebuilt = " ".join(f"{k}={v}" for k, v in pairs)
    assert rebuilt == line, f"not logfmt: {line!r}"
    return {k: json.loads(v) if v.startswith('"') else v for k, v in pairs}


def test_client_controlled_values_cannot_forge_or_flood_log_lines(tmp_path) -> None:
    config = tmp_path / "federation.toml"
    config.write_text(f'enrollment_secret = "{SECRET}"\n')
    log, target = tmp_path / "server.log", f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "fedatoms", "aggregator", "serve", "--config", str(config), "--listen", target]
    cmd += ["--database-url", f"sqlite:///{tmp_path / 'agg.db'}"]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(cmd, cwd=root, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    wait_serving(target)
    forged = "edge\nts=2026-01-01T00:00:00.000 level=ERROR logger=fedatoms.aggregator event=federation_lock_lost"
    names = [forged, "nul\x00byte", "x" * 300_000]
    try:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.AggregatorStub(channel)
            for name in names:
                stub.Register(
                    pb.RegisterRequest(
                        profile=pb.CapabilityProfile(device_name="d", num_samples=10),
                        enrollment_secret=SECRET,
                        client_name=name,
                    )
                )
    finally:
        server.terminate()
        server.wait(30)
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("ts=")]
    records = [_parse(line) for line in lines]
    assert not any(r.get("event") == "federation_lock_lost" for r in records)
    registered = [r for r in records if r.get("event") == "client_registered"]
    assert [r["name"] for r in registered[:2]] == [forged, "nul\x00byte"]  # logged whole, escaped
    assert registered[2]["name"].startswith("x" * 200) and "(+299800 chars)" in registered[2]["name"]
    assert max(len(line) for line in lines) < 2_000
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}", r["ts"]) for r in records)
