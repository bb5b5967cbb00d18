"""Virtual clients as Ray actors: the Ray engine's client pools, on one machine or a cluster.

An actor (:class:`ClientHost`) is one client-sized slot of :mod:`client_agent.ray_placement`:
it holds a fixed set of virtual clients of one tier — their data shards and their state — and
either trains and evaluates them on request (the in-process transport: the driver aggregates)
or runs them as real :class:`client_agent.agent.Agent` s speaking gRPC to an aggregator
(:func:`run_ray_grpc_pool`, the same :func:`client_agent.pool.run_worker` a local worker
process runs).

A local Ray (no address) is started with the dashboard off and stopped at the end
(:func:`ray_session`); with an address the run joins that cluster and leaves it running.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from client_agent.allowed_models import DEFAULT_ALLOWED_MODELS
from client_agent.pool import (
    InProcessPush,
    Moved,
    Population,
    VirtualClient,
    WorkerJob,
    evaluate_in_process,
    run_worker,
    state_dir,
    train_in_process,
)
from client_agent.ray_placement import Slot, parse_resources, place
from client_agent.update import ClientEvaluation, TrainTask
from fedcore.keys import client_key
from fedcore.spec import ModelSpec

__all__ = [
    "MAX_REPLACEMENTS",
    "ActorLost",
    "ClientHost",
    "ClientHosts",
    "SlotFailed",
    "as_tensors",
    "ray_session",
    "run_ray_grpc_pool",
]

log = logging.getLogger("fedatoms.ray")

#: a slot whose actor died more often than it was replaced this many times fails the run: its clients kill it
MAX_REPLACEMENTS = 3


class SlotFailed(RuntimeError):
    """A slot's actor died more than :data:`MAX_REPLACEMENTS` times: the run ends (a setting or a client that
    kills its process every time would otherwise give a run of rounds without its clients)."""


@contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None) -> Iterator[None]:
    """Join the Ray cluster at ``address``, or start a local one (``num_cpus``, all by default) and stop it after.

    A Ray this process already started is used as it is and left running (tests share one).
    """
    import ray

    if ray.is_initialized():
        yield
        return
    if address:
        check_reachable(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        except ConnectionError as exc:  # "auto" and no cluster on this machine; a cluster that went away
            raise ValueError(f"--ray-address {address}: no Ray cluster to join ({one_line(exc)})") from None
    else:
        ray.init(
            num_cpus=num_cpus or os.cpu_count() or 1,
            include_dashboard=False,  # no dashboard, no port for it
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    try:
        yield
    finally:
        ray.shutdown()


#: how long :func:`check_reachable` waits for a Ray head's port to accept a connection
REACH_SECONDS = 5.0


def check_reachable(address: str, timeout: float = REACH_SECONDS) -> None:
    """A ``HOST:PORT`` Ray address must accept a TCP connection: ``ray.init`` would retry its GCS for minutes.

    ``auto`` and ``ray://`` addresses are left to Ray (it finds no cluster at once, or its client says why)."""
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address {address}: give HOST:PORT of the Ray head (e.g. HEAD:6379) or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        reason = "no answer" if isinstance(exc, TimeoutError) else exc.strerror or type(exc).__name__
        raise ValueError(
            f"--ray-address {address}: nothing accepts a connection there within {timeout:g} s ({reason}); "
            "start the head with `ray start --head --port=6379`, or leave --ray-address out for a local Ray"
        ) from None


