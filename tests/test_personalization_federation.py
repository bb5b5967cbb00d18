"""The personalization baselines in a federation: what stays on the clients, what the server averages.

In process, on digits: FedPer's head never changes on the server and is each client's own
trained head; Local-only is every client training alone (computed here without a federation)
and moves no byte up; a personal part that cannot compose with the method is refused at start.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from client_agent.pool import Population
from client_agent.state import ClientState
from client_agent.update import TrainTask, run_task
from fedatoms import simulate
from fedatoms.simulate import SimulationConfig, run_simulation
from fedcore.keys import derive_seed
from fedcore.spec import ModelSpec
from fedcore.training import TrainConfig, local_update

SMALL: dict[str, Any] = dict(dataset="digits", clients=5, fraction=1.0, rounds=2, lr=0.05, batch_size=32, seed=5)


_BUILD, _CLIENTS = simulate.build_federation, Population.clients


def _run(monkeypatch, **kw) -> tuple[dict[str, Any], Any, list]:
    """A simulation, with the server's federation and the virtual clients kept for inspection."""
    engines: list[Any] = []
    clients: list = []
    build, make = _BUILD, _CLIENTS
    monkeypatch.setattr(simulate, "build_federation", lambda cfg: engines.append(build(cfg)) or engines[-1])
    monkeypatch.setattr(Population, "clients", lambda self, *a: clients.extend(make(self, *a)) or clients)
    config = SimulationConfig(**{**SMALL, **kw})
    return run_simulation(config), engines[0], clients


def test_fedper_head_never_changes_on_the_server_and_is_each_clients_own(monkeypatch) -> None:
    result, fed, _ = _run(monkeypatch, personalization="fedper")
    init_model = ModelSpec("digits-cnn", 10).initial_model(SMALL["seed"])
    init = init_model.state_dict()
    head = ("head.weight", "head.bias")
    for name in head:
        assert torch.equal(fed.global_tensors[name], init[name]) and fed.versions[name] == 0
    assert not torch.equal(fed.global_tensors["fc1.weight"], init["fc1.weight"])  # the body is averaged
    for r in result["rounds"]:
        assert all(r["tensors"][n]["bytes_up"] == 0 and not r["tensors"][n]["due"] for n in head)
        assert r["personalized_accuracy"] is not None
    assert result["rounds"][1]["tensors"]["head.weight"]["bytes_down"] == 0  # fetched once, at round 1

    # each client holds its own head: after one round, exactly its local training's from round 0's model
    _, _, kept = _run(monkeypatch, personalization="fedper", rounds=1)
    config = SimulationConfig(**{**SMALL, "personalization": "fedper"}).train_config(device="cpu")
    for vc in kept:
        own = local_update(
            copy.deepcopy(init_model), vc.train, config, seed=derive_seed(SMALL["seed"], 1, vc.client_id)
        )
        assert vc.state.personal_model is not None and set(vc.state.personal_model) == set(head)
        for name in head:
            assert torch.equal(vc.state.personal_model[name], own.tensors[name]), (vc.client_id, name)
            assert not torch.equal(own.tensors[name], init[name])


def test_local_only_is_each_client_training_alone_and_sends_nothing(monkeypatch) -> None:
    result, fed, clients = _run(monkeypatch, personalization="local")
    assert all(r["bytes_push"] == 0 for r in result["rounds"])
    init = ModelSpec("digits-cnn", 10).initial_model(SMALL["seed"])
    assert all(torch.equal(t, init.state_dict()[n]) for n, t in fed.global_tensors.items())
    config = SimulationConfig(**{**SMALL, "personalization": "local"}).train_config(device="cpu")
    for vc in clients:  # the oracle: no server, no codec, the client's model trained round after round
        model = copy.deepcopy(init)
        for r in (1, 2):
            local_update(model, vc.train, config, seed=derive_seed(SMALL["seed"], r, vc.client_id))
        for name, tensor in model.state_dict().items():
            assert torch.equal(vc.state.personal_model[name], tensor), (vc.client_id, name)


def test_baselines_that_keep_the_global_update_leave_it_bit_identical(monkeypatch) -> None:
    plain, _, _ = _run(monkeypatch)
    for method in ("ft", "ditto"):
        other, _, _ = _run(monkeypatch, personalization=method, personal_epochs=2)
        assert [r["test_accuracy"] for r in other["rounds"]] == [r["test_accuracy"] for r in plain["rounds"]]
        assert [r["bytes_up"] for r in other["rounds"]] == [r["bytes_up"] for r in plain["rounds"]]
        assert all(r["personalized_accuracy"] is not None for r in other["rounds"])
    assert "personalized_accuracy" not in plain["rounds"][0]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(personalization="fedper", strategy="scaffold", atom_lr="shared"), "carries client state"),
        (dict(personalization="ditto", factorization="atoms", personal_atoms=True), "not both"),
        (dict(personalization="fedbn"), "personalization must be one of"),
        (dict(personalization="fedrep", head_epochs=0), "head_epochs"),
        (dict(personalization="ditto", ditto_lambda=-1.0), "ditto_lambda"),
    ],
)
def test_a_personalization_that_cannot_compose_is_refused_at_start(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        SimulationConfig(**{**SMALL, **kw})


def test_lg_fedavg_keeps_a_resnet_body_with_its_bn_statistics_on_the_device(tmp_path) -> None:
    """A user's shapes: 3-channel images, BatchNorm with its 0-d counters, in the personal body."""
    spec = ModelSpec("resnet18", 10)
    model = spec.initial_model(0)
    state = ClientState("c0", 1.0)
    state.receive({n: (t.clone(), 0) for n, t in model.state_dict().items()})

    class Images:
        x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        y = torch.arange(8) % 10

        def __len__(self) -> int:
            return 8

    body = tuple(n for n in spec.names if not n.startswith("head."))
    config = TrainConfig(personalization="lg", batch_size=4, lr=0.01, device="cpu")
    task = TrainTask(1, ("head.weight", "head.bias"), config, False, seed=3, local=body)
    push = run_task(state, spec, task, Images())
    assert set(push.tensors) == {"head.weight", "head.bias"}  # only the global head travels
    kept = state.personal_model
    assert kept is not None and set(kept) == set(body) and state.local == {}
    assert kept["bn1.num_batches_tracked"].shape == () and int(kept["bn1.num_batches_tracked"]) == 2
    state.save(tmp_path)
    loaded = ClientState.load(tmp_path)
    assert loaded is not None and loaded.last_config == config.to_dict() and loaded.last_seed == 3
    for name, tensor in kept.items():
        assert torch.equal(loaded.personal_model[name], tensor), name
