"""An agent that runs out of memory ends with one line that says what to do, and exit code 6.

It died with a traceback and exit 1, which systemd's unit restarts (Restart=on-failure) every 30 s into the same
failure, fetching the model again each time: the tier is fixed at enrollment, so nothing changes by itself.
Here a real `fedatoms client run` runs under RLIMIT_DATA = what it uses warmed up + ``HEADROOM_MB``
(tests/client_agent/limited.py) against a real aggregator whose rounds train on batches that need about twice
that headroom.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from processes import ENV, ROOT, SECRET, Aggregator
from support import free_port

from client_agent.agent import EXIT_CODES
from client_agent.memory import out_of_memory

HERE = Path(__file__).resolve().parent
HEADROOM_MB = 128  # the client's fixed costs fit (tests/client_agent/test_streaming_memory.py)
BATCH = 2000  # StreamNet on 2000 × 3·32·32 inputs: 23 MiB in, 48 MiB per 8×28×28 activation, their gradients…


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA counts anonymous memory on Linux only")
def test_an_agent_out_of_memory_says_what_to_do_and_exits_6(tmp_path: Path) -> None:
    config = tmp_path / "fed.toml"
    config.write_text(
        f'enrollment_secret = "{SECRET}"\npoll_interval_seconds = 0.1\ndeadline_seconds = 900\n\n[federation]\n'
        'model = "big_data:StreamNet"\ninput_shape = [3, 32, 32]\nnum_classes = 10\nrounds = 1\nfraction = 1.0\n'
        f"local_epochs = 1\nbatch_size = {BATCH}\n"
    )
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]), "BIG_DATA_SAMPLES": str(BATCH)}
    server = Aggregator(config, free_port(), f"sqlite:///{tmp_path / 'agg.db'}", tmp_path / "server.log", env=env)
    server.start()
    state = tmp_path / "state"
    try:
        cmd = [sys.executable, str(HERE / "limited.py"), str(HEADROOM_MB), server.target, "fedatoms", "client", "run"]
        cmd += ["--server", server.target, "--enrollment-secret", SECRET, "--data", "big_data:load"]
        cmd += ["--allow-model", "big_data", "--state-dir", str(state), "--no-progress"]
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        server.stop()
    out = run.stdout + run.stderr
    assert run.returncode == EXIT_CODES["out_of_memory"] == 6, out[-3000:]
    assert "event=registered" in out and "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "level=ERROR" in line]
    assert len(errors) == 1 and "event=out_of_memory" in errors[0], out[-3000:]
    assert "can't allocate memory" in errors[0] or "MemoryError" in errors[0], errors[0]  # what failed
    for says in ("memory_bytes", "--profile", f"delete {state}", "fixed at enrollment", "credentials.json"):
        assert says in errors[0], errors[0]


def test_onednn_failing_counts_as_out_of_memory_only_at_a_memory_limit() -> None:
    """oneDNN's "could not create a primitive" does not say why; without a limit near, it is another failure
    (a traceback, exit 1), which exit 6's advice would not fix. Under RLIMIT_DATA just above what the process
    uses, it is the allocation that failed."""
    onednn = RuntimeError("could not create a primitive")
    assert not out_of_memory(onednn)  # this process: no limit
    program = (
        "import resource\n"
        "from client_agent.memory import out_of_memory\n"
        "used = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmData:'))\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (used + 32 * 2**20, resource.RLIM_INFINITY))\n"
        "print(out_of_memory(RuntimeError('could not create a primitive')), out_of_memory(RuntimeError('other')))\n"
    )
    limited = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert limited.stdout.split() == ["True", "False"], limited.stderr[-2000:]