def one_line(exc: BaseException) -> str:
    """An exception's first line of text (Ray's errors run to paragraphs), or its type's name."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


class ClientHost:
    """A Ray actor's body: some virtual clients of one tier, built lazily from the population's recipe."""

    def __init__(self, population: Population, indices: Sequence[int], torch_threads: int) -> None:
        import torch

        torch.set_num_threads(torch_threads)
        self.population, self.indices, self.torch_threads = population, tuple(indices), torch_threads
        self._clients: dict[str, VirtualClient] | None = None

    def pid(self) -> int:
        return os.getpid()

    def _client(self, client_id: str) -> VirtualClient:
        if self._clients is None:
            built = self.population.build()
            self._clients = {built[i].client_id: built[i] for i in self.indices}
        return self._clients[client_id]

    def train(
        self,
        spec: ModelSpec,
        tensors: Mapping[str, Tensor],
        members: Sequence[tuple[str, TrainTask, Mapping[str, int]]],
        fp16: bool,
        personal_atoms: bool,
    ) -> list[InProcessPush]:
        """Train some of this actor's clients, one after another, in one call.

        ``tensors`` is the tier's global model; each member is ``(client id, task, versions)``, its versions
        naming the tensors of ``tensors`` newer than that client holds. One call per chunk of members,
        not per member, keeps Ray's per-call cost out of a round of many small clients.
        """
        return [
            _as_arrays(
                train_in_process(
                    self._client(cid),
                    spec,
                    task,
                    {n: (tensors[n], v) for n, v in versions.items()},
                    fp16=fp16,
                    personal_atoms=personal_atoms,
                )
            )
            for cid, task, versions in members
        ]

    def evaluate(
        self,
        spec: ModelSpec,
        tensors: Mapping[str, Tensor],
        members: Sequence[tuple[str, Mapping[str, int]]],
        fp16: bool,
        device: str,
    ) -> list[tuple[Moved, ClientEvaluation]]:
        """Evaluate some of this actor's clients on the closed model: ``(client id, versions)`` each, on ``device``."""
        return [
            evaluate_in_process(
                self._client(cid), spec, {n: (tensors[n], v) for n, v in versions.items()}, fp16=fp16, device=device
            )
            for cid, versions in members
        ]

    def run_agents(self, job: WorkerJob, credentials: Mapping[int, Any]) -> dict[str, int]:
        """Run the job's clients as real agents until the federation is done.

        ``credentials`` (index → :class:`client_agent.agent.Credentials`, registered by the driver in
        index order) are written into this node's state root, which need not be shared with the driver.
        """
        from client_agent.agent import CREDENTIALS_FILE

        for i, creds in credentials.items():
            if not (state_dir(job.state_root, i) / CREDENTIALS_FILE).exists():
                creds.save(state_dir(job.state_root, i))
        return run_worker(job)


def _as_arrays(done: InProcessPush) -> InProcessPush:
    """The push with numpy arrays for tensors: Ray moves an array as one buffer, a tensor by pickling its storage."""
    return _converted(done, lambda t: t.numpy())


def as_tensors(done: InProcessPush) -> InProcessPush:
    """A push from :meth:`ClientHost.train` with tensors again, copied out of Ray's read-only object store."""
    return _converted(done, lambda a: torch.from_numpy(np.array(a)))


def _converted(done: InProcessPush, convert: Callable[[Any], Any]) -> InProcessPush:
    push = done.push
    delta = None if push.control_delta is None else {n: convert(t) for n, t in push.control_delta.items()}
    tensors = {n: convert(t) for n, t in push.tensors.items()}
    return replace(done, push=replace(push, tensors=tensors, control_delta=delta))


@dataclass(frozen=True)
class ActorLost:
    """A call whose actor died: the slot it was on, and the actor generation that died."""

    slot: int
    generation: int
    cause: str


def death_reason(exc: BaseException) -> str:
    """Why Ray says an actor died, in one line: its "The actor is dead because …" sentence, without the advice."""
    text = str(exc)
    for line in text.splitlines():
        if "The actor is dead because" in line:
            return line[line.index("The actor is dead because") :].split(" Some common causes")[0].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


