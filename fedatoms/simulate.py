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

from aggregator_service.config import FederationConfig
from aggregator_service.metrics import CATEGORIES, DIRECTIONS, BandwidthLedger, fedavg_transfer_bytes, total_dispersion
from aggregator_service.rounds import Federation, RoundOutcome
from aggregator_service.updates import ClientUpdate
from client_agent.pool import Population, VirtualClient
from client_agent.update import ClientEvaluation, TrainTask, evaluate_client, run_task
from fedatoms.records import TOTALS, accumulate, mean_or_none, summarize
from fedcore.codec import decode, encode
from fedcore.data import INPUT_SHAPES, NUM_CLASSES, ArrayDataset, load_dataset
from fedcore.keys import derive_seed
from fedcore.models import model_info
from fedcore.reference import is_zoo
from fedcore.spec import ModelSpec
from fedcore.training import evaluate

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
    # torch threads for every local training and for the server's aggregation, in both transports:
    # float sums depend on how work is split across threads, so runs match bit for bit only when this does
    threads: int = 1
    transport: str = "inprocess"
    output: str | None = None

    def __post_init__(self) -> None:
        if self.model is None:
            if self.dataset not in DEFAULT_MODELS:
                raise ValueError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(DEFAULT_MODELS)}")
            self.model = DEFAULT_MODELS[self.dataset]
        self.num_classes = NUM_CLASSES.get(self.dataset, self.num_classes)
        expected = INPUT_SHAPES.get(self.dataset)
        if expected is not None and not is_zoo(self.model) and self.input_shape is None:
            self.input_shape = list(expected)  # a reference model takes the dataset's images as they are
        shape = model_info(self.model).input_shape if is_zoo(self.model) else tuple(self.input_shape or ())
        if expected is not None and shape != expected:
            raise ValueError(f"model {self.model!r} takes inputs {shape}, but {self.dataset} images are {expected}")
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

    def population(self) -> Population:
        """The virtual clients, as a recipe any process can rebuild (both transports build them from it)."""
        return Population(
            self.dataset,
            self.data_dir,
            self.clients,
            tuple(self.tiers),
            self.partition,
            self.classes_per_client,
            self.dirichlet_alpha,
            self.seed,
        )


def build_federation(config: SimulationConfig) -> Federation:
    return config.build_federation(num_clients_total=config.clients)


ProgressFn = Callable[[dict[str, Any]], None]


TRANSPORTS = ("inprocess", "grpc")


def run_simulation(config: SimulationConfig, progress: ProgressFn | None = None, **grpc_options: Any) -> dict[str, Any]:
    """Run ``config.rounds`` rounds and return ``{"config", "rounds", "summary"}``.

    ``transport="grpc"`` goes through a real aggregator and real client agents
    (:func:`fedatoms.simulate_grpc.run_grpc_simulation`, which takes ``grpc_options``);
    both transports give the same record for the same seed.
    """
    if config.threads < 1:
        raise ValueError(f"threads must be ≥ 1, got {config.threads}")
    previous = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _run(config, progress, grpc_options)
    finally:
        torch.set_num_threads(previous)


