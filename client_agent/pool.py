"""Many virtual clients on one machine, for simulation.

Each virtual client has its own :class:`ClientState`, data shard and local test split and
runs exactly the client code of a real agent (:func:`client_agent.update.run_task`). The
in-process transport calls it directly; :func:`run_grpc_pool` gives every virtual client a
real :class:`client_agent.agent.Agent` (own channel, own state directory) and spreads them
over worker processes.

A worker is a plain function of picklable arguments (:func:`run_worker` on a
:class:`WorkerJob`), so the same jobs can later be handed to Ray tasks instead of a process
pool. Inside a worker, every agent has a thread (network waits overlap; training and
evaluation take turns on one lock, one torch thread per process); each agent seeds its
training by (seed, round, client) from the server's task and the server folds updates in
registration order, so results do not depend on which worker ran which client, or when.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from client_agent.allowed_models import DEFAULT_ALLOWED_MODELS
from client_agent.state import ClientState
from client_agent.update import ClientEvaluation, ClientPush, TrainTask, evaluate_client, run_task
from fedcore.codec import decode, encode
from fedcore.data import labels_of, local_test_splits, partition, take
from fedcore.datasource import open_data
from fedcore.keys import client_key
from fedcore.model_input import Normalization, fit_to_model
from fedcore.spec import ModelSpec
from fedcore.tiers import CapabilityProfile
from fedcore.training import Dataset

__all__ = [
    "InProcessPush",
    "Moved",
    "Population",
    "VirtualClient",
    "WorkerJob",
    "evaluate_in_process",
    "make_virtual_clients",
    "register_all",
    "run_grpc_pool",
    "through_codec",
    "train_in_process",
]

#: bytes that travelled, as ``(full-rank tensor they count toward, encoded bytes)``, in sending order
Moved = list[tuple[str, int]]

log = logging.getLogger("fedatoms.pool")


@dataclass
class VirtualClient:
    state: ClientState
    train: Dataset
    test: Dataset | None

    @property
    def client_id(self) -> str:
        return self.state.client_id


def make_virtual_clients(
    train: Dataset,
    test: Dataset | None,
    num_clients: int,
    tiers: Sequence[float],
    *,
    scheme: str,
    classes_per_client: int,
    dirichlet_alpha: float,
    seed: int,
) -> list[VirtualClient]:
    """Partition the data and give client ``i`` the tier ``tiers[i % len(tiers)]`` (round-robin)."""
    labels = labels_of(train)
    parts = partition(
        labels,
        num_clients,
        scheme,
        classes_per_client=classes_per_client,
        alpha=dirichlet_alpha,
        seed=seed,
    )
    tests = local_test_splits(labels, labels_of(test), parts, seed=seed) if test is not None else [None] * len(parts)
    return [
        VirtualClient(
            ClientState(client_id=client_key(i), tier=float(tiers[i % len(tiers)])),
            take(train, np.asarray(idx)),
            None if test is None or tidx is None else take(test, np.asarray(tidx)),
        )
        for i, (idx, tidx) in enumerate(zip(parts, tests, strict=True))
    ]


@dataclass(frozen=True)
class Population:
    """How to rebuild the virtual clients anywhere: the data (``--data``), the partition, and for images the
    model's input shape and the federation's normalization (unset: each client's own), all picklable."""

    dataset: str
    data_dir: str | None
    num_clients: int
    tiers: tuple[float, ...]
    partition: str
    classes_per_client: int
    dirichlet_alpha: float
    seed: int
    input_shape: tuple[int, ...] | None = None  # None: the data stay as loaded (an agent fits them after Register)
    normalization: dict[str, list[float]] | None = None
    input_dtype: str = "float32"  # the model's (ModelSpec.input_dtype): integer token ids are never normalized

    def build(self, fit: Sequence[int] | None = None) -> list[VirtualClient]:
        """Every virtual client; the data of those in ``fit`` (default all) made the model's input."""
        return self.fitted(self.clients(*open_data(self.dataset, self.data_dir)), fit)

    def fitted(self, clients: list[VirtualClient], only: Sequence[int] | None = None) -> list[VirtualClient]:
        """Images of ``clients`` (those at ``only``, default all) made the model's input, each normalized by
        the federation's normalization or its own data's; tensors stay as they are."""
        if self.input_shape is not None:
            given = None if self.normalization is None else Normalization.from_dict(self.normalization)
            for i in range(len(clients)) if only is None else only:
                vc = clients[i]
                vc.train, vc.test, _ = fit_to_model(
                    vc.train, vc.test, self.input_shape, given, input_dtype=self.input_dtype
                )
        return clients

    def clients(self, train: Dataset, test: Dataset | None) -> list[VirtualClient]:
        return make_virtual_clients(
            train,
            test,
            self.num_clients,
            self.tiers,
            scheme=self.partition,
            classes_per_client=self.classes_per_client,
            dirichlet_alpha=self.dirichlet_alpha,
            seed=self.seed,
        )


def through_codec(
    tensors: Mapping[str, Tensor], fp16: bool, owner: Mapping[str, str]
) -> tuple[dict[str, Tensor], Moved]:
    """The in-process wire: every tensor goes through the wire codec; its encoded bytes count toward the
    full-rank tensor it belongs to (a factor pair counts toward what it rebuilds)."""
    out: dict[str, Tensor] = {}
    moved: Moved = []
    for name, tensor in tensors.items():
        encoded = encode(tensor, fp16=fp16, name=name)
        dtype = str(tensor.dtype).removeprefix("torch.")
        out[name] = torch.from_numpy(
            decode(name, encoded.dtype, encoded.shape, encoded.data, expected_shape=encoded.shape, expected_dtype=dtype)
        )
        moved.append((owner.get(name, name), encoded.nbytes))
    return out, moved


@dataclass(frozen=True)
class InProcessPush:
    """One virtual client's round without a network: its push (through the codec) and the bytes both ways."""

    client_id: str
    tier: float
    push: ClientPush
    fetched: Moved  # the training fetch: the model's newer tensors, then SCAFFOLD's server control
    pushed: Moved
    #: the fetch moved some of the model: a transfer FedAvg makes too (SCAFFOLD's control alone is none)
    fetched_model: bool = True


def _receive(vc: VirtualClient, spec: ModelSpec, fetched: Mapping[str, tuple[Tensor, int]], fp16: bool) -> Moved:
    received, moved = through_codec({n: t for n, (t, _) in fetched.items()}, fp16, spec.owners)
    vc.state.receive({n: (received[n], v) for n, (_, v) in fetched.items()})
    return moved


def train_in_process(
    vc: VirtualClient,
    spec: ModelSpec,
    task: TrainTask,
    fetched: Mapping[str, tuple[Tensor, int]],
    *,
    fp16: bool,
    personal_atoms: bool,
) -> InProcessPush:
    """Receive ``fetched`` (the tensors newer than the client holds), train for ``task``, push: the client's
    half of an in-process round, wherever the client lives (this process or a Ray actor)."""
    down = _receive(vc, spec, fetched, fp16)
    fetched_model = any(n for _, n in down)
    if task.server_control is not None:
        control, more = through_codec(task.server_control, fp16, spec.owners)
        down += more
        task = replace(task, server_control=control)
    push = run_task(vc.state, spec, task, vc.train, personal_atoms=personal_atoms)
    tensors, up = through_codec(push.tensors, fp16, spec.owners)
    delta = None
    if push.control_delta is not None:
        delta, more = through_codec(push.control_delta, fp16, spec.owners)
        up += more
    return InProcessPush(
        vc.client_id, vc.state.tier, replace(push, tensors=tensors, control_delta=delta), down, up, fetched_model
    )


def evaluate_in_process(
    vc: VirtualClient, spec: ModelSpec, fetched: Mapping[str, tuple[Tensor, int]], *, fp16: bool, device: str
) -> tuple[Moved, ClientEvaluation]:
    """As an agent does once a round closed: receive the newer tensors, evaluate on the local test split, on
    ``device`` (the simulation's ``--device``, where the clients train: a replaced Ray actor's clients have not)."""
    down = _receive(vc, spec, fetched, fp16)
    return down, evaluate_client(vc.state, spec, vc.test, vc.train, device=device)


@dataclass(frozen=True)
class WorkerJob:
    """The virtual clients one worker runs against one aggregator."""

    target: str
    population: Population
    indices: tuple[int, ...]
    state_root: str
    tls_ca: str | None = None
    torch_threads: int = 1
    eval_poll_seconds: float = 0.02  # how often one watcher per process asks whether a round closed
    keep_state: bool = True  # False: the state root is a temporary directory, never resumed from
    # model code the agents may import: the simulation's own model, which its user named (allowed_models.py)
    allowed_models: tuple[str, ...] = DEFAULT_ALLOWED_MODELS
    # the torch device the agents train and evaluate on (``--device``: auto, cpu, cuda[:N]); None: what the task names
    device: str | None = None


def state_dir(root: str | Path, index: int) -> Path:
    return Path(root) / client_key(index)


def register_all(
    target: str,
    population: Population,
    clients: Sequence[VirtualClient],
    enrollment_secret: str,
    state_root: str | Path,
    tls_ca: str | None = None,
    keep_state: bool = True,
    allowed_models: Sequence[str] = DEFAULT_ALLOWED_MODELS,
    give_up_after: float | None = None,
) -> list[str]:
    """Register the virtual clients one by one, in index order, so their registration order is their index.

    Each declares its shard size and its tier as ``preferred_tier``; credentials land in its state dir.
    Clients that registered in an earlier run (credentials on disk) keep their identity. An aggregator
    unreachable for ``give_up_after`` seconds (``None``: retried for ever) is a ``ValueError`` naming it.
    """
    import grpc

    from client_agent.agent import CREDENTIALS_FILE, Agent
    from client_agent.transport import AggregatorClient, Backoff, Unauthenticated

    ids = []
    client = AggregatorClient(
        target, tls_ca=Path(tls_ca) if tls_ca else None, backoff=Backoff(max_elapsed=give_up_after)
    )
    try:
        for i, vc in enumerate(clients):
            resumed = (state_dir(state_root, i) / CREDENTIALS_FILE).exists()
            profile = CapabilityProfile(
                device_name=f"virtual-{population.dataset}", num_samples=len(vc.train), preferred_tier=vc.state.tier
            )
            agent = Agent(
                client,
                state_dir(state_root, i),
                vc.train,
                profile=profile,
                enrollment_secret=enrollment_secret,
                name=client_key(i),
                keep_state=keep_state,
                allowed_models=tuple(allowed_models),
            )
            ids.append(agent.ensure_registered().client_id)
            if resumed:  # credentials from an earlier run: the aggregator must still know them
                try:
                    client.heartbeat()
                except Unauthenticated:
                    raise ValueError(
                        f"{state_dir(state_root, i)}: the aggregator at {target} does not know this client (its "
                        "state is from another federation or database): give a new --state-dir, or the "
                        "--database-url it was made with"
                    ) from None
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]  # a call's error has a code
            raise
        waited = "" if give_up_after is None else f" for {give_up_after:g} s"
        raise ValueError(f"cannot reach the aggregator at {target}{waited}: {exc.details()}") from None  # type: ignore[attr-defined]  # as above
    finally:
        client.close()
    return ids


