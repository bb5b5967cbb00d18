"""One client round: starting point, unsynced tensors, personal atoms, what is pushed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from pretend_cuda import NEEDS_NO_GPU, NO_CUDA_ERRORS, pretend_cuda

from client_agent.state import ClientState
from client_agent.update import TrainTask, evaluate_client, on_device, run_task
from fedcore.data import load_dataset
from fedcore.spec import ModelSpec
from fedcore.training import TrainConfig
from fedcore.training.personalization import personal_tensors

SPEC = ModelSpec("digits-cnn", 10, "atoms", 9)
ATOMS = ("conv1.atoms", "conv2.atoms")


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
    assert set(state.personal_atoms) == set(ATOMS)
    assert not torch.equal(state.personal_atoms["conv2.atoms"], state.global_tensors["conv2.atoms"])
    assert evaluate_client(state, SPEC, test.subset(range(50))).num_samples == 50
    assert state.rounds_joined == 1


def test_evaluation_counts_the_correct_predictions_of_the_global_and_the_personalized_model():
    _, test = load_dataset("digits")
    held_out = test.subset(range(100))
    state = fresh_state()
    gen = torch.Generator().manual_seed(5)  # atoms whose model gets 6 of 100 right, the global one 18
    state.personal_atoms = {n: torch.randn(state.global_tensors[n].shape, generator=gen) for n in ATOMS}
    evaluation = evaluate_client(state, SPEC, held_out)

    # the oracle: each model's logits on the same 100 samples, eval mode, argmax against the labels
    def logits(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        model = SPEC.build()
        model.load_state_dict(tensors)
        model.eval()
        with torch.no_grad():
            return model(held_out.x)

    global_logits = logits(state.global_tensors)
    global_correct = int((global_logits.argmax(dim=1) == held_out.y).sum())
    personal_correct = int((logits({**state.global_tensors, **state.personal_atoms}).argmax(dim=1) == held_out.y).sum())
    assert personal_correct != global_correct  # else swapping the two models would go unnoticed
    assert evaluation.global_accuracy == global_correct / 100
    assert evaluation.personalized_accuracy == personal_correct / 100
    assert evaluation.global_loss == pytest.approx(float(F.cross_entropy(global_logits, held_out.y)), rel=1e-5)
    assert evaluation.num_samples == 100


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


@NEEDS_NO_GPU
@pytest.mark.parametrize(
    ("personalization", "atoms"), [("none", False), ("none", True), ("fedper", False), ("ft", False)]
)
def test_evaluation_runs_where_the_client_trains(monkeypatch, personalization: str, atoms: bool) -> None:
    """``--device cpu`` on a GPU machine: the client evaluates on the CPU too, every model it evaluates (the global
    one, personal atoms', a baseline's personal tensors', FT's fine-tuned copy). The machine pretends CUDA, so
    ``auto`` picks it and using it fails: an evaluation that finishes ran on the device it was given."""
    train, test = load_dataset("digits")
    data, held_out = train.subset(range(64)), test.subset(range(50))
    config = TrainConfig(local_epochs=1, batch_size=32, lr=0.01, personalization=personalization)
    due = tuple(n for n in SPEC.names if n not in personal_tensors(SPEC, personalization))
    server_task = TrainTask(1, due, config, False, seed=1)  # the aggregator's: device auto
    trained_on_auto, trained_on_cpu = fresh_state(), fresh_state()
    run_task(trained_on_auto, SPEC, server_task, data, personal_atoms=atoms)  # before the GPU: auto is the CPU
    on_cpu = replace(server_task, config=on_device(server_task.config, "cpu"))  # an agent given --device cpu
    run_task(trained_on_cpu, SPEC, on_cpu, data, personal_atoms=atoms)
    assert (trained_on_auto.last_config["device"], trained_on_cpu.last_config["device"]) == ("auto", "cpu")

    pretend_cuda(monkeypatch)
    with pytest.raises(NO_CUDA_ERRORS):  # the pretence holds: a client trained on auto evaluates on auto's CUDA
        evaluate_client(trained_on_auto, SPEC, held_out, data)
    # restarted with --device cpu before it evaluated the round it trained on auto: the CPU, not the task's auto
    restarted = evaluate_client(trained_on_auto, SPEC, held_out, data, device="cpu")
    # no device given (an in-process client of `simulate --device cpu`): where its last round trained
    trained_there = evaluate_client(trained_on_cpu, SPEC, held_out, data)
    for evaluation in (restarted, trained_there):
        assert evaluation.num_samples == 50
        assert (evaluation.personalized_accuracy is None) == (personalization == "none" and not atoms)
    # a client that has not trained yet (a replaced Ray actor's) evaluates on the device it is given
    assert evaluate_client(fresh_state(), SPEC, held_out, data, device="cpu").num_samples == 50


def test_on_device_is_the_clients_device_where_it_names_one_else_the_tasks() -> None:
    task_config = TrainConfig(local_epochs=2)  # the aggregator's: device auto
    assert on_device(task_config, None) is task_config
    assert on_device(task_config, "cpu") == replace(task_config, device="cpu")
    assert on_device(replace(task_config, device="cpu"), "cuda:1").device == "cuda:1"


def test_personal_atoms_under_batchnorm_are_evaluated_with_statistics_of_their_own_filters(monkeypatch) -> None:
    """A BatchNorm after every atom conv makes a network blind to its filters' scale once each BN's statistics
    are those of its own filters: personal atoms 7× the global ones then compute the global model's function.
    The received statistics are the global filters', and with them the 7× filters' activations are off at
    every layer (VGG-11 with BN, a user's model; 3-channel 32×32 images made from digits)."""
    from pathlib import Path

    from fedcore.data import ArrayDataset
    from fedcore.training.batchnorm import recompute_statistics
    from fedcore.training.loop import Batches
    from fedcore.training.personal import personal_evaluation_model

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "aggregator_service"))
    spec = ModelSpec("user_models:cifar_vgg11_bn", 10, "atoms", model_args={"width": 8}, input_shape=(3, 32, 32))
    train, test = load_dataset("digits")

    def images(data, n: int) -> ArrayDataset:
        x = F.interpolate(data.x[:n], size=32, mode="nearest").repeat(1, 3, 1, 1)
        return ArrayDataset(x.contiguous(), data.y[:n].clone(), 10, "digits32")

    train32, test32 = images(train, 64), images(test, 40)
    config = TrainConfig(batch_size=16, device="cpu")
    torch.manual_seed(0)
    model = spec.build()
    recompute_statistics(model, Batches(train32, torch.device("cpu")), config.batch_size, seed=0)  # its own
    atoms = {n: 7.0 * t for n, t in model.state_dict().items() if n.endswith(".atoms")}
    assert len(atoms) == 8  # every conv of VGG-11, each followed by its BatchNorm
    personal = personal_evaluation_model(model, atoms, train32, config, seed=0)
    model.eval(), personal.eval()
    with torch.no_grad():
        expected, got = model(test32.x), personal(test32.x)
    assert torch.allclose(got, expected, rtol=1e-3, atol=1e-4 * float(expected.abs().max()))

    state = ClientState("c0", 1.0)
    state.receive({n: (t.clone(), 0) for n, t in model.state_dict().items()})
    state.personal_atoms = atoms
    state.last_config, state.last_seed = config.to_dict(), 0  # as its last round trained: the same minibatches
    evaluation = evaluate_client(state, spec, test32, train32, device="cpu")
    assert evaluation.personalized_accuracy == evaluation.global_accuracy
    with pytest.raises(ValueError, match="needs the client's training data"):
        evaluate_client(state, spec, test32, device="cpu")


