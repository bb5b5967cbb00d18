"""The Ray engine, in process: cohort members train on Ray actors, the driver folds and closes as always.

Per round the driver puts each tier's global model in Ray's object store once, sends the
cohort members' tasks to the actors hosting them (all at once, a few calls per actor: actors
train in parallel, one client at a time each), and folds the pushes in cohort order as they
arrive, exactly as the local engine folds them; the same for the evaluations after the close. The driver keeps what
each client holds (tensor versions) so a fetch moves, and counts, what the local engine's would.

An actor that dies takes its clients' state with it. It is replaced at once; with
``actor_failure = "retry"`` its clients' calls of the open round run again on the new actor
(which fetches the whole model, as a restarted device does), with ``"dropout"`` they are left
out of the round. Either way the round's record lists them under ``faults``. A slot whose actor dies a
fourth time fails the run (:class:`client_agent.ray_pool.SlotFailed`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from aggregator_service.rounds import Federation, RoundPlan
from client_agent.pool import InProcessPush, Moved
from client_agent.ray_pool import ActorLost, ClientHosts, as_tensors
from client_agent.update import ClientEvaluation
from fedatoms.engines.local import server_control, train_task
from fedcore.keys import client_key
from fedcore.training import TrainConfig

__all__ = ["CHUNKS_PER_ACTOR", "RayClients"]

#: calls per actor per phase of a round: few enough that Ray's per-call cost stays small next to a round of
#: many small clients, more than one so the driver folds a chunk's pushes while the actor trains the next
CHUNKS_PER_ACTOR = 4


class RayClients:
    """The virtual clients of an in-process simulation, hosted by Ray actors (:class:`ClientHosts`)."""

    def __init__(self, config: Any) -> None:
        self.population = config.population()
        self.seed, self.fp16, self.personal_atoms = config.seed, config.fp16, config.personal_atoms
        self.device = config.device  # where the actors' clients evaluate; they train where each task says
        self.retry = config.actor_failure == "retry"
        self.hosts = ClientHosts(self.population, config.resources, config.threads)
        self.index = {client_key(i): i for i in range(self.population.num_clients)}
        tiers = self.population.tiers
        self.tier = {cid: float(tiers[i % len(tiers)]) for cid, i in self.index.items()}
        self.held: dict[str, dict[str, int]] = {cid: {} for cid in self.index}  # tensor versions each client holds
        self.faults: dict[int, list[dict[str, Any]]] = {}
        self._forgotten: set[tuple[int, int]] = set()  # (slot, generation) of dead actors whose clients were reset
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

    def _lost(self, round_: int, chunk: Sequence[str], phase: str, lost: ActorLost, retried: bool) -> None:
        if (lost.slot, lost.generation) not in self._forgotten:  # the dead actor's clients hold nothing any more
            self._forgotten.add((lost.slot, lost.generation))
            for other in self.hosts.slots[lost.slot].indices:
                self.held[client_key(other)] = {}
        self.faults.setdefault(round_, []).extend(
            {
                "client": cid,
                "phase": phase,
                "outcome": "retried" if retried else "dropout",
                "cause": f"actor {lost.slot} ({lost.cause})",
            }
            for cid in chunk
        )

    def _chunks(self, cohort: Sequence[str]) -> list[list[str]]:
        """The cohort split into calls: each actor's members in cohort order, in up to ``CHUNKS_PER_ACTOR`` calls."""
        by_slot: dict[int, list[str]] = {}
        for cid in cohort:
            by_slot.setdefault(self.hosts.slot_of[self.index[cid]], []).append(cid)
        chunks = []
        for members in by_slot.values():
            size = -(-len(members) // CHUNKS_PER_ACTOR)
            chunks += [members[i : i + size] for i in range(0, len(members), size)]
        return chunks

    def _calls(self, round_: int, phase: str, cohort: Sequence[str], submit: Any) -> Iterator[tuple[str, Any]]:
        """Submit every chunk's call, then yield members' results in cohort order; a lost chunk is retried once
        (on the dead actor's replacement) or dropped."""
        chunks = self._chunks(cohort)
        chunk_of = {cid: i for i, chunk in enumerate(chunks) for cid in chunk}
        pending = [submit(chunk) for chunk in chunks]
        results: dict[str, Any] = {}
        for cid in cohort:
            i = chunk_of[cid]
            if pending[i] is not None:
                results.update(self._collect(round_, phase, chunks[i], pending[i], submit))
                pending[i] = None
            if cid in results:
                yield cid, results.pop(cid)

    def _collect(self, round_: int, phase: str, chunk: list[str], call: Any, submit: Any) -> dict[str, Any]:
        """One chunk's results by client; empty when its actor died and the chunk is dropped."""
        values = self.hosts.result(call)
        if isinstance(values, ActorLost):
            retry = self.retry
            self._lost(round_, chunk, phase, values, retry)
            if not retry:
                return {}
            values = self.hosts.result(submit(chunk))
            if isinstance(values, ActorLost):
                self._lost(round_, chunk, phase, values, False)
                return {}
        return dict(zip(chunk, values, strict=True))

    def _slot(self, chunk: Sequence[str]) -> int:
        return self.hosts.slot_of[self.index[chunk[0]]]

    def train(self, federation: Federation, plan: RoundPlan, config: TrainConfig) -> Iterator[InProcessPush]:
        control = server_control(federation)

        def submit(chunk: list[str]) -> Any:
            tier = self.tier[chunk[0]]  # an actor hosts clients of one tier
            members = [
                (
                    cid,
                    train_task(federation, plan, tier, cid, self.seed, config, control, self.fp16),
                    self._fetch(federation, cid),
                )
                for cid in chunk
            ]
            return self.hosts.call(
                self._slot(chunk),
                "train",
                federation.tier_spec(tier),
                self._model(federation, tier),
                members,
                self.fp16,
                self.personal_atoms,
                returns=len(chunk),
            )

        for _, done in self._calls(plan.round, "train", plan.cohort, submit):
            yield as_tensors(done)

    def evaluate(self, federation: Federation, cohort: Sequence[str]) -> Iterator[tuple[str, Moved, ClientEvaluation]]:
        def submit(chunk: list[str]) -> Any:
            tier = self.tier[chunk[0]]
            members = [(cid, self._fetch(federation, cid)) for cid in chunk]
            return self.hosts.call(
                self._slot(chunk),
                "evaluate",
                federation.tier_spec(tier),
                self._model(federation, tier),
                members,
                self.fp16,
                self.device,
                returns=len(chunk),
            )

        for cid, (moved, evaluation) in self._calls(federation.round, "evaluate", cohort, submit):
            yield cid, moved, evaluation

    def close(self) -> None:
        self.hosts.close()
