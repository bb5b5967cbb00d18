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
from aggregator_service.server_evaluation import evaluate_round
from aggregator_service.updates import ClientUpdate
from client_agent.pool import Population
from client_agent.update import ClientEvaluation
from fedatoms.engines import ENGINES
from fedatoms.engines.local import LocalClients, account
from fedatoms.records import TOTALS, accumulate, mean_or_none, summarize
from fedcore.data import INPUT_SHAPES, NUM_CLASSES, check_labels, num_classes_of
from fedcore.datasource import describe, open_data
from fedcore.model_file import write_model_file
from fedcore.model_input import Normalization, fit_to_model
from fedcore.models import model_info
from fedcore.reference import is_zoo
from fedcore.training import Dataset, resolve_device

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
    # unset: model_args' num_classes, else the data's (a folder per class, else the largest training label + 1),
    # else the benchmark's; set, it is kept (a head wider than the labels seen) and the data is checked against it
    num_classes: int | None = None  # type: ignore[assignment]
    dataset: str = "digits"
    # an ImageFolder directory or an import reference module:function (a bundled name sets dataset instead);
    # images are fitted to the model's input
    data: str | None = None
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
    # where the virtual clients run (docs/simulation.md, "On a Ray cluster"); a TOML's [simulation] table
    # may hold these keys, and [simulation.resources] the Ray resources of one client per tier
    engine: str = "local"
    ray_address: str | None = None  # join this cluster; none: start a local Ray and stop it at the end
    ray_num_cpus: int | None = None  # CPUs of the local Ray [all of this machine's]
    resources: dict[str, Any] | None = None
    actor_failure: str = "retry"  # a dead actor's clients: "retry" their round on its replacement, or "dropout"

    def __post_init__(self) -> None:
        if self.data is not None and describe(self.data) == "bundled":
            self.dataset, self.data = self.data.lower(), None
        declared = self.model_args.get("num_classes") if isinstance(self.model_args, dict) else None
        if self.num_classes is None and isinstance(declared, int) and not isinstance(declared, bool):
            self.num_classes = declared  # the model's head says how many classes it scores
        if self.data is not None:
            if self.model is None:
                raise ValueError(f"--data {self.data} needs --model: the model that takes these images")
            self.num_classes = _data_classes(self.data, self.num_classes)
        else:
            if self.model is None:
                if self.dataset not in DEFAULT_MODELS:
                    raise ValueError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(DEFAULT_MODELS)}")
                self.model = DEFAULT_MODELS[self.dataset]
            self.num_classes = _benchmark_classes(self.dataset, self.num_classes)
            expected = INPUT_SHAPES.get(self.dataset)
            if expected is not None and not is_zoo(self.model) and self.input_shape is None:
                self.input_shape = list(expected)  # a reference model takes the dataset's images as they are
            shape = model_info(self.model).input_shape if is_zoo(self.model) else tuple(self.input_shape or ())
            if expected is not None and shape != expected:
                raise ValueError(f"model {self.model!r} takes inputs {shape}, but {self.dataset} images are {expected}")
            self.record_benchmark_normalization(self.dataset)
        if self.clients < 1:
            raise ValueError("clients must be ≥ 1")
        for key, kinds, wanted in (
            ("engine", str, "a string"),
            ("ray_address", (str, type(None)), "a string (HEAD:6379 or auto)"),
            ("ray_num_cpus", (int, type(None)), "a whole number"),
            ("resources", (Mapping, type(None)), "a table ([simulation.resources])"),
            ("actor_failure", str, "a string"),
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, kinds):  # TOML's true is no number of CPUs
                raise ValueError(f"{key} must be {wanted}, got {value!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINES)}")
        if self.engine != "ray" and (self.ray_address or self.ray_num_cpus or self.resources):
            raise ValueError("ray_address, ray_num_cpus and [simulation.resources] need engine = 'ray'")
        if self.actor_failure not in ("retry", "dropout"):
            raise ValueError(f"actor_failure must be 'retry' or 'dropout', got {self.actor_failure!r}")
        if self.ray_num_cpus is not None and self.ray_num_cpus < 1:
            raise ValueError(f"ray_num_cpus must be ≥ 1, got {self.ray_num_cpus}")
        if self.ray_num_cpus is not None and self.ray_address:
            raise ValueError(
                f"ray_num_cpus sizes the local Ray, and ray_address {self.ray_address} joins a cluster whose nodes "
                "give their own CPUs (Ray ignores num_cpus when joining): give one of them"
            )
        if self.engine == "ray":
            from client_agent.ray_placement import parse_resources

            parse_resources(self.resources, self.tiers)  # refused here, before anything starts
        super().__post_init__()

    @classmethod
    def from_toml(cls, path: str | Path, overrides: Mapping[str, Any] | None = None) -> SimulationConfig:
        data = tomllib.loads(Path(path).read_text())
        table = data.pop("simulation", {})  # [simulation] engine = "ray", [simulation.resources] "1/8" = {...}
        if not isinstance(table, dict):
            raise ValueError(f"{path}: simulation must be a table ([simulation])")
        data.update(table)
        data = {k.replace("-", "_"): v for k, v in data.items()}
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown keys {', '.join(sorted(unknown))}")
        data.update(overrides or {})
        return cls(**data)

    def check_device(self) -> None:
        """``--device`` refused before anything starts: an unknown name always; a CUDA one without CUDA on this
        machine unless a Ray cluster (``--ray-address``) runs the clients, whose actors resolve it on their nodes."""
        if self.engine == "ray" and self.ray_address:
            try:
                torch.device(self.device if self.device != "auto" else "cpu")
            except RuntimeError:
                resolve_device(self.device)  # its one line for an unknown device
            return
        resolve_device(self.device)

    def population(self) -> Population:
        """The virtual clients, as a recipe any process can rebuild (both transports build them from it)."""
        return Population(
            self.data or self.dataset,
            self.data_dir,
            self.clients,
            tuple(self.tiers),
            self.partition,
            self.classes_per_client,
            self.dirichlet_alpha,
            self.seed,
            input_shape=None if self.data is None else self.spec.input_shape,
            input_dtype=self.spec.input_dtype,
            normalization=self.normalization,
        )