def run_worker(job: WorkerJob) -> dict[str, int]:
    """Run the job's agents until the federation is done; returns ``{client key: rounds trained}``."""
    import torch

    from client_agent.agent import Agent
    from client_agent.pacing import ComputeSlot, RoundWatch
    from client_agent.transport import AggregatorClient
    from fedcore.training import resolve_device
    from fedwire.allocator import reuse_message_buffers

    if job.device is not None:  # where the agents run (a Ray node need not be the driver's): before any training
        resolve_device(job.device)
    reuse_message_buffers()
    torch.set_num_threads(job.torch_threads)
    clients = job.population.build(fit=job.indices)
    compute = ComputeSlot()  # one training (or evaluation) at a time per process; network waits overlap
    channel = AggregatorClient(job.target, tls_ca=Path(job.tls_ca) if job.tls_ca else None)
    agents: dict[int, Agent] = {}
    watch = RoundWatch(AggregatorClient.sharing(channel), interval=job.eval_poll_seconds)
    for i in job.indices:
        vc = clients[i]
        agent = Agent(
            AggregatorClient.sharing(channel),
            state_dir(job.state_root, i),
            vc.train,
            vc.test,
            eval_poll_seconds=job.eval_poll_seconds,
            compute_lock=compute,
            durable=False,
            keep_state=job.keep_state,
            round_watch=watch,
            defer_evaluation=True,
            allowed_models=job.allowed_models,
            device=job.device,
            refusal_ends_run=True,
        )
        agent.ensure_registered()
        agents[i] = agent
    watch.client.token = next(iter(agents.values())).client.token  # any enrolled identity may watch
    watch.start()
    errors: list[BaseException] = []
    stop = threading.Event()

    def drive(agent: Agent) -> None:
        agent.stop = stop
        try:
            while not stop.is_set():
                delay = agent.step()
                if delay is None:
                    return
                stop.wait(delay)
        except BaseException as exc:  # surfaced to the parent below
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=drive, args=(a,), name=f"agent-{i}", daemon=True) for i, a in agents.items()]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        watch.stop()
        channel.close()
    if errors:
        raise errors[0]
    return {client_key(i): a.state.rounds_joined for i, a in agents.items() if a.state is not None}


