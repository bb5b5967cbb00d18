"""``benchmarks/bytes_to_target.py`` split across runs: a seed run alone reports what it reports among others."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def _last5(stdout: str, name: str) -> str:
    line = next(x for x in stdout.splitlines() if x.startswith(f"{name} "))
    return line.split()[1]


def test_your_own_folder_is_what_fedavg_and_every_configuration_federate(tmp_path: Path) -> None:
    from image_folders import write_folder

    from fedatoms.simulate import SimulationConfig, run_simulation

    folder = write_folder(tmp_path / "pictures", channels=3, size=12, count=400)
    out = _run(
        tmp_path,
        "--data",
        str(folder),
        "--model",
        "digits-cnn",
        "--clients",
        "5",
        "--fraction",
        "1",
        "--seeds",
        "1",
        "--configs",
        "fedhm-1/8",
        "--json",
        str(tmp_path / "runs.json"),
    )
    assert out.startswith(f"{folder}: 5 clients × 2 classes")
    written = {r["configuration"]: r for r in json.loads((tmp_path / "runs.json").read_text())["runs"]}
    keys = dict(data=str(folder), model="digits-cnn", clients=5, fraction=1.0, rounds=2, lr=0.05, momentum=0.9)
    for name, method in (
        ("fedavg", {"factorization": "none"}),
        ("fedhm-1/8", {"factorization": "lowrank", "tiers": [0.125]}),
    ):
        rounds = run_simulation(SimulationConfig(**keys, **method, local_epochs=2, threads=1, seed=0))["rounds"]
        # the folder's own run, made here by the simulator: the benchmark's row reads the same
        assert _last5(out, name) == f"{sum(r['test_accuracy'] for r in rounds) / len(rounds):.3f}"
        # and so do the curves --json writes: the ledger's bytes and the server's accuracy, round by round
        assert written[name]["accuracy"] == [r["test_accuracy"] for r in rounds]
        assert written[name]["cumulative_bytes"] == [
            r["cumulative_bytes_up"] + r["cumulative_bytes_down"] for r in rounds
        ]
    assert written["fedavg"]["fewer_bytes"] == 1.0 and written["fedavg"]["smallest_cut"] is None
    cut = written["fedhm-1/8"]["smallest_cut"]
    assert cut["tier"] == 0.125 and cut["accuracy"] == [r["tier_accuracy"]["0.125"] for r in rounds]


def test_a_setting_fedavg_must_share_is_refused_in_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("bytes_to_target", ROOT / "benchmarks" / "bytes_to_target.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up there
    spec.loader.exec_module(script)
    for args, said in (
        (["--set", "rounds=3"], "use --rounds"),
        (["--set", "lr=0.1"], "use --lr"),
        (["--set", "data=elsewhere"], "use --data"),
        (["--set", "no_such_key=1"], "not a config key"),
        (["--data", str(tmp_path)], "needs --model"),
    ):
        with pytest.raises(SystemExit) as exited:
            script.main(args)
        assert exited.value.code == 2 and said in capsys.readouterr().err, args
