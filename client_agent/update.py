"""One round on one client: start from held tensors, train locally, keep what is not pushed.

Shared by every transport: the in-process pool and the gRPC agent call :func:`run_task`
with the task the server sent, so a client behaves identically whichever way it talks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import Tensor
from tqdm import tqdm

from client_agent.state import ClientState
from fedcore.spec import ModelSpec
from fedcore.training import Dataset, TrainConfig, evaluate, local_update, resolve_device
from fedcore.training.finetune import fine_tune
from fedcore.training.nested import nested_cut
from fedcore.training.personal import personal_evaluation_model
from fedcore.training.personalization import SPLITS, personal_tensors
from fedcore.training.terms import LocalTerms

__all__ = ["ClientEvaluation", "ClientPush", "TrainTask", "evaluate_client", "on_device", "run_task"]


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
    #: with ``hold_strategy_state``: the client's new strategy state (SCAFFOLD's c_i, FedDyn's ∇L_k, FedDC's
    #: h_i), held aside once the server has taken the update and kept once its round closes
    strategy_state: dict[str, dict[str, Tensor]] | None = None


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
    hold_strategy_state: bool = False,
) -> ClientPush:
    """Train ``state`` for ``task``; with ``progress`` a bar advances per local epoch.

    A personalization baseline's personal tensors (``task.config.personalization``) start from the
    client's own values, the first time from the received ones, and are kept, never pushed.
    """
    method = task.config.personalization
    personal = set(personal_tensors(spec, method))
    if personal & set(task.due):
        raise ValueError(
            f"the server asks for personal tensors {sorted(personal & set(task.due))[:5]}: "
            f"it does not keep them local as {method!r} needs"
        )
    start = state.starting_point(task.continue_unsynced)
    if method in SPLITS:
        if state.personal_model is None or set(state.personal_model) != personal:
            state.personal_model = {n: start[n].clone() for n in personal}
        start = {**start, **state.personal_model}
    elif method == "ditto":
        if state.personal_model is None or set(state.personal_model) != set(start):
            state.personal_model = {n: t.clone() for n, t in start.items()}
    else:
        state.personal_model = None
    # the tier's model alone, allocated where it trains: no plain model built first, no copy to the device after
    model = spec.build_loaded(start, device=resolve_device(task.config.device))
    if personal_atoms and state.personal_atoms is None:
        state.personal_atoms = {n: t.clone() for n, t in state.global_tensors.items() if spec.tensor(n).role == "atoms"}
    terms = LocalTerms.from_config(task.strategy)
    server_control = task.server_control if terms.control else None
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
            terms=terms,
            server_control=server_control,
            client_state={g: state.strategy_state[g] for g in terms.groups if g in state.strategy_state},
            personal_atoms=state.personal_atoms if personal_atoms else None,
            personal_model=state.personal_model if method == "ditto" else None,
            on_epoch=(lambda done, total: bar.update(1)) if bar is not None else None,
            nested=None if task.config.nested_rank_ratio is None else nested_cut(spec, task.config.nested_rank_ratio),
            head=[t.name for t in spec.tensors if t.role == "head"] or None,  # the federation's head, if it names one
        )
    finally:
        if bar is not None:
            bar.close()
    due, local = set(task.due), set(task.local) - personal
    state.local = {n: t for n, t in result.tensors.items() if n in local}
    state.unsynced = {n: t for n, t in result.tensors.items() if n not in due | local | personal}
    if method in SPLITS:
        state.personal_model = {n: result.tensors[n] for n in personal}
    elif result.personal_model is not None:
        state.personal_model = result.personal_model
    state.last_config, state.last_seed = task.config.to_dict(), task.seed
    if result.personal_atoms is not None:
        state.personal_atoms = result.personal_atoms
    held = None
    if result.strategy_state is not None:
        if hold_strategy_state:
            held = result.strategy_state
        else:
            state.strategy_state.update(result.strategy_state)
    state.rounds_joined += 1
    return ClientPush(
        round=task.round,
        tensors={n: result.tensors[n] for n in task.due},
        num_samples=result.num_samples,
        metrics=result.metrics,
        control_delta=result.control_delta,
        strategy_state=held,
    )


def on_device(config: TrainConfig, device: str | None) -> TrainConfig:
    """``config`` on the torch device the client computes on, for training and evaluation alike: ``device``
    where the client names one (``--device``: its own hardware, whatever device the federation's task names),
    else the config's own (the task's; an aggregator's says ``auto``)."""
    return config if device is None else replace(config, device=device)


def evaluate_client(
    state: ClientState,
    spec: ModelSpec,
    test_data: Dataset,
    train_data: Dataset | None = None,
    *,
    device: str | None = None,
) -> ClientEvaluation:
    """The current global model and the client's personalized one on local test data.

    Personalized: the global coefficients × the personal atoms; the global model with the client's
    personal tensors in place (FedPer, FedRep, LG-FedAvg, Local-only) or Ditto's ``v_k``; or, for
    FedAvg+FT, the global model fine-tuned on ``train_data`` with the last round's config and seed.
    Everything runs where the client trains (:func:`on_device`): on ``device`` where one is given, else
    where its last round trained (``auto`` before it trained).
    """
    last = None if state.last_config is None else TrainConfig.from_dict(state.last_config)
    config = on_device(TrainConfig() if last is None else last, device)
    model = spec.build_loaded({**state.global_tensors, **state.local}, device=resolve_device(config.device))
    glob = evaluate(model, test_data, device=config.device)
    personal = None
    if state.personal_atoms is not None:
        seed = 0 if state.last_seed is None else state.last_seed
        tuned = personal_evaluation_model(model, state.personal_atoms, train_data, config, seed)
        personal = evaluate(tuned, test_data, device=config.device).accuracy
    elif state.personal_model is not None:
        model.load_state_dict({**state.global_tensors, **state.local, **state.personal_model})
        personal = evaluate(model, test_data, device=config.device).accuracy
    elif last is not None and config.personalization == "ft":
        if train_data is None or state.last_seed is None:
            raise ValueError("FedAvg+FT evaluates a fine-tuned model: it needs the client's training data")
        tuned, _ = fine_tune(model, train_data, config, seed=state.last_seed)
        personal = evaluate(tuned, test_data, device=config.device).accuracy
    return ClientEvaluation(glob.accuracy, glob.loss, personal, glob.num_samples)
