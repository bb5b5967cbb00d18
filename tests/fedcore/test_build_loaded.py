"""ModelSpec.build_loaded: the model a client loads its tensors into, built on the meta device and allocated empty.

The oracle is the build it replaces, written out here: ``spec.build()`` (the plain model initialized, then
factorized) and ``load_state_dict``. Both must give the same tensors and bit-identical outputs and gradients,
BatchNorm's buffers (its 0-d ``num_batches_tracked``) included; a value the state does not carry (a buffer
registered with ``persistent=False``) must be its ``__init__``'s, and a state short of a tensor is refused.
"""

from __future__ import annotations

import logging
import re
import textwrap

import pytest
import torch

from fedcore.spec import ModelSpec

USER_NETS = textwrap.dedent(
    """
    import torch
    from torch import nn


    class PositionalCNN(nn.Module):
        '''A conv whose input gets a positional table computed in __init__, kept out of the state dict.'''

        def __init__(self, num_classes=10):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.head = nn.Linear(8, num_classes)
            table = torch.arange(3 * 8 * 8, dtype=torch.float32).reshape(1, 3, 8, 8) / 100.0 + 1.0
            self.register_buffer("positions", table, persistent=False)

        def forward(self, x):
            h = torch.relu(self.bn(self.conv(x + self.positions)))
            return self.head(h.mean(dim=(2, 3)))


    class TiedCNN(nn.Module):
        '''Two linears sharing one weight: the tie must survive the allocation.'''

        def __init__(self, num_classes=10):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.b.weight = self.a.weight
            self.head = nn.Linear(8, num_classes)

        def forward(self, x):
            h = torch.relu(self.conv(x)).mean(dim=(2, 3))
            return self.head(self.b(torch.relu(self.a(h))))


    class ListedScales(nn.Module):
        '''Scales kept in a list attribute, the head's weight again in a dict: neither is in the state dict.'''

        def __init__(self, num_classes=10):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.head = nn.Linear(8, num_classes)
            self.scales = [torch.full((1, 8, 1, 1), 2.0)]
            self.refs = {"first": [self.head.weight]}

        def forward(self, x):
            h = torch.relu(self.conv(x) * self.refs["first"][0].mean()) * self.scales[0]
            return self.head(h.mean(dim=(2, 3)))


    class Recurrent(nn.Module):
        '''An LSTM over a sequence of feature vectors: nn.LSTM keeps its weights in a list attribute too.'''

        def __init__(self, num_classes=10):
            super().__init__()
            self.rnn = nn.LSTM(3, 8, batch_first=True)
            self.head = nn.Linear(8, num_classes)

        def forward(self, x):
            out, _ = self.rnn(x)
            return self.head(out[:, -1])


    BUILDS = []


    class CountedCNN(nn.Module):
        '''Records the device each of its builds runs on; ``persistent=False`` keeps its offset out of the state.'''

        def __init__(self, num_classes=10, persistent=True):
            super().__init__()
            BUILDS.append(torch.empty(0).device.type)
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.head = nn.Linear(8, num_classes)
            self.register_buffer("offset", torch.ones(1, 3, 1, 1), persistent=persistent)

        def forward(self, x):
            return self.head(torch.relu(self.conv(x + self.offset)).mean(dim=(2, 3)))


    def sized_by_values(num_classes=10):
        '''Widths read off a tensor, as torchvision's RegNets do: the meta device cannot answer.'''
        width = int(torch.tensor([4.0, 8.0]).sum().item())
        pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        return nn.Sequential(nn.Conv2d(3, width, 3), pool, nn.Linear(width, num_classes))
    """
)


@pytest.fixture
def user_nets(tmp_path, monkeypatch):
    (tmp_path / "build_loaded_nets.py").write_text(USER_NETS)
    monkeypatch.syspath_prepend(str(tmp_path))


