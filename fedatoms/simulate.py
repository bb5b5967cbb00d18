"""`fedatoms simulate`: a whole federation on one machine, recorded round by round as JSON.

The in-process transport drives :class:`aggregator_service.rounds.Federation` and the
virtual clients of :mod:`client_agent.pool` directly; it shares every line of client and
aggregation code with the gRPC service except the transport.
"""

from __future__ import annotations

import json
import math
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from aggregator_service.aggregation import ClientUpdate, build_strategy
from aggregator_service.intervals import build_policy
from aggregator_service.metrics import fedavg_equivalent_bytes, total_dispersion
from aggregator_service.rounds import CohortSampler, Federation, RoundOutcome, derive_seed
from client_agent.pool import VirtualClient, make_virtual_clients
from client_agent.update import TrainTask, run_task
from fedcore.codec import encoded_size
from fedcore.data import ArrayDataset, load_dataset
from fedcore.spec import ModelSpec
from fedcore.training import TrainConfig, evaluate, personalized_model

__all__ = ["DEFAULT_MODELS", "SimulationConfig", "run_simulation"]

DEFAULT_MODELS = {
    "digits": "digits-cnn",
    "mnist": "mnist-cnn",
    "fashion-mnist": "mnist-cnn",
    "cifar10": "lenet-cifar10",
    "cifar100": "lenet-cifar100",
}


@dataclass
class SimulationConfig:
    """Every knob of a simulated federation; the same keys work as CLI flags and in a TOML file."""

    dataset: str = "digits"
    data_dir: str | None = None
    download: bool = False
    model: str | None = None  # default: DEFAULT_MODELS[dataset]
    factorization: str = "none"
    num_atoms: int = 9
    clients: int = 20
    fraction: float = 0.5
    min_clients: int = 1
    cohort: str = "period"
    partition: str = "shards"
    classes_per_client: int = 2
    dirichlet_alpha: float = 0.5
    rounds: int = 20
    local_epochs: int = 1
    batch_size: int = 10
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    strategy: str = "fedavg"
    mu: float = 0.01
    global_lr: float = 1.0
    weighting: str = "samples"
    temperature: float = math.inf
    keep_local_buffers: bool = False
    frobenius_decay: float = 0.0
    interval_policy: str = "every_round"
    beta: float = 0.2
    tau: int = 1
    phi: int = 2
    warmup_rounds: int = 0
    tiers: list[float] = field(default_factory=lambda: [1.0])
    personal_atoms: bool = False
    personal_epochs: int | None = None
    fp16: bool = False
    seed: int = 0
    device: str = "auto"
    transport: str = "inprocess"
    output: str | None = None

    def __post_init__(self) -> None:
        if self.model is None:
            if self.dataset not in DEFAULT_MODELS:
                raise ValueError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(DEFAULT_MODELS)}")
            self.model = DEFAULT_MODELS[self.dataset]
        if isinstance(self.tiers, str):
            self.tiers = [float(t) for t in self.tiers.split(",") if t.strip()]
        self.tiers = [float(t) for t in self.tiers]
        if self.rounds < 1 or self.clients < 1:
            raise ValueError("rounds and clients must be ≥ 1")
        if self.personal_atoms and self.factorization not in ("atoms", "atoms-lowrank"):
            raise ValueError("--personal-atoms needs --factorization atoms or atoms-lowrank")

    @classmethod
    def from_toml(cls, path: str | Path, overrides: Mapping[str, Any] | None = None) -> SimulationConfig:
        data = tomllib.loads(Path(path).read_text())
        data = {k.replace("-", "_"): v for k, v in data.items()}
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown keys {', '.join(sorted(unknown))}")
        data.update(overrides or {})
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["temperature"] = "inf" if math.isinf(self.temperature) else self.temperature
        return d

    @property
    def spec(self) -> ModelSpec:
        assert self.model is not None
        num_classes = {"cifar100": 100}.get(self.dataset, 10)
        return ModelSpec(self.model, num_classes, self.factorization, self.num_atoms)

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            local_epochs=self.local_epochs,
            batch_size=self.batch_size,
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            prox_mu=self.mu if self.strategy == "fedprox" else 0.0,
            frobenius_decay=self.frobenius_decay,
            personal_epochs=self.personal_epochs,
            device=self.device,
        )

    def strategy_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "weighting": self.weighting,
            "temperature": self.temperature,
            "keep_local_buffers": self.keep_local_buffers,
        }
        if self.strategy == "fedprox":
            params["mu"] = self.mu
        if self.strategy == "scaffold":
            params.update(global_lr=self.global_lr, num_clients_total=self.clients, spec=self.spec.full())
        return params

    def policy_params(self) -> dict[str, Any]:
        if self.interval_policy == "fixed":
            return {"beta": self.beta}
        if self.interval_policy == "fedlama":
            return {"tau_base": self.tau, "phi": self.phi, "warmup_rounds": self.warmup_rounds}
        return {}


