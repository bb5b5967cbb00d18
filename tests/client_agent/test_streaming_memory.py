"""A device with more data than memory trains: the agent streams its data, never copies it whole.

The client process runs under RLIMIT_DATA set to what it uses once warmed up plus ``HEADROOM_MB``
(tests/client_agent/limited.py). Its data (a reference to a generated dataset) hold 1.25 × that
headroom of float32 inputs: copying them into one tensor under the same limit fails, while a real
round over gRPC, trained and evaluated on them, succeeds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from processes import ENV, ROOT, SECRET, Aggregator, wait_closed
from support import free_port

HERE = Path(__file__).resolve().parent
HEADROOM_MB = 128  # fixed costs while running (gRPC messages, an evaluation batch) fit
SAMPLES = 14000  # × 3·32·32 float32 = 164 MiB, over 1.25 × the headroom


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA counts anonymous memory on Linux only")
def test_data_larger_than_the_memory_limit_trains(tmp_path: Path) -> None:
    assert SAMPLES * 3 * 32 * 32 * 4 > 1.25 * HEADROOM_MB * 2**20
    config = tmp_path / "fed.toml"
    config.write_text(
        f'enrollment_secret = "{SECRET}"\npoll_interval_seconds = 0.1\ndeadline_seconds = 900\n\n[federation]\n'
        'model = "big_data:StreamNet"\ninput_shape = [3, 32, 32]\nnum_classes = 10\nrounds = 1\nfraction = 1.0\n'
        "local_epochs = 1\nbatch_size = 128\n"
    )
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]), "BIG_DATA_SAMPLES": str(SAMPLES)}
    server = Aggregator(config, free_port(), url, tmp_path / "server.log", env=env).start()
    limited = [sys.executable, str(HERE / "limited.py"), str(HEADROOM_MB), server.target]
    try:
        copy = subprocess.run([*limited, "materialize", "big_data:load"], env=env, capture_output=True, text=True)
        assert copy.returncode != 0 and "can't allocate memory" in copy.stderr, copy.stderr[-2000:]  # the limit binds

        log = tmp_path / "client.log"
        cmd = [*limited, "fedatoms", "client", "run", "--server", server.target, "--enrollment-secret", SECRET]
        cmd += [
            "--data",
            "big_data:load",
            "--allow-model",
            "big_data",
            "--state-dir",
            str(tmp_path / "state"),
            "--no-progress",
        ]
        with log.open("wb") as out:
            code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode
        text = log.read_text()
        assert code == 0, text[-3000:]
        wait_closed(url, 1, timeout=30)
        assert "event=pushed round=1" in text and "event=evaluated round=1" in text
    finally:
        server.stop()
