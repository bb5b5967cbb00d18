"""One client round: starting point, unsynced tensors, personal atoms, what is pushed."""

from __future__ import annotations

import torch

from client_agent.state import ClientState
from client_agent.update import TrainTask, evaluate_client, run_task
from fedcore.data import load_dataset
from fedcore.spec import ModelSpec
from fedcore.training import TrainConfig

SPEC = ModelSpec("digits-cnn", 10, "atoms", 9)


def fresh_state() -> ClientState:
    torch.manual_seed(0)
    model = SPEC.build()
    state = ClientState("c0", 1.0)
    state.receive({n: (t.clone(), 0) for n, t in model.state_dict().items()})
    return state


def task(round_: int, due: tuple[str, ...], continue_unsynced: bool) -> TrainTask:
    return TrainTask(round_, due, TrainConfig(local_epochs=1, batch_size=32, lr=0.01), continue_unsynced, seed=round_)


def test_unsynced_tensors_continue_only_within_a_cohort_period():
    train, _ = load_dataset("digits")
    data = train.subset(range(64))
    state = fresh_state()
    due = ("conv1.atoms", "conv1.bias", "head.weight", "head.bias")
    push = run_task(state, SPEC, task(1, due, False), data)
    assert set(push.tensors) == set(due)
    assert set(state.unsynced) == set(SPEC.names) - set(due)
    start = state.starting_point(continue_unsynced=True)
    assert torch.equal(start["conv2.coefficients"], state.unsynced["conv2.coefficients"])
    assert not torch.equal(start["conv2.coefficients"], state.global_tensors["conv2.coefficients"])
    start = state.starting_point(continue_unsynced=False)
    assert torch.equal(start["conv2.coefficients"], state.global_tensors["conv2.coefficients"])
    assert state.unsynced == {}


def test_personal_atoms_start_from_global_and_persist():
    train, test = load_dataset("digits")
    data = train.subset(range(64))
    state = fresh_state()
    run_task(state, SPEC, task(1, tuple(SPEC.names), False), data, personal_atoms=True)
    assert state.personal_atoms is not None
    assert set(state.personal_atoms) == {"conv1.atoms", "conv2.atoms"}
    assert not torch.equal(state.personal_atoms["conv2.atoms"], state.global_tensors["conv2.atoms"])
    evaluation = evaluate_client(state, SPEC, test.subset(range(50)))
    assert evaluation.personalized_accuracy is not None and 0 <= evaluation.personalized_accuracy <= 1
    assert evaluation.num_samples == 50
    assert state.rounds_joined == 1


def test_local_tensors_survive_every_round_and_are_never_pushed():
    """Tensors the federation keeps local (BN statistics with --keep-local-buffers) persist on the client."""
    train, _ = load_dataset("digits")
    data = train.subset(range(64))
    state = fresh_state()
    local = ("conv1.bias",)
    due = tuple(n for n in SPEC.names if n not in local)
    t = TrainTask(1, due, TrainConfig(local_epochs=1, batch_size=32, lr=0.01), False, seed=1, local=local)
    push = run_task(state, SPEC, t, data)
    assert "conv1.bias" not in push.tensors
    trained = state.local["conv1.bias"]
    assert not torch.equal(trained, state.global_tensors["conv1.bias"])
    for continue_unsynced in (False, True):
        assert torch.equal(state.starting_point(continue_unsynced)["conv1.bias"], trained)
