"""The Ray engine, in process: cohort members train on Ray actors, the driver folds and closes as always.

Per round the driver puts each tier's global model in Ray's object store once, sends every
cohort member's task to the actor hosting it (all at once: actors train in parallel, one
client at a time each), and folds the pushes in cohort order as they arrive, exactly as the
local engine folds them; the same for the evaluations after the close. The driver keeps what
each client holds (tensor versions) so a fetch moves, and counts, what the local engine's would.

An actor that dies takes its clients' state with it. It is replaced at once; with
``actor_failure = "retry"`` its clients' calls of the open round run again on the new actor
(which fetches the whole model, as a restarted device does), with ``"dropout"`` they are left
out of the round. Either way the round's record lists them under ``faults``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from aggregator_service.rounds import Federation, RoundPlan
from client_agent.pool import InProcessPush, Moved
from client_agent.ray_pool import ActorLost, ClientHosts
from client_agent.update import ClientEvaluation
from fedatoms.engines.local import server_control, train_task
from fedcore.keys import client_key
from fedcore.training import TrainConfig

__all__ = ["RayClients"]


class RayClients:
    """The virtual clients of an in-process simulation, hosted by Ray actors (:class:`ClientHosts`)."""

    def __init__(self, config: Any) -> None:
        self.population = config.population()
        self.seed, self.fp16, self.personal_atoms = config.seed, config.fp16, config.personal_atoms
        self.retry = config.actor_failure == "retry"
        self.hosts = ClientHosts(self.population, config.resources, config.threads)
        self.index = {client_key(i): i for i in range(self.population.num_clients)}
        tiers = self.population.tiers
        self.tier = {cid: float(tiers[i % len(tiers)]) for cid, i in self.index.items()}
        self.held: dict[str, dict[str, int]] = {cid: {} for cid in self.index}  # tensor versions each client holds
        self.faults: dict[int, list[dict[str, Any]]] = {}
        self._models: tuple[tuple[int, ...], dict[float, Any]] = ((), {})

    @property
    def client_ids(self) -> list[str]:
        return list(self.index)

    def _model(self, federation: Federation, tier: float) -> Any:
        """The tier's global model in the object store, put once per version and tier."""
        import ray

        key = tuple(federation.versions.values())
        if self._models[0] != key:
            self._models = (key, {})
        refs = self._models[1]
        if tier not in refs:
            refs[tier] = ray.put(federation.tier_tensors(tier))
        return refs[tier]

    def _fetch(self, federation: Federation, cid: str) -> dict[str, int]:
        """FetchModel's choice, made by the driver for the client: the tensors newer than it holds."""
        versions = {n: v for n, (_, v) in federation.fetch(self.tier[cid], self.held[cid]).items()}
        self.held[cid].update(versions)
        return versions

    def _lost(self, round_: int, cid: str, phase: str, lost: ActorLost, retried: bool) -> None:
        for other in self.hosts.slots[lost.slot].indices:  # the dead actor's clients hold nothing any more
            self.held[client_key(other)] = {}
        self.faults.setdefault(round_, []).append(
            {
                "client": cid,
                "phase": phase,
                "outcome": "retried" if retried else "dropout",
                "cause": f"actor {lost.slot} ({lost.cause})",
            }
        )

    def _calls(self, round_: int, phase: str, cohort: Sequence[str], submit: Any) -> Iterator[tuple[str, Any]]:
        """Submit every member's call, then yield results in cohort order; a lost call is retried once or dropped."""
        pending = [(cid, submit(cid)) for cid in cohort]
        for cid, call in pending:
            value = self.hosts.result(call)
            if isinstance(value, ActorLost):
                retry = self.retry
                self._lost(round_, cid, phase, value, retry)
                if retry:
                    value = self.hosts.result(submit(cid))
                    if isinstance(value, ActorLost):
                        self._lost(round_, cid, phase, value, False)
            if not isinstance(value, ActorLost):
                yield cid, value

    def train(self, federation: Federation, plan: RoundPlan, config: TrainConfig) -> Iterator[InProcessPush]:
        control = server_control(federation)

        def submit(cid: str) -> Any:
            tier = self.tier[cid]
            task = train_task(federation, plan, tier, cid, self.seed, config, control)
            return self.hosts.call(
                self.index[cid],
                "train",
                cid,
                federation.tier_spec(tier),
                task,
                self._model(federation, tier),
                self._fetch(federation, cid),
                self.fp16,
                self.personal_atoms,
            )

        for _, push in self._calls(plan.round, "train", plan.cohort, submit):
            yield push

    def evaluate(self, federation: Federation, cohort: Sequence[str]) -> Iterator[tuple[str, Moved, ClientEvaluation]]:
        def submit(cid: str) -> Any:
            tier = self.tier[cid]
            return self.hosts.call(
                self.index[cid],
                "evaluate",
                cid,
                federation.tier_spec(tier),
                self._model(federation, tier),
                self._fetch(federation, cid),
                self.fp16,
            )

        for cid, (moved, evaluation) in self._calls(federation.round, "evaluate", cohort, submit):
            yield cid, moved, evaluation

    def close(self) -> None:
        self.hosts.close()