def fetched_state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Tensors as a client receives them: the round-0 model with every BatchNorm statistic moved off its default."""
    state = {n: t.clone() for n, t in spec.initial_model(seed).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if name.endswith("num_batches_tracked"):
            state[name] = torch.tensor(7 + seed)
        elif name.endswith(("running_mean", "running_var")):
            state[name] = t + torch.rand(t.shape, generator=gen)
    return state


def old_build(spec: ModelSpec, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = spec.build()
    model.load_state_dict(state)
    return model


def assert_same_function(spec: ModelSpec, old: torch.nn.Module, new: torch.nn.Module, seed: int = 0) -> None:
    old_state, new_state = old.state_dict(), new.state_dict()
    assert list(new_state) == list(old_state)
    for name, t in old_state.items():
        assert new_state[name].dtype == t.dtype and new_state[name].shape == t.shape, name
        assert torch.equal(new_state[name], t), name
    assert [(n, p.requires_grad) for n, p in new.named_parameters()] == [
        (n, p.requires_grad) for n, p in old.named_parameters()
    ]
    x = torch.randn(4, *spec.input_shape, generator=torch.Generator().manual_seed(seed))  # type: ignore[misc]
    old.eval(), new.eval()
    with torch.no_grad():
        assert torch.equal(new(x), old(x))
    old.train(), new.train()  # batch statistics, the running ones updated, and the gradients
    for model in (old, new):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # the same dropout masks
            model(x).square().sum().backward()
    for (name, p), (_, q) in zip(old.named_parameters(), new.named_parameters(), strict=True):
        assert torch.equal(q.grad, p.grad), name
    for (name, b), (_, c) in zip(old.named_buffers(), new.named_buffers(), strict=True):
        assert torch.equal(c, b), name


@pytest.mark.parametrize(
    "spec",
    [
        ModelSpec("lenet-cifar10", 10, "atoms"),
        ModelSpec("lenet-cifar10", 10, "atoms-lowrank", rank_ratio=0.125),
        ModelSpec("resnet18", 10, "atoms"),
        ModelSpec("resnet18", 10, "atoms", rank_ratio=0.125),
        ModelSpec("resnet18", 10, "atoms-lowrank"),
        ModelSpec("resnet18", 10, "atoms-lowrank", rank_ratio=0.125),
        ModelSpec("resnet18", 10, "lowrank", rank_ratio=0.125),
    ],
    ids=lambda s: s.describe(),
)
def test_the_lean_build_computes_what_the_whole_build_does(spec: ModelSpec) -> None:
    state = fetched_state(spec, seed=3)
    old = old_build(spec, state)
    rng = torch.get_rng_state()
    new = spec.build_loaded(state)
    # nothing drawn: the model was not initialized before its tensors were loaded (the whole build draws)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(t.device.type == "cpu" for t in new.state_dict().values())
    if "resnet18" in spec.model:
        tracked = new.state_dict()["bn1.num_batches_tracked"]
        assert tracked.shape == () and tracked.dtype == torch.int64 and int(tracked) == 10
    assert_same_function(spec, old, new)
    # copies, not the held tensors themselves: training in place must not change what the client holds
    assert not any(t.data_ptr() == state[name].data_ptr() for name, t in new.state_dict().items())


def test_a_non_persistent_buffer_keeps_its_init_value_on_the_whole_build(user_nets, caplog) -> None:
    spec = ModelSpec("build_loaded_nets:PositionalCNN", 10, "atoms", input_shape=(3, 8, 8))
    assert "positions" not in spec.names  # not part of what the server sends
    state = fetched_state(spec, seed=1)
    expected = torch.arange(3 * 8 * 8, dtype=torch.float32).reshape(1, 3, 8, 8) / 100.0 + 1.0
    with caplog.at_level(logging.INFO, logger="fedcore.spec"):
        new = spec.build_loaded(state)
        spec.build_loaded(state)
    assert torch.equal(new.positions, expected)
    said = [r.getMessage() for r in caplog.records if "built whole" in r.getMessage()]
    assert len(said) == 1 and "positions" in said[0] and "persistent=False" in said[0]  # once per spec
    assert_same_function(spec, old_build(spec, state), new)


@pytest.mark.parametrize("factorization", ["none", "atoms"])
def test_tensors_held_in_containers_keep_the_whole_build(user_nets, caplog, factorization: str) -> None:
    """A list of scales and a dict holding a parameter: on the lean build they stayed on the meta device (the
    first forward failed) or pointed at the meta parameters, so the model keeps the whole build."""
    spec = ModelSpec("build_loaded_nets:ListedScales", 10, factorization, input_shape=(3, 8, 8))
    state = fetched_state(spec, seed=5)
    with caplog.at_level(logging.INFO, logger="fedcore.spec"):
        new = spec.build_loaded(state)
    said = [r.getMessage() for r in caplog.records if "built whole" in r.getMessage()]
    assert len(said) == 1 and "['refs', 'scales']" in said[0]
    assert torch.equal(new.scales[0], torch.full((1, 8, 1, 1), 2.0))
    assert_same_function(spec, old_build(spec, state), new)


def test_a_builder_reading_values_keeps_the_whole_build(user_nets, caplog) -> None:
    spec = ModelSpec("build_loaded_nets:sized_by_values", 10, "atoms", input_shape=(3, 8, 8))
    state = fetched_state(spec, seed=2)
    with caplog.at_level(logging.INFO, logger="fedcore.spec"):
        new = spec.build_loaded(state)
    assert any("computes with tensor values" in r.getMessage() for r in caplog.records)
    assert_same_function(spec, old_build(spec, state), new)


@pytest.mark.parametrize(("persistent", "builds"), [(True, ["meta"] * 3), (False, ["meta"] + ["cpu"] * 3)])
def test_the_build_rule_is_decided_once_per_spec(user_nets, persistent: bool, builds: list[str]) -> None:
    """A round loads a model twice: only the first load of a spec may pay for deciding its way. A model built
    whole builds on the meta device that first time only; a lean one builds its fresh meta module and no more."""
    import build_loaded_nets

    spec = ModelSpec(
        "build_loaded_nets:CountedCNN", 10, "atoms", model_args={"persistent": persistent}, input_shape=(3, 8, 8)
    )
    state = fetched_state(spec, seed=6)
    build_loaded_nets.BUILDS.clear()
    models = [spec.build_loaded(state) for _ in range(3)]
    assert build_loaded_nets.BUILDS == builds
    assert len({id(m) for m in models}) == 3  # a fresh module each time
    assert_same_function(spec, old_build(spec, state), models[-1])


@pytest.mark.parametrize("factorization", ["none", "lowrank"])
def test_an_rnn_loads_lean_and_computes_with_its_loaded_weights(user_nets, caplog, factorization: str) -> None:
    """nn.LSTM lists its weights in ``_flat_weights``, which its own ``__setattr__`` keeps in step: no reason for
    the whole build, and the forward must read the loaded weights, not the meta ones."""
    spec = ModelSpec("build_loaded_nets:Recurrent", 10, factorization, input_shape=(5, 3))
    state = fetched_state(spec, seed=7)
    with caplog.at_level(logging.INFO, logger="fedcore.spec"):
        new = spec.build_loaded(state)
    assert not [r for r in caplog.records if "built whole" in r.getMessage()]
    assert all(w.device.type == "cpu" for w in new.rnn._flat_weights)
    assert_same_function(spec, old_build(spec, state), new)


def test_tied_parameters_stay_tied(user_nets) -> None:
    spec = ModelSpec("build_loaded_nets:TiedCNN", 10, input_shape=(3, 8, 8))
    state = fetched_state(spec, seed=4)
    new = spec.build_loaded(state)
    assert new.a.weight is new.b.weight
    assert_same_function(spec, old_build(spec, state), new)


@pytest.mark.parametrize("missing", ["layer3.1.bn2.num_batches_tracked", "layer2.0.conv1.coefficients_u", "head.bias"])
def test_a_state_lacking_a_tensor_is_refused(missing: str) -> None:
    spec = ModelSpec("resnet18", 10, "atoms-lowrank", rank_ratio=0.125)
    state = fetched_state(spec, seed=0)
    del state[missing]
    said = rf"lack 1 of its parameters and buffers \({re.escape(missing)}\): they would hold no value"
    with pytest.raises(ValueError, match=said):
        spec.build_loaded(state)


def test_a_state_lacking_a_tensor_is_refused_on_the_whole_build_too(user_nets) -> None:
    spec = ModelSpec("build_loaded_nets:PositionalCNN", 10, input_shape=(3, 8, 8))
    state = fetched_state(spec, seed=0)
    del state["bn.running_var"]
    with pytest.raises(ValueError, match=r"lack 1 of its parameters and buffers \(bn\.running_var\)"):
        spec.build_loaded(state)


def test_factorizing_a_meta_model_draws_no_values(monkeypatch) -> None:
    """A model moved to the meta device (a builder that cannot run there) is factorized there: its new layers
    are made on the meta device, not made and initialized on the CPU and then moved (a vgg11's 4096×25088
    linear at γ = 1/8 drew 15M numbers for nothing)."""
    import fedcore.layers
    from fedcore.convert import Factorization, factorize

    def refuse(*args, **kwargs):
        raise AssertionError("a value was drawn for a meta layer")

    plain = ModelSpec("lenet-cifar10", 10).build_plain().to("meta")
    monkeypatch.setattr(fedcore.layers, "orthonormal_atoms", refuse)
    monkeypatch.setattr(fedcore.layers, "_init_factor_pair", refuse)
    net = factorize(plain, Factorization("atoms-lowrank", rank_ratio=0.125))
    assert {t.device.type for t in net.state_dict().values()} == {"meta"}
    assert any(n.endswith("coefficients_u") for n in net.state_dict())