def _data_classes(data: str, num_classes: int | None) -> int:
    """``--data``'s classes: ``num_classes`` when set, refused in one line if a training label cannot be one of
    them; unset, the data's own count (its class folders, else its largest training label + 1)."""
    train = open_data(data)[0]
    found = num_classes_of(train)
    if num_classes is None:
        return found
    if found > num_classes:
        raise ValueError(
            f"--data {data} has the training label {found - 1} but num_classes = {num_classes}: labels are class "
            f"indices 0..{num_classes - 1}; set num_classes to at least {found} (--num-classes, num_classes in the "
            "TOML, and the model's own in model_args), or leave both unset to take the data's"
        )
    check_labels(train, num_classes)  # negative labels; an ImageFolder's named folders
    return num_classes


def _benchmark_classes(dataset: str, num_classes: int | None) -> int:
    """A benchmark's classes, or ``num_classes`` when set to a head at least that wide."""
    known = NUM_CLASSES.get(dataset)
    if num_classes is None:
        return known if known is not None else 10
    if known is not None and num_classes < known:
        raise ValueError(
            f"{dataset} has {known} classes but num_classes = {num_classes}: set num_classes to at least {known} "
            "(--num-classes, num_classes in the TOML, and the model's own in model_args), or leave both unset"
        )
    return num_classes


def build_federation(config: SimulationConfig) -> Federation:
    return config.build_federation(num_clients_total=config.clients)


ProgressFn = Callable[[dict[str, Any]], None]


TRANSPORTS = ("inprocess", "grpc")


def run_simulation(
    config: SimulationConfig,
    progress: ProgressFn | None = None,
    model_out: str | Path | None = None,
    *,
    on_start: Callable[[], None] | None = None,
    **grpc_options: Any,
) -> dict[str, Any]:
    """Run ``config.rounds`` rounds and return ``{"config", "rounds", "summary"}``; with ``model_out``, the final
    global model is written there as a model file (what ``fedatoms aggregator export`` writes).

    ``transport="grpc"`` goes through a real aggregator and real client agents
    (:func:`fedatoms.simulate_grpc.run_grpc_simulation`, which takes ``grpc_options``);
    both transports give the same record for the same seed. ``engine="ray"`` runs the virtual
    clients as Ray actors (:mod:`fedatoms.engines.ray_engine`), with the same record again.

    ``on_start`` is called once the data, model and clients are ready, as the first round begins: a
    progress display started there is never left behind by an error found while setting up.
    """
    if config.threads < 1:
        raise ValueError(f"threads must be ≥ 1, got {config.threads}")
    _check_destinations(config, model_out)
    config.check_device()  # before a Ray starts
    previous = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        if config.engine == "ray":
            from client_agent.ray_pool import ray_session

            with ray_session(config.ray_address, config.ray_num_cpus):
                return _run(config, progress, model_out, on_start, grpc_options)
        return _run(config, progress, model_out, on_start, grpc_options)
    finally:
        torch.set_num_threads(previous)


def _check_destinations(config: SimulationConfig, model_out: str | Path | None) -> None:
    """Where the results and the model go, checked before the rounds run rather than after."""
    if model_out is not None and Path(model_out).is_dir():
        raise ValueError(
            f"--save-model {model_out} is a directory: give the model file's path, e.g. "
            f"{Path(model_out) / 'model.safetensors'}"
        )
    if config.output is not None:
        output = Path(config.output)
        if output.is_dir():
            raise ValueError(
                f"--output {output} is a directory: give the results file's path, e.g. {output / 'results.json'}"
            )
        if not output.parent.is_dir():
            raise ValueError(f"--output {output}: there is no directory {output.parent}")


