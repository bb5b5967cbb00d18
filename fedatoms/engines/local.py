"""The local engine: every virtual client in this process, trained one after another in cohort order.

It and the Ray engine (:mod:`fedatoms.engines.ray_engine`) give the driver the same thing — each
cohort member's push in cohort order, then each member's evaluation of the closed model — and
share the task every client gets (:func:`train_task`) and the bandwidth accounting (:func:`account`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor

from aggregator_service.metrics import BandwidthLedger
from aggregator_service.rounds import Federation, RoundPlan
from client_agent.pool import InProcessPush, Moved, VirtualClient, evaluate_in_process, train_in_process
from client_agent.update import ClientEvaluation, TrainTask
from fedcore.keys import derive_seed
from fedcore.training import TrainConfig

__all__ = ["LocalClients", "account", "train_task"]


def train_task(
    federation: Federation,
    plan: RoundPlan,
    tier: float,
    client_id: str,
    seed: int,
    config: TrainConfig,
    server_control: Mapping[str, Tensor] | None,
    fp16: bool = False,
) -> TrainTask:
    """What the server's GetTask tells a cohort member: due tensors, hyper-parameters, its seed."""
    strategy = dict(federation.strategy.client_config())
    if fp16:  # as the aggregator's Train task says it
        strategy["fp16_transport"] = True
    return TrainTask(
        round=plan.round,
        due=federation.tier_due(tier, plan.due),
        config=config,
        continue_unsynced=plan.continue_unsynced,
        seed=derive_seed(seed, plan.round, client_id),
        strategy=strategy,
        server_control=None if server_control is None else dict(server_control),
        local=federation.local_tier_tensors(tier),
    )


def account(
    ledger: BandwidthLedger, round_: int, client_id: str, category: str, moved: Moved, model: bool = True
) -> None:
    """Record the bytes of one fetch or push; a fetch that moved something (or a push) is one transfer, one
    FedAvg would make too unless ``model`` is False (it moved only SCAFFOLD's control: the client held the
    model, and FedAvg would not have fetched)."""
    for tensor, nbytes in moved:
        ledger.record(round_, client_id, category, tensor, nbytes)
    if model and sum(n for _, n in moved):
        ledger.transfer(round_, client_id, category)


def server_control(federation: Federation) -> dict[str, Tensor] | None:
    """SCAFFOLD's server control variate, which every cohort member fetches with the model."""
    return federation.strategy.server_control() if federation.strategy.client_config().get("scaffold") else None


class LocalClients:
    """The virtual clients in this process."""

    def __init__(
        self, clients: Sequence[VirtualClient], seed: int, fp16: bool, personal_atoms: bool, device: str
    ) -> None:
        self.by_id = {c.client_id: c for c in clients}
        self.seed, self.fp16, self.personal_atoms = seed, fp16, personal_atoms
        self.device = device  # where the clients evaluate; they train where each task's config says
        self.faults: dict[int, list[dict[str, Any]]] = {}  # round → lost clients; none here: a failure ends the run

    @property
    def client_ids(self) -> list[str]:
        return list(self.by_id)

    def train(self, federation: Federation, plan: RoundPlan, config: TrainConfig) -> Iterator[InProcessPush]:
        control = server_control(federation)
        for cid in plan.cohort:  # fixed fold order: sorted client ids
            vc = self.by_id[cid]
            task = train_task(federation, plan, vc.state.tier, cid, self.seed, config, control, self.fp16)
            fetched = federation.fetch(vc.state.tier, vc.state.versions)
            spec = federation.tier_spec(vc.state.tier)
            yield train_in_process(vc, spec, task, fetched, fp16=self.fp16, personal_atoms=self.personal_atoms)

    def evaluate(self, federation: Federation, cohort: Sequence[str]) -> Iterator[tuple[str, Moved, ClientEvaluation]]:
        for cid in cohort:
            vc = self.by_id[cid]
            fetched = federation.fetch(vc.state.tier, vc.state.versions)
            spec = federation.tier_spec(vc.state.tier)
            moved, evaluation = evaluate_in_process(vc, spec, fetched, fp16=self.fp16, device=self.device)
            yield cid, moved, evaluation

    def close(self) -> None:
        pass