def build_federation(config: SimulationConfig) -> Federation:
    spec = config.spec.full()
    return Federation(
        spec,
        build_strategy(config.strategy, **config.strategy_params()),
        build_policy(config.interval_policy, spec.tensors, **config.policy_params()),
        CohortSampler(config.fraction, config.min_clients, config.cohort, config.seed),
        tiers=config.tiers,
        init_seed=config.seed,
        fp16=config.fp16,
    )


ProgressFn = Callable[[dict[str, Any]], None]


def run_simulation(config: SimulationConfig, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run ``config.rounds`` rounds in process and return ``{"config", "rounds", "summary"}``."""
    if config.transport != "inprocess":
        raise ValueError(f"transport {config.transport!r} is not available in this build; use 'inprocess'")
    started = time.perf_counter()
    train, test = load_dataset(config.dataset, config.data_dir, download=config.download)
    federation = build_federation(config)
    clients = make_virtual_clients(
        train,
        test,
        config.clients,
        config.tiers,
        scheme=config.partition,
        classes_per_client=config.classes_per_client,
        dirichlet_alpha=config.dirichlet_alpha,
        seed=config.seed,
    )
    by_id = {c.client_id: c for c in clients}
    train_config = config.train_config()
    fedavg_bytes_per_client = fedavg_equivalent_bytes(config.spec, 1)
    records: list[dict[str, Any]] = []
    totals = {"bytes_up": 0, "bytes_down": 0, "fedavg_equivalent_bytes": 0}
    for r in range(1, config.rounds + 1):
        t0 = time.perf_counter()
        plan = federation.plan(r, list(by_id))
        down: dict[str, int] = {}
        up: dict[str, int] = {}
        control = federation.strategy.client_config()
        server_control = federation.strategy.server_control() if control.get("scaffold") else None
        for cid in plan.cohort:  # fixed fold order: sorted client ids
            vc = by_id[cid]
            tier_spec = federation.tier_spec(vc.state.tier)
            fetched = federation.fetch(vc.state.tier, vc.state.versions)
            for name, nbytes in federation.download_bytes(fetched).items():
                _add(down, tier_spec.tensor(name).full_name or name, nbytes)
            vc.state.receive(fetched)
            task = TrainTask(
                round=r,
                due=federation.tier_due(vc.state.tier, plan.due),
                config=train_config,
                continue_unsynced=plan.continue_unsynced,
                seed=derive_seed(config.seed, r, cid),
                strategy=control,
                server_control=server_control,
            )
            push = run_task(vc.state, tier_spec, task, vc.train, personal_atoms=config.personal_atoms)
            for name, t in push.tensors.items():
                nbytes = encoded_size(tuple(t.shape), str(t.dtype).removeprefix("torch."), config.fp16)
                _add(up, tier_spec.tensor(name).full_name or name, nbytes)
            federation.fold(
                ClientUpdate(
                    client_id=cid,
                    num_samples=push.num_samples,
                    tier=vc.state.tier,
                    spec=tier_spec,
                    tensors=push.tensors,
                    control_delta=push.control_delta,
                    metrics=push.metrics,
                )
            )
        outcome = federation.close()
        record = _round_record(config, federation, outcome, test, [by_id[c] for c in plan.cohort], down, up)
        record["fedavg_equivalent_bytes"] = fedavg_bytes_per_client * len(plan.cohort)
        record["wall_seconds"] = round(time.perf_counter() - t0, 4)
        for key in totals:
            totals[key] += record[key]
            record[f"cumulative_{key}"] = totals[key]
        records.append(record)
        if progress is not None:
            progress(record)
    summary = _summary(records, totals, time.perf_counter() - started)
    return {"config": config.to_dict(), "rounds": records, "summary": summary}


def _round_record(
    config: SimulationConfig,
    federation: Federation,
    outcome: RoundOutcome,
    test: ArrayDataset,
    cohort: list[VirtualClient],
    down: Mapping[str, int],
    up: Mapping[str, int],
) -> dict[str, Any]:
    full_model = federation.spec.build()
    full_model.load_state_dict(federation.global_tensors)
    server_eval = evaluate(full_model, test)
    local_acc, personal_acc = [], []
    for vc in cohort:
        tier_model = federation.tier_spec(vc.state.tier).build()
        tier_model.load_state_dict(federation.tier_tensors(vc.state.tier))
        local_acc.append(evaluate(tier_model, vc.test).accuracy)
        if vc.state.personal_atoms is not None:
            personal_acc.append(evaluate(personalized_model(tier_model, vc.state.personal_atoms), vc.test).accuracy)
    tensors = {
        t.name: {
            "role": t.role,
            "interval": outcome.intervals[t.name],
            "due": t.name in outcome.due,
            "version": federation.versions[t.name],
            "d_l": outcome.discrepancy.get(t.name),
            "dispersion": outcome.result.dispersion.get(t.name),
            "bytes_down": down.get(t.name, 0),
            "bytes_up": up.get(t.name, 0),
        }
        for t in federation.spec.tensors
    }
    record: dict[str, Any] = {
        "round": outcome.round,
        "cohort_size": len(outcome.cohort),
        "reported": outcome.reported,
        "test_accuracy": server_eval.accuracy,
        "test_loss": server_eval.loss,
        "local_accuracy": sum(local_acc) / len(local_acc) if local_acc else None,
        "bytes_up": sum(up.values()),
        "bytes_down": sum(down.values()),
        "dispersion": total_dispersion(outcome.result.dispersion),
        "effective_dispersion": dict(outcome.result.effective_dispersion),
        "latent_clients": outcome.latent_clients,
        "tensors": tensors,
    }
    if config.personal_atoms:
        record["personalized_accuracy"] = sum(personal_acc) / len(personal_acc) if personal_acc else None
    return record


def _add(totals: dict[str, int], name: str, nbytes: int) -> None:
    totals[name] = totals.get(name, 0) + nbytes


def _summary(records: list[dict[str, Any]], totals: Mapping[str, int], seconds: float) -> dict[str, Any]:
    last = records[-1]
    moved = totals["bytes_up"] + totals["bytes_down"]
    summary: dict[str, Any] = {
        "rounds": len(records),
        "final_test_accuracy": last["test_accuracy"],
        "best_test_accuracy": max(r["test_accuracy"] for r in records),
        # non-IID global accuracy swings round to round; the last rounds' mean compares runs fairly
        "mean_test_accuracy_last5": sum(r["test_accuracy"] for r in records[-5:]) / len(records[-5:]),
        "final_local_accuracy": last["local_accuracy"],
        "bytes_up": totals["bytes_up"],
        "bytes_down": totals["bytes_down"],
        "bytes_total": moved,
        "fedavg_equivalent_bytes": totals["fedavg_equivalent_bytes"],
        "bytes_ratio_vs_fedavg": moved / totals["fedavg_equivalent_bytes"]
        if totals["fedavg_equivalent_bytes"]
        else None,
        "wall_seconds": round(seconds, 3),
    }
    if "personalized_accuracy" in last:
        summary["final_personalized_accuracy"] = last["personalized_accuracy"]
    return summary


def write_results(results: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(results, indent=1, default=_json_default))


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"cannot serialize {type(value).__name__}")
