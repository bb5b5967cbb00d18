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
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from aggregator_service.aggregation import ClientUpdate
from aggregator_service.config import FederationConfig
from aggregator_service.metrics import fedavg_equivalent_bytes, total_dispersion
from aggregator_service.rounds import Federation, RoundOutcome, derive_seed
from client_agent.pool import VirtualClient, make_virtual_clients
from client_agent.update import TrainTask, run_task
from fedcore.codec import decode, encode
from fedcore.data import INPUT_SHAPES, NUM_CLASSES, ArrayDataset, load_dataset
from fedcore.models import model_info
from fedcore.training import evaluate, personalized_model

__all__ = ["DEFAULT_MODELS", "SimulationConfig", "run_simulation"]

DEFAULT_MODELS = {
    "digits": "digits-cnn",
    "mnist": "mnist-cnn",
    "fashion-mnist": "mnist-cnn",
    "cifar10": "lenet-cifar10",
    "cifar100": "lenet-cifar100",
}


@dataclass
class SimulationConfig(FederationConfig):
    """A federation plus its simulated population; the same keys work as CLI flags and in a TOML file."""

    model: str | None = None  # type: ignore[assignment]  # default: DEFAULT_MODELS[dataset]
    dataset: str = "digits"
    data_dir: str | None = None
    download: bool = False
    clients: int = 20
    partition: str = "shards"
    classes_per_client: int = 2
    dirichlet_alpha: float = 0.5
    device: str = "auto"
    transport: str = "inprocess"
    output: str | None = None

    def __post_init__(self) -> None:
        if self.model is None:
            if self.dataset not in DEFAULT_MODELS:
                raise ValueError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(DEFAULT_MODELS)}")
            self.model = DEFAULT_MODELS[self.dataset]
        self.num_classes = NUM_CLASSES.get(self.dataset, self.num_classes)
        expected = INPUT_SHAPES.get(self.dataset)
        if expected is not None and model_info(self.model).input_shape != expected:
            raise ValueError(
                f"model {self.model!r} takes inputs {model_info(self.model).input_shape}, "
                f"but {self.dataset} images are {expected}"
            )
        if self.clients < 1:
            raise ValueError("clients must be ≥ 1")
        super().__post_init__()

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


def build_federation(config: SimulationConfig) -> Federation:
    return config.build_federation(num_clients_total=config.clients)


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
    train_config = config.train_config(device=config.device)
    fedavg_bytes_per_client = fedavg_equivalent_bytes(config.spec, 1)
    records: list[dict[str, Any]] = []
    totals = {"bytes_up": 0, "bytes_down": 0, "fedavg_equivalent_bytes": 0}
    for r in range(1, config.rounds + 1):
        t0 = time.perf_counter()
        plan = federation.plan(r, list(by_id))
        federation.begin(plan)
        down: dict[str, int] = {}
        up: dict[str, int] = {}
        control = federation.strategy.client_config()
        server_control = federation.strategy.server_control() if control.get("scaffold") else None
        for cid in plan.cohort:  # fixed fold order: sorted client ids
            vc = by_id[cid]
            tier_spec = federation.tier_spec(vc.state.tier)
            owner = {t.name: t.full_name or t.name for t in tier_spec.tensors}
            fetched = federation.fetch(vc.state.tier, vc.state.versions)
            received = _send({n: t for n, (t, _) in fetched.items()}, config.fp16, down, owner)
            vc.state.receive({n: (received[n], v) for n, (_, v) in fetched.items()})
            task = TrainTask(
                round=r,
                due=federation.tier_due(vc.state.tier, plan.due),
                config=train_config,
                continue_unsynced=plan.continue_unsynced,
                seed=derive_seed(config.seed, r, cid),
                strategy=control,
                server_control=None if server_control is None else _send(server_control, config.fp16, down, owner),
                local=federation.local_tier_tensors(vc.state.tier),
            )
            push = run_task(vc.state, tier_spec, task, vc.train, personal_atoms=config.personal_atoms)
            delta = push.control_delta
            federation.fold(
                ClientUpdate(
                    client_id=cid,
                    num_samples=push.num_samples,
                    tier=vc.state.tier,
                    spec=tier_spec,
                    tensors=_send(push.tensors, config.fp16, up, owner),
                    control_delta=None if delta is None else _send(delta, config.fp16, up, owner),
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
    models: dict[float, torch.nn.Module] = {}
    for vc in cohort:
        tier_model = models.get(vc.state.tier) or models.setdefault(
            vc.state.tier, federation.tier_spec(vc.state.tier).build()
        )
        tier_model.load_state_dict({**federation.tier_tensors(vc.state.tier), **vc.state.local})
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
        # BN statistics (and step counters) would swamp the weights' dispersion: they are reported per tensor only
        "dispersion": total_dispersion(
            {n: v for n, v in outcome.result.dispersion.items() if federation.spec.tensor(n).role != "buffer"}
        ),
        "effective_dispersion": dict(outcome.result.effective_dispersion),
        "latent_clients": outcome.latent_clients,
        "tensors": tensors,
    }
    if config.personal_atoms:
        record["personalized_accuracy"] = sum(personal_acc) / len(personal_acc) if personal_acc else None
    return record


def _send(
    tensors: Mapping[str, torch.Tensor], fp16: bool, ledger: dict[str, int], owner: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    """The in-process transport: every tensor goes through the wire codec, and its encoded bytes are
    counted toward the full-rank tensor it belongs to (a factor pair counts toward what it rebuilds)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        encoded = encode(tensor, fp16=fp16, name=name)
        dtype = str(tensor.dtype).removeprefix("torch.")
        out[name] = torch.from_numpy(
            decode(name, encoded.dtype, encoded.shape, encoded.data, expected_shape=encoded.shape, expected_dtype=dtype)
        )
        full = owner.get(name, name)
        ledger[full] = ledger.get(full, 0) + encoded.nbytes
    return out


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
