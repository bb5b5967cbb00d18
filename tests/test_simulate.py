"""The in-process simulator end to end: invariants between methods, learning, bandwidth, the CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pretend_cuda import NEEDS_NO_GPU, pretend_cuda

from fedatoms.simulate import SimulationConfig, build_federation, run_simulation

# m reporting clients → m² − m latent clients (filter-decomposition §2.4), written out: m = 4 gives 12
LATENT_CLIENTS = {0: 0, 1: 0, 2: 2, 3: 6, 4: 12, 5: 20, 6: 30}
SMALL = dict(dataset="digits", clients=6, fraction=0.5, rounds=4, local_epochs=1, batch_size=16, seed=3)


def final_tensors(config: SimulationConfig) -> dict[str, torch.Tensor]:
    captured: dict[str, torch.Tensor] = {}
    import fedatoms.simulate as sim

    original = sim.build_federation

    def capture(cfg: SimulationConfig):
        federation = original(cfg)
        captured["federation"] = federation  # type: ignore[assignment]
        return federation

    sim.build_federation = capture  # type: ignore[assignment]
    try:
        run_simulation(config)
    finally:
        sim.build_federation = original  # type: ignore[assignment]
    return captured["federation"].global_tensors  # type: ignore[attr-defined]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_fedlama_with_phi_1_reproduces_every_round():
    base = final_tensors(SimulationConfig(**SMALL, factorization="atoms"))
    lama = final_tensors(SimulationConfig(**SMALL, factorization="atoms", interval_policy="fedlama", tau=1, phi=1))
    assert_same(base, lama)


def test_fixed_with_beta_1_reproduces_every_round():
    base = final_tensors(SimulationConfig(**SMALL, factorization="atoms"))
    fixed = final_tensors(SimulationConfig(**SMALL, factorization="atoms", interval_policy="fixed", beta=1.0))
    assert_same(base, fixed)


def test_fedhm_at_full_rank_with_infinite_temperature_reproduces_fedavg():
    fedavg = final_tensors(SimulationConfig(**SMALL, factorization="none"))
    fedhm = final_tensors(SimulationConfig(**SMALL, factorization="lowrank", tiers=[1.0], weighting="tier-softmax"))
    assert_same(fedavg, fedhm)


def test_scaffold_first_round_with_zero_controls_reproduces_fedavg():
    one = {**SMALL, "rounds": 1}
    assert_same(
        final_tensors(SimulationConfig(**one)),
        final_tensors(SimulationConfig(**one, strategy="scaffold", global_lr=1.0)),
    )


def test_same_seed_same_run_and_other_seed_differs():
    cfg = dict(SMALL, factorization="atoms-lowrank", tiers=[1.0, 0.25], interval_policy="fedlama", tau=1, phi=2)
    a = final_tensors(SimulationConfig(**cfg))
    b = final_tensors(SimulationConfig(**cfg))
    assert_same(a, b)
    c = final_tensors(SimulationConfig(**{**cfg, "seed": 4}))
    assert any(not torch.equal(a[n], c[n]) for n in a)


def test_threads_apply_to_the_run_and_the_callers_setting_comes_back():
    """Float sums depend on the thread split: both transports train and aggregate with ``threads``."""
    seen: list[int] = []
    before = torch.get_num_threads()
    run_simulation(
        SimulationConfig(**{**SMALL, "rounds": 1, "threads": 2}),
        progress=lambda r: seen.append(torch.get_num_threads()),
    )
    assert seen == [2]
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be"):
        run_simulation(SimulationConfig(**{**SMALL, "threads": 0}))


def test_round_records_have_the_documented_fields_and_bytes_add_up():
    results = run_simulation(
        SimulationConfig(
            **SMALL,
            factorization="atoms-lowrank",
            tiers=[1.0, 0.5, 0.25, 0.125],
            interval_policy="fedlama",
            tau=1,
            phi=2,
            personal_atoms=True,
        )
    )
    assert set(results) == {"config", "rounds", "summary"}
    cumulative = 0
    latent_seen = []
    for record in results["rounds"]:
        for key in (
            "round",
            "test_accuracy",
            "test_loss",
            "personalized_accuracy",
            "bytes_up",
            "bytes_down",
            "fedavg_equivalent_bytes",
            "dispersion",
            "wall_seconds",
            "tensors",
            "latent_clients",
        ):
            assert key in record, key
        per_tensor_up = sum(t["bytes_up"] for t in record["tensors"].values())
        per_tensor_down = sum(t["bytes_down"] for t in record["tensors"].values())
        assert per_tensor_up == record["bytes_up"]
        assert per_tensor_down == record["bytes_down"]
        cumulative += record["bytes_up"] + record["bytes_down"]
        # latent clients m² − m (filter-decomposition §2.4), only where atoms and coefficients were both averaged
        latent = LATENT_CLIENTS[record["reported"]] if record["effective_dispersion"] else 0
        assert record["latent_clients"] == latent
        latent_seen.append(record["latent_clients"])
        due = {n for n, t in record["tensors"].items() if t["due"]}
        assert all(t["version"] == record["round"] for n, t in record["tensors"].items() if n in due)
    assert results["summary"]["bytes_total"] == cumulative
    assert 6 in latent_seen  # 3 of 6 clients report (fraction ½): 3² − 3 = 6 latent clients
    # the whole model syncs at every multiple of φτ' = 2
    assert all(t["due"] for t in results["rounds"][1]["tensors"].values())
    json.dumps(results)  # serializable


@pytest.mark.parametrize(
    ("strategy", "args", "latent"),
    [
        ("fedavg", {}, 6),
        ("fedprox", {}, 6),
        ("scaffold", {}, 6),  # η_g = 1: FedAvg's mean, then the controls
        ("scaffold", {"global_lr": 0.5}, 0),
        ("fedavgm", {}, 0),
        ("fedadam", {}, 0),
        ("fedmedian", {}, 0),
        ("feddyn", {}, 0),
        ("feddc", {}, 0),
    ],
)
def test_latent_clients_are_counted_only_where_the_server_keeps_the_mean(
    strategy: str, args: dict, latent: int
) -> None:
    """The paper's m² − m latent clients are the cross terms of ᾱ × D̄ (eq. 8): a server that keeps its mean
    of atoms and of coefficients. A median, a server optimizer's step or FedDyn's and FedDC's corrections keep
    another model, with no such expansion: neither latent clients nor the dispersion around ᾱ × D̄ is theirs."""
    shared = {"atom_lr": "shared"} if strategy in ("scaffold", "feddc") else {}  # their controls need one rate
    config = SimulationConfig(
        factorization="atoms", strategy=strategy, rounds=1, clients=6, fraction=0.5, local_epochs=1, **args, **shared
    )
    (record,) = run_simulation(config)["rounds"]
    assert record["reported"] == 3
    assert record["latent_clients"] == latent  # 3 clients: 3² − 3
    assert bool(record["effective_dispersion"]) == bool(latent)


def test_partial_fetch_moves_only_changed_tensors():
    """With FedLAMA cohorts, a client that keeps its cohort downloads only what was aggregated.

    In round 1 each cohort member downloads the whole model to train, then, once the round
    closed, only the tensors that round aggregated (to evaluate the new model).
    """
    config = SimulationConfig(
        **{**SMALL, "rounds": 3}, factorization="atoms", interval_policy="fixed", beta=0.5, cohort="period"
    )
    results = run_simulation(config)
    first, second = results["rounds"][0], results["rounds"][1]
    cohort = first["cohort_size"]
    not_due_in_first = [n for n, t in first["tensors"].items() if not t["due"]]
    assert not_due_in_first, "the fixed policy leaves coefficients unsynced in round 1"
    for name, t in first["tensors"].items():
        size = config.spec.tensor(name).numel * 4
        assert t["bytes_down"] == cohort * size * (1 if name in not_due_in_first else 2), name
    # round 2 keeps the cohort: nothing new to fetch before training, the aggregated tensors after
    for name, t in second["tensors"].items():
        size = config.spec.tensor(name).numel * 4
        assert t["bytes_down"] == (cohort * size if t["due"] else 0), name


@pytest.mark.slow
def test_learning_on_digits_fedavg_atoms_and_fedlama():
    """Issue 3's learning bar: ≥ 80% in 30 rounds; FedLAMA moves fewer bytes within 3 points of FedAvg.

    Accuracy under 2-class shards swings by several points from round to round (and FedLAMA's
    full syncs fall on even rounds), so "within 3 points" compares the mean of the last five rounds.
    """
    common = dict(
        dataset="digits",
        clients=20,
        fraction=0.5,
        partition="shards",
        classes_per_client=2,
        rounds=30,
        local_epochs=2,
        batch_size=10,
        lr=0.02,
        seed=0,
    )
    fedavg = run_simulation(SimulationConfig(**common))["summary"]
    atoms = run_simulation(SimulationConfig(**common, factorization="atoms"))["summary"]
    lama = run_simulation(SimulationConfig(**common, interval_policy="fedlama", tau=1, phi=2))["summary"]
    assert fedavg["final_test_accuracy"] >= 0.80, fedavg
    assert atoms["final_test_accuracy"] >= 0.80, atoms
    assert lama["bytes_total"] < fedavg["bytes_total"]
    assert lama["mean_test_accuracy_last5"] >= fedavg["mean_test_accuracy_last5"] - 0.03, (lama, fedavg)


def test_cli_simulate_writes_json_and_config_file(tmp_path: Path):
    config = tmp_path / "federation.toml"
    config.write_text('dataset = "digits"\nclients = 6\nfraction = 0.5\nrounds = 2\nfactorization = "atoms"\n')
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fedatoms", "simulate", "--config", str(config), "--rounds", "3", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())
    assert results["config"]["rounds"] == 3  # the flag wins over the file
    assert results["config"]["factorization"] == "atoms"
    assert len(results["rounds"]) == 3
    assert "global test accuracy" in proc.stdout


def test_cli_rejects_unknown_config_keys_with_a_clear_error(tmp_path: Path):
    config = tmp_path / "bad.toml"
    config.write_text("rounds = 2\nlearning_rate = 0.1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "fedatoms", "simulate", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "learning_rate" in proc.stderr


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_a_grpc_simulation_whose_updates_are_refused_ends_at_once_in_one_line(tmp_path: Path, engine: str):
    """At lr 100 every client's first update moves a weight by ~1e15: the aggregator refuses it (its bound on a
    value's move, 1e9), and a simulated round would wait an hour for updates that never come. The simulation
    ends at the first refusal with the aggregator's reason (or, where training turned non-finite first, the
    agent's), one line and exit 2 (from a Ray actor too, whose error comes wrapped in its traceback), and the
    other worker process does not keep the command waiting."""
    if engine == "ray":
        pytest.importorskip("ray")
    cmd = [sys.executable, "-m", "fedatoms", "simulate", "--transport", "grpc", "--rounds", "2", "--lr", "100"]
    args = ["--clients", "6", "--state-dir", str(tmp_path / "state"), "--engine", engine]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "fedatoms: error:" in line]
    refused = r"the aggregator refused client \w+'s update: tensor '[\w.]+' .*over max_update_value = .*"
    assert len(errors) == 1, proc.stderr  # on a line of its own, not after the progress bar's
    assert re.fullmatch(rf"fedatoms: error: round 1: ({refused}|local training diverged .*)", errors[0]), errors


def test_build_federation_rejects_personal_atoms_without_atoms():
    with pytest.raises(ValueError, match="personal-atoms"):
        build_federation(SimulationConfig(personal_atoms=True, factorization="none"))


def test_cli_plot_draws_a_png_from_results(tmp_path: Path):
    out = tmp_path / "r.json"
    from fedatoms.simulate import write_results

    write_results(
        run_simulation(
            SimulationConfig(
                **{**SMALL, "rounds": 2}, factorization="atoms-lowrank", tiers=[1.0, 0.25], personal_atoms=True
            )
        ),
        out,
    )
    png = tmp_path / "plot.png"
    proc = subprocess.run(
        [sys.executable, "-m", "fedatoms", "plot", str(out), str(out), "-o", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 20_000


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(tiers=[1.0, 0.5]), "tiers below 1 need"),
        (dict(tiers=[1.0, 0.5], factorization="lowrank", strategy="scaffold"), "SCAFFOLD"),
        (dict(temperature=5.0), "tier-softmax"),
        (dict(interval_policy="fixed"), "fixed policy"),
        (dict(tiers=[0.3], factorization="lowrank"), "tiers must be among"),
        (dict(model="lenet-cifar10"), "takes inputs"),
    ],
)
def test_conflicting_settings_are_rejected_before_anything_runs(overrides, message):
    with pytest.raises(ValueError, match=message):
        SimulationConfig(**overrides)


def test_fp16_transport_quantizes_what_travels_and_halves_the_bytes():
    base = dict(SMALL, rounds=2, factorization="atoms")
    fp32 = run_simulation(SimulationConfig(**base))
    fp16 = run_simulation(SimulationConfig(**base, fp16=True))
    assert fp16["summary"]["bytes_total"] * 2 == fp32["summary"]["bytes_total"]
    assert fp16["rounds"][-1]["test_loss"] != fp32["rounds"][-1]["test_loss"]  # values really went through fp16


def test_scaffold_traffic_counts_controls_both_ways():
    base = dict(SMALL, rounds=2)
    fedavg = run_simulation(SimulationConfig(**base))["summary"]
    scaffold = run_simulation(SimulationConfig(**base, strategy="scaffold"))["summary"]
    assert scaffold["bytes_down"] > fedavg["bytes_down"] and scaffold["bytes_up"] > fedavg["bytes_up"]


def test_cli_demo_runs_again_in_the_same_output_directory(tmp_path: Path):
    """A second demo starts a new federation: its clients enroll again instead of presenting dead tokens."""
    cmd = [sys.executable, "-m", "fedatoms", "demo", "--rounds", "1", "--no-dashboard", "--output-dir", str(tmp_path)]
    for attempt in (1, 2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (attempt, proc.stderr[-2000:])
        assert "global test accuracy" in proc.stdout
    results = json.loads((tmp_path / "demo-results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1]


@pytest.mark.parametrize("transport", ["inprocess", "grpc"])
def test_save_model_writes_the_model_the_record_evaluated(transport: str, tmp_path) -> None:
    """The saved file, loaded as a user would, scores on the digits test split exactly the record's final
    test accuracy (the server's evaluation of the same model), and carries the loader's normalization."""
    from fedatoms import load_model
    from fedcore.data import load_dataset
    from fedcore.model_file import read_model_file
    from fedcore.training import evaluate

    config = SimulationConfig(**{**SMALL, "rounds": 2, "lr": 0.05}, factorization="atoms", transport=transport)
    out = tmp_path / "model.safetensors"
    options = {"workers": 1} if transport == "grpc" else {}
    record = run_simulation(config, model_out=out, **options)["rounds"][-1]
    model = load_model(out)
    assert evaluate(model, load_dataset("digits")[1], device="cpu").accuracy == record["test_accuracy"]
    assert record["test_accuracy"] > 0.2  # learned something: a model left at its start would not tell
    assert read_model_file(out).normalization == config.normalization


def test_scaffolds_fedavg_equivalent_is_what_a_fedavg_run_on_the_same_cohorts_moves() -> None:
    """A client that held the model since its last round still fetches SCAFFOLD's control: that fetch moved
    no model, so FedAvg would not make it, and it adds nothing to the FedAvg equivalent (it added a whole
    model before: 1.52× read as SCAFFOLD's overhead where a FedAvg run of the same seed shows 1.78×)."""
    config = {**SMALL, "rounds": 4}
    fedavg = run_simulation(SimulationConfig(**config))["summary"]
    scaffold = run_simulation(SimulationConfig(**config, strategy="scaffold"))["summary"]
    assert fedavg["fedavg_equivalent_bytes"] == fedavg["bytes_total"]  # FedAvg against itself: 1.000×
    assert scaffold["fedavg_equivalent_bytes"] == fedavg["bytes_total"]
    assert scaffold["bytes_ratio_vs_fedavg"] == pytest.approx(scaffold["bytes_total"] / fedavg["bytes_total"])


@pytest.mark.parametrize("transport", ["inprocess", "grpc"])
def test_device_cpu_runs_and_every_grpc_agent_trains_on_it(transport: str, tmp_path: Path) -> None:
    """``--device`` reaches every client: over gRPC each agent, in either worker process, records the device it
    trained on in its saved state (the task's config with the agent's device in it), where the server's task
    alone says ``auto``."""
    from client_agent.state import ClientState
    from fedcore.keys import client_key

    config = SimulationConfig(
        dataset="digits", clients=4, fraction=1.0, rounds=2, partition="iid", batch_size=32, seed=3, device="cpu"
    )
    config.transport = transport
    options = {"workers": 2, "state_dir": str(tmp_path / "clients")} if transport == "grpc" else {}
    shown: list[dict] = []
    results = run_simulation(config, progress=shown.append, **options)
    assert [r["round"] for r in results["rounds"]] == [1, 2] and results["config"]["device"] == "cpu"
    # the progress bar ends on the summary's bytes: over gRPC a round's record grows after its close by the
    # fetches that evaluate its model, and the bar's last MB missed the final round's
    totals = ("cumulative_bytes_up", "cumulative_bytes_down")
    assert [r["round"] for r in shown] == [1, 2]
    assert [shown[-1][k] for k in totals] == [results["rounds"][-1][k] for k in totals]
    if transport == "grpc":
        states = [ClientState.load(tmp_path / "clients" / client_key(i)) for i in range(4)]
        assert [s.rounds_joined for s in states] == [2, 2, 2, 2]
        assert [s.last_config["device"] for s in states] == ["cpu"] * 4


@NEEDS_NO_GPU
def test_device_cpu_keeps_an_in_process_run_off_a_gpu(monkeypatch) -> None:
    """``--device cpu`` on a GPU machine: the clients train and evaluate on the CPU. The machine pretends CUDA
    (``auto`` picks it, and using it fails): a run that finishes, with the clients' evaluations, stayed off it."""
    pretend_cuda(monkeypatch)
    config = SimulationConfig(dataset="digits", clients=2, fraction=1.0, rounds=1, partition="iid", device="cpu")
    (record,) = run_simulation(config)["rounds"]
    assert record["local_accuracy"] is not None


@NEEDS_NO_GPU
@pytest.mark.parametrize("engine", ["local", "ray actor"])
def test_a_client_that_has_not_trained_evaluates_on_the_given_device(engine: str, monkeypatch) -> None:
    """A replaced Ray actor's clients evaluate before they train (the retried evaluation of the round its
    predecessor died in): on the simulation's ``--device``, not on ``auto`` (CUDA here: pretended, and failing)."""
    from client_agent.ray_pool import ClientHost
    from fedatoms.engines.local import LocalClients
    from fedcore.keys import client_key

    config = SimulationConfig(dataset="digits", clients=2, fraction=1.0, rounds=1, partition="iid", device="cpu")
    federation, population = build_federation(config), config.population()
    pretend_cuda(monkeypatch)
    if engine == "local":
        pool = LocalClients(population.build(), config.seed, config.fp16, config.personal_atoms, config.device)
        evaluations = [e for _, _, e in pool.evaluate(federation, pool.client_ids)]
    else:  # the actor's body, called as Ray would call it
        host = ClientHost(population, range(config.clients), torch_threads=1)
        fetched = federation.fetch(1.0, {})  # the whole model, as the driver sends it to a fresh actor
        tensors, versions = {n: t for n, (t, _) in fetched.items()}, {n: v for n, (_, v) in fetched.items()}
        members = [(client_key(i), versions) for i in range(config.clients)]
        evaluations = [e for _, e in host.evaluate(federation.tier_spec(1.0), tensors, members, False, config.device)]
    assert len(evaluations) == 2 and all(e.num_samples > 0 for e in evaluations)


def test_plot_labels_tell_apart_runs_a_short_label_names_alike() -> None:
    """Two FedAdam runs (default η and η = 0.01), FedAvg with and without fp16, FedRep and FedAvg: the legend read
    the same for each pair."""
    from fedatoms.plots import run_labels

    base = {"factorization": "none", "interval_policy": "every_round", "strategy": "fedavg", "tiers": [1.0]}

    def run(name: str, **config: object) -> tuple[Path, dict]:
        return Path(f"{name}.json"), {"config": {**base, "output": f"{name}.json", **config}}

    runs = [
        run("a", fp16=False),
        run("b", fp16=True),
        run("c", strategy="fedadam", strategy_args={}),
        run("d", strategy="fedadam", strategy_args={"eta": 0.01}),
        run("e", personalization="fedrep"),
        run("f", fp16=False),
    ]
    assert run_labels(runs) == [
        "none / every_round (fp16=false, a)",
        "none / every_round (fp16=true)",
        "fedadam / none / every_round (strategy_args={})",
        'fedadam / none / every_round (strategy_args={"eta": 0.01})',
        "none / every_round / fedrep",
        "none / every_round (fp16=false, f)",
    ]
    assert run_labels([runs[0], run("g", fp16=False)]) == ["none / every_round (a)", "none / every_round (g)"]