class ClientHosts:
    """The actors of one run, one per :class:`Slot`; a dead actor is replaced (fresh state) when asked."""

    def __init__(
        self,
        population: Population,
        resources: Mapping[str, Any] | None,
        torch_threads: int,
        max_replacements: int = MAX_REPLACEMENTS,
    ) -> None:
        import ray

        self.population, self.torch_threads, self.max_replacements = population, torch_threads, max_replacements
        tiers = parse_resources(resources, population.tiers)
        client_tiers = [population.tiers[i % len(population.tiers)] for i in range(population.num_clients)]
        self.slots: list[Slot] = place(client_tiers, tiers, ray.cluster_resources())
        self.slot_of: dict[int, int] = {i: s for s, slot in enumerate(self.slots) for i in slot.indices}
        self.generation = [0] * len(self.slots)  # also how often each slot's actor died
        self.run_id = uuid.uuid4().hex[:8]  # actors are named fedatoms-<run>-slot<s>-g<generation>
        self.actors = [self._start(s) for s in range(len(self.slots))]

    def _start(self, s: int) -> Any:
        import ray

        slot = self.slots[s]
        name = f"fedatoms-{self.run_id}-slot{s}-g{self.generation[s]}"
        cls = ray.remote(ClientHost).options(**slot.resources.actor_options(), max_restarts=0, name=name)
        return cls.remote(self.population, slot.indices, self.torch_threads)

    def pids(self) -> list[int]:
        import ray

        return ray.get([a.pid.remote() for a in self.actors])

    def call(self, s: int, method: str, *args: Any, returns: int = 1) -> tuple[int, int, Any]:
        """Submit ``method`` on the actor of slot ``s``; ``(slot, generation, ref)`` to :meth:`result`.

        A method that returns a list of ``returns`` values stores each as an object of its own: Ray's object
        store reuses the blocks of per-client objects, where one object per chunk takes fresh memory each round.
        """
        call = getattr(self.actors[s], method)
        return s, self.generation[s], (call.options(num_returns=returns) if returns > 1 else call).remote(*args)

    def result(self, pending: tuple[int, int, Any]) -> Any:
        """The call's value, or :class:`ActorLost` after replacing the actor that died under it."""
        import ray
        from ray.exceptions import RayActorError

        s, generation, ref = pending
        try:
            return ray.get(ref)
        except RayActorError as exc:
            self.replace(s, generation, death_reason(exc))
            return ActorLost(s, generation, type(exc).__name__)

    def replace(self, s: int, generation: int, reason: str) -> bool:
        """Start a new actor for slot ``s`` unless generation ``generation`` was replaced already; the death that
        would replace it more than ``max_replacements`` times raises :class:`SlotFailed` (``reason``: why it died)."""
        if self.generation[s] != generation:
            return False
        import ray

        if generation >= self.max_replacements:
            ids = [client_key(i) for i in self.slots[s].indices]
            shown = ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
            raise SlotFailed(
                f"the Ray actor of slot {s} (clients {shown}) died {generation + 1} times, more than the "
                f"{self.max_replacements} replacements a run allows: {reason}"
            )
        ray.kill(self.actors[s], no_restart=True)  # it is dead, or must be: its clients move to the new one
        self.generation[s] += 1
        self.actors[s] = self._start(s)
        log.warning(
            "event=actor_replaced slot=%d generation=%d clients=%d", s, self.generation[s], len(self.slots[s].indices)
        )
        return True

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)


def run_ray_grpc_pool(
    target: str,
    population: Population,
    state_root: str | Path,
    *,
    resources: Mapping[str, Any] | None = None,
    node_state_root: str | None = None,
    tls_ca: str | None = None,
    poll: Callable[[], None] | None = None,
    on_replaced: Callable[[Sequence[int]], None] | None = None,
    eval_poll_seconds: float = 0.02,
    torch_threads: int = 1,
    keep_state: bool = True,
    max_replacements: int = MAX_REPLACEMENTS,
    allowed_models: Sequence[str] = DEFAULT_ALLOWED_MODELS,
    device: str | None = None,
) -> dict[str, int]:
    """:func:`client_agent.pool.run_grpc_pool` on Ray: each actor runs its slot's clients as real agents.

    The clients must be registered already (:func:`client_agent.pool.register_all` under
    ``state_root``); their credentials travel to the actors, whose agents keep their state under
    ``node_state_root`` (default: ``state_root``, which must then be valid on every node). An actor
    that dies is replaced and its agents start again from what their state directory holds (a
    restarted device: it asks for its task, fetches, trains and pushes the open round again);
    ``on_replaced`` hears the client indices. A slot replaced more than ``max_replacements`` times
    fails the run (:class:`SlotFailed`). ``device``: the torch device every agent trains and evaluates on,
    resolved on its actor's node.
    """
    import ray
    from ray.exceptions import RayActorError

    from client_agent.agent import Credentials

    hosts = ClientHosts(population, resources, torch_threads, max_replacements)
    root = str(node_state_root or state_root)

    def submit(s: int) -> Any:
        slot = hosts.slots[s]
        job = WorkerJob(
            target, population, slot.indices, root, tls_ca, torch_threads, eval_poll_seconds, keep_state,
            tuple(allowed_models), device,
        )  # fmt: skip
        creds = {i: Credentials.load(state_dir(state_root, i)) for i in slot.indices}
        return hosts.actors[s].run_agents.remote(job, creds)

    running = {submit(s): (s, 0) for s in range(len(hosts.slots))}
    results: dict[str, int] = {}
    try:
        while running:
            done, _ = ray.wait(list(running), num_returns=1, timeout=0.5)
            for ref in done:
                s, generation = running.pop(ref)
                try:
                    results.update(ray.get(ref))  # re-raises an agent's exception here
                except RayActorError as exc:
                    hosts.replace(s, generation, death_reason(exc))  # SlotFailed past max_replacements
                    if on_replaced is not None:
                        on_replaced(hosts.slots[s].indices)
                    running[submit(s)] = (s, hosts.generation[s])
            if poll is not None:
                poll()
    finally:
        hosts.close()
    return results