def _run(
    config: SimulationConfig,
    progress: ProgressFn | None,
    model_out: str | Path | None,
    on_start: Callable[[], None] | None,
    grpc_options: dict[str, Any],
) -> dict[str, Any]:
    if config.transport == "grpc":
        from fedatoms.simulate_grpc import run_grpc_simulation

        return run_grpc_simulation(config, progress, model_out=model_out, on_start=on_start, **grpc_options)
    if config.transport != "inprocess":
        raise ValueError(f"unknown transport {config.transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if grpc_options:
        flags = sorted("--" + k.replace("_", "-") for k in grpc_options)
        raise ValueError(f"{', '.join(flags)} {'applies' if len(flags) == 1 else 'apply'} only to --transport grpc")
    started = time.perf_counter()
    train, test = open_data(config.data or config.dataset, config.data_dir, download=config.download)
    if test is None or len(test) == 0:
        raise ValueError(f"--data {config.data}: a simulation evaluates on a test split, and this data has none")
    federation = build_federation(config)
    pool = _client_engine(config, train, test)
    if config.population().input_shape is not None:  # the server's test split, normalized as eval_data is
        given = None if config.normalization is None else Normalization.from_dict(config.normalization)
        test, _, _ = fit_to_model(test, None, config.population().input_shape, given, input_dtype=config.input_dtype)
    train_config = config.train_config(device=config.device)
    fedavg_bytes = fedavg_transfer_bytes(config.spec)  # each transfer's FedAvg-equivalent
    records: list[dict[str, Any]] = []
    totals = dict.fromkeys(TOTALS, 0)
    try:
        if on_start is not None:
            on_start()
        for r in range(1, config.rounds + 1):
            t0 = time.perf_counter()
            plan = federation.plan(r, pool.client_ids)
            federation.begin(plan)
            # one round's: its record reads it, then it is dropped
            ledger = BandwidthLedger(fp16=config.fp16, fedavg_bytes=fedavg_bytes)
            for done in pool.train(federation, plan, train_config):  # in cohort order: sorted client ids
                cid, push = done.client_id, done.push
                account(ledger, r, cid, "train_fetch", done.fetched, done.fetched_model)  # model and control
                federation.fold(
                    ClientUpdate(
                        client_id=cid,
                        num_samples=push.num_samples,
                        tier=done.tier,
                        spec=federation.tier_spec(done.tier),
                        tensors=push.tensors,
                        control_delta=push.control_delta,
                        metrics=push.metrics,
                    )
                )
                account(ledger, r, cid, "push", done.pushed)
            outcome = federation.close()
            # as an agent does once the round closed: fetch the new model (bytes count toward this round, as an
            # evaluation fetch), evaluate it; the next round trains on it without fetching again
            evaluations = []
            for cid, moved, evaluation in pool.evaluate(federation, plan.cohort):
                account(ledger, r, cid, "eval_fetch", moved)
                evaluations.append(evaluation)
            record = _round_record(config, federation, outcome, test, evaluations, ledger)
            record["fedavg_equivalent_bytes"] = ledger.fedavg_equivalent(round_=r)
            record["wall_seconds"] = round(time.perf_counter() - t0, 4)
            faults = pool.faults.pop(r, None)
            if faults:  # an actor died this round (Ray engine): which clients were retried, which dropped out
                record["faults"] = faults
            accumulate(record, totals)
            records.append(record)
            if progress is not None:
                progress(record)
    finally:
        pool.close()
    if model_out is not None:
        metadata = {"federation": "simulation", "round": str(config.rounds), "normalization": config.normalization}
        write_model_file(model_out, config.spec, dict(federation.global_tensors), metadata)
    summary = summarize(records, totals, time.perf_counter() - started)
    return {"config": config.to_dict(), "rounds": records, "summary": summary}


def _client_engine(config: SimulationConfig, train: Dataset, test: Dataset) -> Any:
    """Where the virtual clients train: this process (``local``), or Ray actors (``ray``)."""
    if config.engine == "ray":
        from fedatoms.engines.ray_engine import RayClients

        config.population().clients(train, test)  # a split the data cannot make fails here, not on an actor
        return RayClients(config)
    population = config.population()
    clients = population.fitted(population.clients(train, test))
    return LocalClients(clients, config.seed, config.fp16, config.personal_atoms, config.device)


def _round_record(
    config: SimulationConfig,
    federation: Federation,
    outcome: RoundOutcome,
    test: Dataset,
    evaluations: list[ClientEvaluation],
    ledger: BandwidthLedger,
) -> dict[str, Any]:
    server_eval = evaluate_round(federation, test)
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
    if server_eval.tier_accuracy:
        record["tier_accuracy"] = server_eval.tier_accuracy
    if config.personalized:
        record["personalized_accuracy"] = mean_or_none(personal_acc)
    return record


def write_results(results: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(results, indent=1, default=_json_default))


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"cannot serialize {type(value).__name__}")