def _run(config: SimulationConfig, progress: ProgressFn | None, grpc_options: dict[str, Any]) -> dict[str, Any]:
    if config.transport == "grpc":
        from fedatoms.simulate_grpc import run_grpc_simulation

        return run_grpc_simulation(config, progress, **grpc_options)
    if config.transport != "inprocess":
        raise ValueError(f"unknown transport {config.transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if grpc_options:
        raise ValueError(f"{', '.join(sorted(grpc_options))} only apply to --transport grpc")
    started = time.perf_counter()
    train, test = load_dataset(config.dataset, config.data_dir, download=config.download)
    federation = build_federation(config)
    clients = config.population().clients(train, test)
    by_id = {c.client_id: c for c in clients}
    train_config = config.train_config(device=config.device)
    fedavg_bytes = fedavg_transfer_bytes(config.spec)  # each transfer's FedAvg-equivalent
    records: list[dict[str, Any]] = []
    totals = dict.fromkeys(TOTALS, 0)
    for r in range(1, config.rounds + 1):
        t0 = time.perf_counter()
        plan = federation.plan(r, list(by_id))
        federation.begin(plan)
        # one round's: its record reads it, then it is dropped
        ledger = BandwidthLedger(fp16=config.fp16, fedavg_bytes=fedavg_bytes)
        control = federation.strategy.client_config()
        server_control = federation.strategy.server_control() if control.get("scaffold") else None
        for cid in plan.cohort:  # fixed fold order: sorted client ids
            vc = by_id[cid]
            moved = ledger.total(round_=r, client_id=cid, category="train_fetch")
            tier_spec, owner = _fetch(federation, vc, ledger, r, "train_fetch")
            task = TrainTask(
                round=r,
                due=federation.tier_due(vc.state.tier, plan.due),
                config=train_config,
                continue_unsynced=plan.continue_unsynced,
                seed=derive_seed(config.seed, r, cid),
                strategy=control,
                server_control=None
                if server_control is None
                else _send(server_control, ledger, r, cid, "train_fetch", owner),
                local=federation.local_tier_tensors(vc.state.tier),
            )
            if ledger.total(round_=r, client_id=cid, category="train_fetch") > moved:  # model and control: one fetch
                ledger.transfer(r, cid, "train_fetch")
            push = run_task(vc.state, tier_spec, task, vc.train, personal_atoms=config.personal_atoms)
            delta = push.control_delta
            federation.fold(
                ClientUpdate(
                    client_id=cid,
                    num_samples=push.num_samples,
                    tier=vc.state.tier,
                    spec=tier_spec,
                    tensors=_send(push.tensors, ledger, r, cid, "push", owner),
                    control_delta=None if delta is None else _send(delta, ledger, r, cid, "push", owner),
                    metrics=push.metrics,
                )
            )
            if ledger.total(round_=r, client_id=cid, category="push"):
                ledger.transfer(r, cid, "push")
        outcome = federation.close()
        # as an agent does once the round closed: fetch the new model (bytes count toward this round, as an
        # evaluation fetch), evaluate it; the next round trains on it without fetching again
        evaluations = []
        for cid in plan.cohort:
            vc = by_id[cid]
            tier_spec, _ = _fetch(federation, vc, ledger, r, "eval_fetch")
            if ledger.total(round_=r, client_id=cid, category="eval_fetch"):
                ledger.transfer(r, cid, "eval_fetch")
            evaluations.append(evaluate_client(vc.state, tier_spec, vc.test))
        record = _round_record(config, federation, outcome, test, evaluations, ledger)
        record["fedavg_equivalent_bytes"] = ledger.fedavg_equivalent(round_=r)
        record["wall_seconds"] = round(time.perf_counter() - t0, 4)
        accumulate(record, totals)
        records.append(record)
        if progress is not None:
            progress(record)
    summary = summarize(records, totals, time.perf_counter() - started)
    return {"config": config.to_dict(), "rounds": records, "summary": summary}


def _round_record(
    config: SimulationConfig,
    federation: Federation,
    outcome: RoundOutcome,
    test: ArrayDataset,
    evaluations: list[ClientEvaluation],
    ledger: BandwidthLedger,
) -> dict[str, Any]:
    full_model = federation.spec.build()
    full_model.load_state_dict(federation.global_tensors)
    server_eval = evaluate(full_model, test, device="cpu")
    local_acc = [e.global_accuracy for e in evaluations]
    personal_acc = [e.personalized_accuracy for e in evaluations if e.personalized_accuracy is not None]
    moved = ledger.per_tensor(outcome.round)
    idle = dict.fromkeys(DIRECTIONS, 0)
    tensors = {
        t.name: {
            "role": t.role,
            "interval": outcome.intervals[t.name],
            "due": t.name in outcome.due,
            "version": federation.versions[t.name],
            "d_l": outcome.discrepancy.get(t.name),
            "dispersion": outcome.result.dispersion.get(t.name),
            "bytes_down": moved.get(t.name, idle)["down"],
            "bytes_up": moved.get(t.name, idle)["up"],
        }
        for t in federation.spec.tensors
    }
    record: dict[str, Any] = {
        "round": outcome.round,
        "cohort_size": len(outcome.cohort),
        "reported": outcome.reported,
        "test_accuracy": server_eval.accuracy,
        "test_loss": server_eval.loss,
        "local_accuracy": mean_or_none(local_acc),
        "bytes_up": ledger.total(round_=outcome.round, direction="up"),
        "bytes_down": ledger.total(round_=outcome.round, direction="down"),
        **{f"bytes_{c}": ledger.total(round_=outcome.round, category=c) for c in CATEGORIES},
        # BN statistics (and step counters) would swamp the weights' dispersion: they are reported per tensor only
        "dispersion": total_dispersion(
            {n: v for n, v in outcome.result.dispersion.items() if federation.spec.tensor(n).role != "buffer"}
        ),
        "effective_dispersion": dict(outcome.result.effective_dispersion),
        "latent_clients": outcome.latent_clients,
        "tensors": tensors,
    }
    if config.personal_atoms:
        record["personalized_accuracy"] = mean_or_none(personal_acc)
    return record


def _fetch(
    federation: Federation, vc: VirtualClient, ledger: BandwidthLedger, round_: int, category: str
) -> tuple[ModelSpec, dict[str, str]]:
    """FetchModel, in process: the tensors newer than the client holds go through the codec into its state."""
    tier_spec = federation.tier_spec(vc.state.tier)
    owner = tier_spec.owners
    fetched = federation.fetch(vc.state.tier, vc.state.versions)
    received = _send({n: t for n, (t, _) in fetched.items()}, ledger, round_, vc.client_id, category, owner)
    vc.state.receive({n: (received[n], v) for n, (_, v) in fetched.items()})
    return tier_spec, owner


def _send(
    tensors: Mapping[str, torch.Tensor],
    ledger: BandwidthLedger,
    round_: int,
    client_id: str,
    category: str,
    owner: Mapping[str, str],
) -> dict[str, torch.Tensor]:
    """The in-process transport: every tensor goes through the wire codec, and its encoded bytes are
    counted toward the full-rank tensor it belongs to (a factor pair counts toward what it rebuilds)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        encoded = encode(tensor, fp16=ledger.fp16, name=name)
        dtype = str(tensor.dtype).removeprefix("torch.")
        out[name] = torch.from_numpy(
            decode(name, encoded.dtype, encoded.shape, encoded.data, expected_shape=encoded.shape, expected_dtype=dtype)
        )
        ledger.record(round_, client_id, category, owner.get(name, name), encoded.nbytes)
    return out


def write_results(results: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(results, indent=1, default=_json_default))


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"cannot serialize {type(value).__name__}")
