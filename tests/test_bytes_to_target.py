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


SMALL = ("--rounds", "2", "--lr", "0.05", "--configs", "fedavg")


def _run(tmp_path: Path, *args: str) -> str:
    """The benchmark as a command."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bytes_to_target.py"), *SMALL]
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


def _script(monkeypatch: pytest.MonkeyPatch):
    """The benchmark as a module, to call its ``main`` in this process (a refusal exits before any run)."""
    spec = importlib.util.spec_from_file_location("bytes_to_target", ROOT / "benchmarks" / "bytes_to_target.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up there
    spec.loader.exec_module(script)
    return script


def test_a_setting_fedavg_must_share_is_refused_in_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _script(monkeypatch)
    for args, said in (
        (["--set", "rounds=3"], "use --rounds"),
        (["--set", "lr=0.1"], "use --lr"),
        (["--set", "data=elsewhere"], "use --data"),
        (["--set", "no_such_key=1"], "not a config key"),
        (
            ["--configs", "fedavg,atoms,fedhm-1/8", "--set", "phi=4"],
            "no configuration of fedavg,atoms,fedhm-1/8 reads it",
        ),
        (["--configs", "atoms-lowrank", "--set", "tiers=0.125", "--set", "tier_average=aligned"], "reads it"),
        (["--configs", "atoms-lowrank", "--set", "tiers=1/8"], "tiers must be numbers"),
        (["--data", str(tmp_path)], "needs --model"),
    ):
        with pytest.raises(SystemExit) as exited:
            script.main(args)
        assert exited.value.code == 2 and said in capsys.readouterr().err, args


def test_a_set_key_goes_to_the_configurations_that_read_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--set warmup_rounds=0`` reaches FedLAMA's configuration, and plain atoms run as they would without it
    (a config refuses a key its method never reads): the same record as a run without ``--set``."""
    script = _script(monkeypatch)
    runs = {}
    for name, extra in (("set", ["--set", "warmup_rounds=0"]), ("plain", [])):
        json_path = tmp_path / f"{name}.json"
        args = [*SMALL[:-1], "fedavg,atoms,atoms+lama2", "--seeds", "1", "--plot", str(tmp_path / "p.png")]
        assert script.main([*args, "--json", str(json_path), *extra]) == 0
        runs[name] = {r["configuration"]: r for r in json.loads(json_path.read_text())["runs"]}
    capsys.readouterr()
    assert runs["set"]["atoms"]["accuracy"] == runs["plain"]["atoms"]["accuracy"]
    assert runs["set"]["fedavg"]["accuracy"] == runs["plain"]["fedavg"]["accuracy"]


def test_a_baseline_from_an_earlier_json_gives_the_table_a_run_with_fedavg_gives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _script(monkeypatch)

    def run(*args: str) -> tuple[str, str]:  # in this process: the command itself is run by the tests above
        assert script.main([*SMALL, "--plot", str(tmp_path / "plot.png"), *args]) == 0
        captured = capsys.readouterr()
        return captured.out, captured.err

    configs = ("--configs", "fedhm-1/8,fedhm-1")
    together, _ = run("--seeds", "2", *configs, "--json", str(tmp_path / "first.json"))
    # seed 1 alone, FedAvg's runs read from the first file: the same target, the same figures
    alone, progress = run(
        "--seeds", "1", "--first-seed", "1", *configs,
        "--baseline", str(tmp_path / "first.json"), "--json", str(tmp_path / "second.json"),
    )  # fmt: skip
    assert ", 2 runs, " in alone and "FedAvg's runs from" in alone  # only the configurations ran
    # the progress lines count the runs done (they counted the file's FedAvg run too: [2/2], [3/2])
    assert re.findall(r"\[(\d+)/(\d+),", progress) == [("1", "2"), ("2", "2")]
    assert _targets(alone) == _targets(together)[1:]
    first = {(r["configuration"], r["seed"]): r for r in json.loads((tmp_path / "first.json").read_text())["runs"]}
    second = {(r["configuration"], r["seed"]): r for r in json.loads((tmp_path / "second.json").read_text())["runs"]}
    figures = ("last5", "first_round_at_target", "bytes_to_target", "fewer_bytes", "accuracy", "cumulative_bytes")
    for name in ("fedavg", "fedhm-1/8", "fedhm-1"):
        assert {k: second[(name, 1)][k] for k in figures} == {k: first[(name, 1)][k] for k in figures}, name
    # FedHM at tier 1 is FedAvg bit for bit: against the baseline it reaches the target where FedAvg does
    assert second[("fedhm-1", 1)]["first_round_at_target"] is not None
    assert second[("fedhm-1", 1)]["fewer_bytes"] == 1.0


def test_a_baseline_of_another_setting_or_without_the_seeds_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _run(tmp_path, "--seeds", "1", "--json", str(tmp_path / "fedavg.json"))
    (tmp_path / "other.txt").write_text("not json")
    # the right setting, but a run entry cut short (an edited or truncated file)
    damaged = json.loads((tmp_path / "fedavg.json").read_text())
    del damaged["runs"][0]["accuracy"]
    (tmp_path / "damaged.json").write_text(json.dumps(damaged))
    script = _script(monkeypatch)
    monkeypatch.chdir(tmp_path)
    for args, said in (
        (["--rounds", "3", "--lr", "0.05", "--baseline", "fedavg.json"], "rounds 2 there, 3 here"),
        (["--rounds", "2", "--lr", "0.05", "--seeds", "2", "--baseline", "fedavg.json"], "no FedAvg run of seed 1"),
        (["--rounds", "2", "--lr", "0.05", "--baseline", "other.txt"], "not a --json file"),
        (["--rounds", "2", "--lr", "0.05", "--baseline", "missing.json"], "missing.json: no such file"),
        (["--rounds", "2", "--lr", "0.05", "--baseline", "damaged.json"], "not a --json file"),
    ):
        with pytest.raises(SystemExit) as exited:
            script.main(["--configs", "fedhm-1/8", "--plot", str(tmp_path / "refused.png"), *args])
        out = capsys.readouterr()
        assert exited.value.code == 2 and said in out.err, (args, out.err)
        assert "seed 0:" not in out.out + out.err and not (tmp_path / "refused.png").exists()  # before any run


def test_fedavg_that_diverges_sets_no_target(tmp_path: Path) -> None:
    """At a rate no model survives, every run's first round turns non-finite: each worker (``--jobs 2``) reports
    its run as diverged, and FedAvg that diverged sets no target, which the benchmark says (exit 2) instead of
    dividing by the zero bytes it moved."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bytes_to_target.py"), "--rounds", "2", "--lr", "100"]
    args = ["--configs", "fedavg", "--seeds", "2", "--jobs", "2", "--plot", str(tmp_path / "plot.png")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr
    for seed in (0, 1):
        assert re.search(rf"fedavg seed {seed}: diverged after round 0 \(tensor '[\w.]+': .*NaN or Inf", proc.stderr)
    assert "error: FedAvg diverged on seed 0, 1: it sets no target to reach; lower --lr" in proc.stderr
    assert "target per seed" not in proc.stdout