def test_fedrep_trains_the_head_the_federation_names_not_the_last_linear():
    """With ``head = "fc1"`` the client keeps ``fc1`` (its personal head) and pushes the rest, but FedRep's
    head phase took the last Linear: the body phase then trained the personal head and the first phase a
    body layer. Oracle: full-batch gradient descent written here, ``fc1`` first, then every other layer."""
    spec = ModelSpec("digits-cnn", 10, head="fc1")
    train, _ = load_dataset("digits")
    data = train.subset(range(48))
    torch.manual_seed(0)
    start = spec.build()
    state = ClientState("c0", 1.0)
    state.receive({n: (t.clone(), 0) for n, t in start.state_dict().items()})
    personal = personal_tensors(spec, "fedrep")
    assert personal == ("fc1.weight", "fc1.bias")
    config = TrainConfig(
        local_epochs=2, head_epochs=3, batch_size=48, lr=0.05, momentum=0.0, device="cpu", personalization="fedrep"
    )
    due = tuple(n for n in spec.names if n not in personal)
    push = run_task(state, spec, TrainTask(1, due, config, False, seed=1), data)

    oracle = dict(start.named_parameters())
    for names, steps in ((personal, 3), (due, 2)):
        optimizer = torch.optim.SGD([oracle[n] for n in names], lr=0.05)
        for _ in range(steps):
            optimizer.zero_grad()
            F.cross_entropy(start(data.x), data.y.long()).backward()
            optimizer.step()
    for name in personal:
        torch.testing.assert_close(state.personal_model[name], oracle[name].detach(), rtol=1e-5, atol=1e-6)
    for name in due:
        torch.testing.assert_close(push.tensors[name], oracle[name].detach(), rtol=1e-5, atol=1e-6)


def test_a_round_and_an_evaluation_build_no_plain_model_off_the_meta_device(monkeypatch) -> None:
    """The client's model is built on the meta device and only then allocated, its tensors loaded: the plain
    model a whole build makes first (initialized, the size of the full-rank model whatever the tier) is never
    made. Oracle: where every call of the builder puts its tensors."""
    train, test = load_dataset("digits")
    state = fresh_state()
    made_on: list[str] = []
    build_plain = ModelSpec.build_plain

    def spying(self: ModelSpec) -> torch.nn.Module:
        model = build_plain(self)
        made_on.append(next(model.parameters()).device.type)
        return model

    monkeypatch.setattr(ModelSpec, "build_plain", spying)
    run_task(state, SPEC, task(1, tuple(SPEC.names), False), train.subset(range(32)))
    evaluate_client(state, SPEC, test.subset(range(20)))
    assert made_on and set(made_on) == {"meta"}
