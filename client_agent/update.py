"""One round on one client: start from held tensors, train locally, keep what is not pushed.

Shared by every transport: the in-process pool and the gRPC agent call :func:`run_task`
with the task the server sent, so a client behaves identically whichever way it talks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from tqdm import tqdm

from client_agent.state import ClientState
from fedcore.spec import ModelSpec
from fedcore.training import Dataset, TrainConfig, evaluate, local_update, personalized_model

__all__ = ["ClientEvaluation", "ClientPush", "TrainTask", "evaluate_client", "run_task"]


@dataclass(frozen=True)
class TrainTask:
    round: int
    due: tuple[str, ...]  # this client's tier tensor names to push
    config: TrainConfig
    continue_unsynced: bool
    seed: int
    strategy: dict[str, Any] = field(default_factory=dict)
    server_control: dict[str, Tensor] | None = None
    local: tuple[str, ...] = ()  # tensors that stay on the client for good (never due)


@dataclass(frozen=True)
class ClientPush:
    round: int
    tensors: dict[str, Tensor]
    num_samples: int
    metrics: dict[str, float]
    control_delta: dict[str, Tensor] | None = None


@dataclass(frozen=True)
class ClientEvaluation:
    global_accuracy: float
    global_loss: float
    personalized_accuracy: float | None
    num_samples: int


def run_task(
    state: ClientState,
    spec: ModelSpec,
    task: TrainTask,
    train_data: Dataset,
    personal_atoms: bool = False,
    progress: bool = False,
) -> ClientPush:
    """Train ``state`` for ``task``; with ``progress`` a bar advances per local epoch."""
    model = spec.build()
    model.load_state_dict(state.starting_point(task.continue_unsynced))
    if personal_atoms and state.personal_atoms is None:
        state.personal_atoms = {n: t.clone() for n, t in state.global_tensors.items() if spec.tensor(n).role == "atoms"}
    server_control = task.server_control if task.strategy.get("scaffold") else None
    bar = (
        tqdm(total=task.config.local_epochs, desc=f"round {task.round}", unit="epoch", leave=False)
        if progress
        else None
    )
    try:
        result = local_update(
            model,
            train_data,
            task.config,
            seed=task.seed,
            server_control=server_control,
            client_control=state.control if server_control is not None else None,
            personal_atoms=state.personal_atoms if personal_atoms else None,
            on_epoch=(lambda done, total: bar.update(1)) if bar is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()
    due, local = set(task.due), set(task.local)
    state.local = {n: t for n, t in result.tensors.items() if n in local}
    state.unsynced = {n: t for n, t in result.tensors.items() if n not in due and n not in local}
    if result.personal_atoms is not None:
        state.personal_atoms = result.personal_atoms
    if result.control is not None:
        state.control = result.control
    state.rounds_joined += 1
    return ClientPush(
        round=task.round,
        tensors={n: result.tensors[n] for n in task.due},
        num_samples=result.num_samples,
        metrics=result.metrics,
        control_delta=result.control_delta,
    )


def evaluate_client(state: ClientState, spec: ModelSpec, test_data: Dataset) -> ClientEvaluation:
    """The current global model and, with personal atoms, the personalized model on local test data."""
    model = spec.build()
    model.load_state_dict({**state.global_tensors, **state.local})
    glob = evaluate(model, test_data)
    personal = None
    if state.personal_atoms is not None:
        personal = evaluate(personalized_model(model, state.personal_atoms), test_data).accuracy
    return ClientEvaluation(glob.accuracy, glob.loss, personal, glob.num_samples)
