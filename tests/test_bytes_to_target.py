"""``benchmarks/bytes_to_target.py`` split across runs: a seed run alone reports what it reports among others."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *args: str) -> str:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bytes_to_target.py"),
        "--rounds",
        "2",
        "--lr",
        "0.05",
        "--configs",
        "fedavg",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "--plot", str(tmp_path / "plot.png"), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _targets(stdout: str) -> list[str]:
    line = next(x for x in stdout.splitlines() if x.startswith("target per seed"))
    return re.findall(r"\d\.\d{3}", line)


def test_first_seed_runs_the_same_seed_as_a_range_that_contains_it(tmp_path: Path) -> None:
    both = _run(tmp_path, "--seeds", "2")
    second_alone = _run(tmp_path, "--seeds", "1", "--first-seed", "1")
    assert len(_targets(both)) == 2 and _targets(second_alone) == _targets(both)[1:]
    assert "seed 1" in second_alone and "seed 0" not in second_alone