def run_grpc_pool(
    target: str,
    population: Population,
    state_root: str | Path,
    *,
    workers: int = 2,
    tls_ca: str | None = None,
    poll: Callable[[], None] | None = None,
    eval_poll_seconds: float = 0.02,
    torch_threads: int = 1,
    keep_state: bool = True,
    allowed_models: Sequence[str] = DEFAULT_ALLOWED_MODELS,
    device: str | None = None,
) -> dict[str, int]:
    """Run every virtual client through ``workers`` processes until the federation is done.

    The clients must be registered already (:func:`register_all`). ``poll`` is called about
    twice a second while the workers run (progress reporting). ``keep_state=False``: the agents
    write no state (``state_root`` is a temporary directory nobody can resume from). ``device``:
    the torch device every agent trains and evaluates on (None: what the server's task names).
    """
    n = population.num_clients
    workers = max(1, min(workers, n))
    jobs = [
        WorkerJob(
            target,
            population,
            tuple(range(w, n, workers)),
            str(state_root),
            tls_ca,
            torch_threads,
            eval_poll_seconds,
            keep_state,
            tuple(allowed_models),
            device,
        )
        for w in range(workers)
    ]
    results: dict[str, int] = {}
    # spawn: no forked gRPC or torch state; a worker that dies (OOM, kill) fails the run (BrokenProcessPool)
    # instead of leaving it waiting for a result that never comes
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        pending = {pool.submit(run_worker, job) for job in jobs}
        try:
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for future in done:
                    results.update(future.result())  # re-raises a worker's exception here
                if poll is not None:
                    poll()
        except BaseException:
            # the other workers' agents would wait for rounds that cannot close without the failed ones
            for process in list(pool._processes.values()):
                process.terminate()
            raise
    return results
