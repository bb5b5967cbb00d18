"""The local update: determinism, FedProx, SCAFFOLD, Frobenius decay, personal atoms, evaluation."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aggregator_service.updates import ClientUpdate
from fedcore.layers import AtomConv2d, reconstruct_filter
from fedcore.models import build_model
from fedcore.training import (
    EvalResult,
    LocalResult,
    TrainConfig,
    atom_names,
    evaluate,
    factor_pairs,
    local_update,
    personalized_model,
    resolve_device,
    train_personal_atoms,
)

CPU = "cpu"


@dataclass
class Toy:
    x: Tensor
    y: Tensor

    def __len__(self) -> int:
        return len(self.y)


def blobs(n: int = 64, classes: int = 4, seed: int = 0, noise: float = 0.3) -> Toy:
    """8×8 single-channel images; class c lights up its own 4×4 quadrant (linearly separable)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    x = noise * torch.randn(n, 1, 8, 8, generator=g)
    for c in range(classes):
        r, col = divmod(c, 2)
        x[y == c, 0, 4 * r : 4 * r + 4, 4 * col : 4 * col + 4] += 1.0
    return Toy(x, y)


def linear_model(seed: int = 0, classes: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, classes))


def digits(factorization: str = "none", rank_ratio: float = 1.0, seed: int = 0, classes: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return build_model("digits-cnn", classes, factorization, rank_ratio=rank_ratio)


def cfg(**kw: object) -> TrainConfig:
    return TrainConfig(**{"device": CPU, "batch_size": 16, "lr": 0.05, **kw})  # type: ignore[arg-type]


def assert_same(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def params_of(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- determinism


def test_same_seed_bit_identical_with_every_term_and_global_rng_untouched() -> None:
    data = blobs(32)
    model = digits("atoms")
    base = {n: torch.full_like(p, 0.01) for n, p in model.named_parameters()}
    atoms = {n: model.state_dict()[n].clone() for n in atom_names(model)}
    config = cfg(prox_mu=0.1, frobenius_decay=0.01, weight_decay=1e-4, personal_epochs=1)

    def run(seed: int) -> LocalResult:
        m = copy.deepcopy(model)
        return local_update(m, data, config, seed=seed, server_control=base, personal_atoms=atoms)

    state = torch.random.get_rng_state()
    a, b, c = run(7), run(7), run(8)
    assert torch.equal(torch.random.get_rng_state(), state)
    for field in ("tensors", "control_delta", "personal_atoms"):
        assert_same(getattr(a, field), getattr(b, field))
    assert a.strategy_state is not None and b.strategy_state is not None
    assert_same(a.strategy_state["control"], b.strategy_state["control"])
    assert any(not torch.equal(a.tensors[k], c.tensors[k]) for k in a.tensors)
    assert a.personal_atoms is not None and c.personal_atoms is not None
    assert any(not torch.equal(a.personal_atoms[k], c.personal_atoms[k]) for k in a.personal_atoms)


def test_dropout_is_seeded() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))
    data = blobs(32)
    a = local_update(copy.deepcopy(model), data, cfg(), seed=3)
    b = local_update(copy.deepcopy(model), data, cfg(), seed=3)
    assert_same(a.tensors, b.tensors)


def test_cpu_seeding_draws_what_torch_manual_seed_draws() -> None:
    """On CPU only the CPU generator is seeded (torch.manual_seed also queues accelerator seeds, slowly):
    the draws, and so every seeded result, stay those of torch.manual_seed."""
    from fedcore.training.loop import seeded as _seeded

    with _seeded(5, torch.device("cpu")):
        fast = torch.rand(8), torch.randperm(10)
    torch.manual_seed(5)
    assert torch.equal(fast[0], torch.rand(8)) and torch.equal(fast[1], torch.randperm(10))


# --------------------------------------------------------------------------- learning and evaluation


def test_training_learns_a_separable_problem() -> None:
    train, test = blobs(64, seed=0), blobs(64, seed=1)
    model = digits()
    before = evaluate(model, test, device=CPU)
    result = local_update(model, train, cfg(local_epochs=4), seed=0)
    after = evaluate(model, test, device=CPU)
    assert after.loss < 0.5 * before.loss
    assert after.accuracy >= 0.95
    assert result.num_samples == 64
    assert result.metrics["steps"] == 4 * 4
    assert result.metrics["train_accuracy"] >= 0.9
    assert set(result.metrics) >= {"train_loss", "train_accuracy", "steps", "seconds"}
    assert result.strategy_state is None and result.personal_atoms is None


def test_evaluate_matches_manual_computation_and_restores_mode() -> None:
    model = linear_model(1)
    data = blobs(5, seed=2)
    logits = model(data.x)
    expected_loss = F.cross_entropy(logits, data.y).item()
    expected_acc = (logits.argmax(1) == data.y).float().mean().item()
    model.train()
    r = evaluate(model, data, batch_size=2, device=CPU)
    assert isinstance(r, EvalResult) and r.num_samples == 5
    assert r.accuracy == pytest.approx(expected_acc)
    assert r.loss == pytest.approx(expected_loss, rel=1e-6)
    assert model.training
    model.eval()
    evaluate(model, data, device=CPU)
    assert not model.training
    with pytest.raises(ValueError, match="empty"):
        evaluate(model, Toy(torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long)), device=CPU)


def test_returned_tensors_are_cpu_copies_with_bn_buffers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 36, 4))
    result = local_update(model, blobs(32), cfg(), seed=0)
    assert set(result.tensors) == set(model.state_dict())
    assert not torch.equal(result.tensors["1.running_mean"], torch.zeros(4))
    assert result.tensors["1.num_batches_tracked"].item() == 2
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in result.tensors.values())
    snapshot = result.tensors["3.weight"].clone()
    with torch.no_grad():
        model.get_submodule("3").get_parameter("weight").add_(1.0)  # the result must not alias the model
    assert torch.equal(result.tensors["3.weight"], snapshot)


# --------------------------------------------------------------------------- FedProx


def reference_sgd(model: nn.Module, data: Toy, config: TrainConfig, seed: int) -> dict[str, Tensor]:
    """Plain minibatch SGD written out independently of fedcore.training."""
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    g = torch.Generator().manual_seed(seed)
    for _ in range(config.local_epochs):
        order = torch.randperm(len(data), generator=g)
        for s in range(0, len(data), config.batch_size):
            idx = order[s : s + config.batch_size]
            opt.zero_grad()
            F.cross_entropy(model(data.x[idx]), data.y[idx]).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fedprox_zero_is_plain_sgd_and_positive_mu_stays_closer() -> None:
    data, model = blobs(40), linear_model()
    config = cfg(local_epochs=2)
    plain = reference_sgd(copy.deepcopy(model), data, config, seed=5)
    zero = local_update(copy.deepcopy(model), data, config, seed=5).tensors
    assert_same(zero, plain)
    prox = local_update(copy.deepcopy(model), data, cfg(local_epochs=2, prox_mu=5.0), seed=5).tensors
    start = model.state_dict()

    def dist(t: dict[str, Tensor]) -> float:
        return sum(float((t[k] - start[k]).pow(2).sum()) for k in start)

    assert 0 < dist(prox) < 0.7 * dist(zero)


# --------------------------------------------------------------------------- SCAFFOLD


def test_scaffold_with_zero_controls_is_plain_sgd() -> None:
    data, model = blobs(40), linear_model()
    config = cfg(local_epochs=2)
    zeros = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    plain = local_update(copy.deepcopy(model), data, config, seed=2)
    scaf = local_update(
        copy.deepcopy(model), data, config, seed=2, server_control=zeros, client_state={"control": zeros}
    )
    assert_same(scaf.tensors, plain.tensors)
    assert scaf.strategy_state is not None and scaf.control_delta is not None
    control = scaf.strategy_state["control"]
    assert set(control) == {"1.weight", "1.bias"}
    assert int(scaf.metrics["steps"]) == 2 * 3
    for n in control:
        torch.testing.assert_close(scaf.control_delta[n], control[n])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_scaffold_client_control_is_the_gradient_at_the_start_whatever_the_momentum(momentum: float) -> None:
    """Option II's c_i⁺ estimates ∇f_i(x): with full-batch steps too small to move far, it is that gradient.

    The oracle is autograd's full-batch gradient at the start; under momentum 0.9 and K = 30 steps the
    old ``(x − y)/(K·η)`` read 8.7× too large (and SCAFFOLD diverged, issue 21).
    """
    toy, model = blobs(24, seed=5), linear_model(seed=1).double()  # float64: the steps are tiny
    data = Toy(toy.x.double(), toy.y)
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(data.x), data.y).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    c = {n: 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in model.named_parameters()}
    ci = {n: 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in model.named_parameters()}
    config = cfg(lr=1e-9, momentum=momentum, batch_size=len(data), local_epochs=30)
    r = local_update(model, data, config, seed=0, server_control=c, client_state={"control": ci})
    assert r.metrics["steps"] == 30 and r.strategy_state is not None
    for n, g in grads.items():
        assert g is not None
        torch.testing.assert_close(r.strategy_state["control"][n], g, rtol=1e-4, atol=1e-6)


class Logit(nn.Module):
    """Logits ``[w, 0]`` with one scalar ``w``: cross-entropy's gradient is ``σ(w) − 1`` for label 0, ``σ(w)`` for 1."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.w.expand(len(x), 1), torch.zeros(len(x), 1)], dim=1)


def test_scaffold_two_clients_two_momentum_steps_by_hand() -> None:
    """One SCAFFOLD round (option II) of two one-sample clients, K = 2 steps at η = β = 0.5, derived by hand.

    With correction ``d = c − c_i`` the heavy-ball steps are ``v₁ = g₁ + d``, ``w₁ = −η v₁``,
    ``v₂ = β v₁ + g₂ + d``, ``w₂ = w₁ − η v₂``; step 1's gradient moves ``w`` by ``η(1 + β)`` in all
    and step 2's by ``η``, so ``c_i⁺ = ((1 + β) g₁ + g₂)/(2 + β)`` — the clients' own gradients,
    whatever ``d``. The server then takes ``x ← mean y_i`` and ``c ← c + |S|/N · mean Δc_i``.
    """
    from aggregator_service.strategies import Scaffold
    from fedcore.spec import ModelSpec

    eta = beta = 0.5
    c = 0.1
    clients = {"a": (0, 0.3), "b": (1, -0.1)}  # label, c_i
    config = cfg(lr=eta, momentum=beta, batch_size=1, local_epochs=2)
    y, c_new = {}, {}
    for cid, (label, c_i) in clients.items():
        data = Toy(torch.zeros(1, 1, 1, 1), torch.tensor([label]))
        r = local_update(
            Logit(),
            data,
            config,
            seed=0,
            server_control={"w": torch.tensor([c])},
            client_state={"control": {"w": torch.tensor([c_i])}},
        )
        assert r.metrics["steps"] == 2 and r.strategy_state is not None and r.control_delta is not None
        control = r.strategy_state["control"]
        sigma = lambda w: 1 / (1 + math.exp(-w))  # noqa: E731
        d = c - c_i
        g1 = sigma(0.0) - (1 - label)
        v1 = g1 + d
        w1 = -eta * v1
        g2 = sigma(w1) - (1 - label)
        w2 = w1 - eta * (beta * v1 + g2 + d)
        assert float(r.tensors["w"]) == pytest.approx(w2, abs=1e-6)
        assert float(control["w"]) == pytest.approx(((1 + beta) * g1 + g2) / (2 + beta), abs=1e-6)
        assert float(r.control_delta["w"]) == pytest.approx(float(control["w"]) - c_i, abs=1e-6)
        y[cid], c_new[cid] = w2, float(control["w"])
    # the server's half, on a one-parameter layer of a real model filled with these scalars
    spec = ModelSpec("digits-cnn", 10, "none")
    name = "head.bias"
    server = Scaffold(num_clients_total=4, spec=spec)
    server._controls = {name: torch.full((10,), c)}
    acc = server.begin({name: torch.zeros(10)}, [name])
    for cid, (_, c_i) in clients.items():
        server.fold(
            acc,
            ClientUpdate(
                cid, 1, 1.0, spec, {name: torch.full((10,), y[cid])}, {name: torch.full((10,), c_new[cid] - c_i)}
            ),
        )
    result = server.finish(acc, {name: torch.zeros(10)})
    expected_c = c + (2 / 4) * ((c_new["a"] - 0.3) + (c_new["b"] + 0.1)) / 2
    torch.testing.assert_close(result.tensors[name], torch.full((10,), (y["a"] + y["b"]) / 2))
    torch.testing.assert_close(server.server_control(spec)[name], torch.full((10,), expected_c))


class WithUnused(nn.Module):
    """A linear classifier plus a parameter the loss never sees (its gradient is exactly the correction)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(64, 4)
        self.unused = nn.Parameter(torch.zeros(3))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x.flatten(1))


def test_scaffold_correction_matches_hand_computed_step() -> None:
    data, model = blobs(12, seed=3), WithUnused()
    lr = 0.1
    config = cfg(lr=lr, momentum=0.0, batch_size=len(data))  # one full-batch step: K = 1
    c = {n: torch.full_like(p, 0.3) for n, p in model.named_parameters()}
    ci = {n: torch.full_like(p, -0.2) for n, p in model.named_parameters()}
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(data.x), data.y).backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in ref.named_parameters()}
    start = params_of(model)

    r = local_update(model, data, config, seed=0, server_control=c, client_state={"control": ci})
    assert r.metrics["steps"] == 1
    assert r.strategy_state is not None and r.control_delta is not None
    for n in start:
        expected = start[n] - lr * (grads[n] + c[n] - ci[n])
        torch.testing.assert_close(r.tensors[n], expected, rtol=1e-5, atol=1e-6)
        # option II after one step: c_i⁺ = c_i − c + (g + c − c_i) = g
        control = r.strategy_state["control"]
        torch.testing.assert_close(control[n], grads[n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(r.control_delta[n], control[n] - ci[n])
    # the correction moves against c − c_i = 0.5 on the parameter the loss ignores
    assert torch.allclose(r.tensors["unused"], torch.full((3,), -lr * 0.5))

    # several momentum-free steps on the unused parameter: exactly K·lr·(c − c_i)
    r3 = local_update(WithUnused(), data, cfg(lr=lr, momentum=0.0, batch_size=5), seed=0, server_control=c)
    assert r3.metrics["steps"] == 3
    torch.testing.assert_close(r3.tensors["unused"], torch.full((3,), -3 * lr * 0.3))


def test_scaffold_control_validation() -> None:
    data, model = blobs(8), linear_model()
    zeros = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="missing"):
        local_update(model, data, cfg(), seed=0, server_control={"1.weight": zeros["1.weight"]})
    with pytest.raises(ValueError, match="shape"):
        local_update(model, data, cfg(), seed=0, server_control={**zeros, "1.bias": torch.zeros(7)})
    with pytest.raises(ValueError, match="not kept by these terms"):
        local_update(model, data, cfg(), seed=0, client_state={"control": zeros})
    with pytest.raises(ValueError, match="non-finite"):
        local_update(model, data, cfg(), seed=0, server_control={**zeros, "1.bias": torch.full((4,), math.nan)})


# --------------------------------------------------------------------------- Frobenius decay


@pytest.mark.parametrize(
    ("factorization", "pairs"), [("lowrank", ["conv2", "fc1"]), ("atoms-lowrank", ["conv2", "fc1"])]
)
def test_frobenius_decay_shrinks_low_rank_products(factorization: str, pairs: list[str]) -> None:
    model = digits(factorization, rank_ratio=0.25)
    assert [name for name, _, _ in factor_pairs(model)] == pairs
    data = blobs(32)

    def norms(lam: float) -> list[float]:
        m = copy.deepcopy(model)
        local_update(m, data, cfg(frobenius_decay=lam, lr=0.02), seed=0)
        return [float((u @ v).detach().norm()) for _, u, v in factor_pairs(m)]

    plain, decayed = norms(0.0), norms(2.0)
    assert all(d < p for d, p in zip(decayed, plain, strict=True))


def test_frobenius_decay_is_a_no_op_without_factors() -> None:
    data, model = blobs(16), linear_model()
    a = local_update(copy.deepcopy(model), data, cfg(), seed=0)
    b = local_update(copy.deepcopy(model), data, cfg(frobenius_decay=1.0), seed=0)
    assert_same(a.tensors, b.tensors)


# --------------------------------------------------------------------------- personal atoms


def test_personal_phase_trains_only_atoms() -> None:
    data, model = blobs(32), digits("atoms")
    received = params_of(model)
    own = {n: received[n] + 0.05 for n in atom_names(model)}
    own_before = {n: t.clone() for n, t in own.items()}
    personal, metrics = train_personal_atoms(model, data, cfg(personal_epochs=2), own, seed=0)
    assert metrics["personal_steps"] == 4
    trained = params_of(personal)
    assert set(atom_names(model)) == {"conv1.atoms", "conv2.atoms"}
    for n, t in trained.items():
        if n.endswith(".atoms"):
            assert not torch.equal(t, own[n]), n
        else:
            assert torch.equal(t, received[n]), n  # global coefficients, biases, head frozen
    assert_same(params_of(model), received)  # the received model is untouched
    assert_same(own, own_before)  # and so are the caller's atoms


def test_personalization_does_not_perturb_the_global_update() -> None:
    data, model = blobs(32), digits("atoms")
    own = {n: model.state_dict()[n].clone() for n in atom_names(model)}  # a new client: copies of the globals
    config = cfg(prox_mu=0.01)
    plain = local_update(copy.deepcopy(model), data, config, seed=4)
    both = local_update(copy.deepcopy(model), data, config, seed=4, personal_atoms=own)
    assert_same(both.tensors, plain.tensors)
    assert both.personal_atoms is not None and set(both.personal_atoms) == set(own)
    assert all(not torch.equal(both.personal_atoms[n], own[n]) for n in own)
    assert "personal_train_loss" in both.metrics
    # the returned atoms are the personal phase's
    personal, _ = train_personal_atoms(copy.deepcopy(model), data, config, own, seed=4)
    assert_same(both.personal_atoms, {n: personal.state_dict()[n] for n in own})


def test_personalized_model_is_global_coefficients_times_personal_atoms() -> None:
    model = digits("atoms")
    own = {n: torch.randn_like(model.state_dict()[n]) for n in atom_names(model)}
    personal = personalized_model(model, own)
    conv2, personal_conv2 = model.get_submodule("conv2"), personal.get_submodule("conv2")
    assert isinstance(conv2, AtomConv2d) and isinstance(personal_conv2, AtomConv2d)
    expected = reconstruct_filter(conv2.coefficients, own["conv2.atoms"])
    torch.testing.assert_close(personal_conv2.weight, expected)
    assert not torch.equal(conv2.atoms, own["conv2.atoms"])  # the global model keeps its atoms
    x = blobs(4).x
    assert personal(x).shape == (4, 4)


def test_personal_atoms_errors() -> None:
    data = blobs(8)
    with pytest.raises(ValueError, match="AtomConv2d"):
        local_update(digits(), data, cfg(), seed=0, personal_atoms={"conv2.atoms": torch.zeros(9, 3, 3)})
    model = digits("atoms")
    with pytest.raises(ValueError, match="exactly"):
        local_update(model, data, cfg(), seed=0, personal_atoms={"conv2.atoms": torch.zeros(9, 3, 3)})
    bad = {n: torch.zeros(5, 3, 3) for n in atom_names(model)}
    with pytest.raises(ValueError, match="shape"):
        personalized_model(model, bad)


# --------------------------------------------------------------------------- configuration


def test_train_config_json_round_trip() -> None:
    config = TrainConfig(local_epochs=3, batch_size=8, lr=0.1, prox_mu=0.01, frobenius_decay=1e-4, personal_epochs=2)
    assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert TrainConfig().effective_personal_epochs == 1
    assert config.effective_personal_epochs == 2
    with pytest.raises(ValueError, match="unknown TrainConfig fields: epochs"):
        TrainConfig.from_dict({"epochs": 2})


@pytest.mark.parametrize(
    "bad",
    [
        {"local_epochs": 0},
        {"local_epochs": 1.5},
        {"local_epochs": True},
        {"batch_size": 0},
        {"lr": 0.0},
        {"lr": float("nan")},
        {"lr": "0.1"},
        {"momentum": 1.0},
        {"weight_decay": -1e-4},
        {"prox_mu": -0.1},
        {"frobenius_decay": -1.0},
        {"personal_epochs": 0},
        {"device": ""},
    ],
)
def test_train_config_validation(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        TrainConfig(**bad)


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("abacus")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_empty_or_mismatched_data_is_rejected() -> None:
    model = linear_model()
    with pytest.raises(ValueError, match="empty"):
        local_update(model, Toy(torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long)), cfg(), seed=0)
    with pytest.raises(ValueError, match="labels"):
        local_update(model, Toy(torch.zeros(3, 1, 8, 8), torch.zeros(2, dtype=torch.long)), cfg(), seed=0)


def test_scale_move_scales_only_the_steps_that_follow_the_move() -> None:
    """FedDyn's and FedDC's steps are linear in the move, so a move folded at half its length is half the step;
    SCAFFOLD's c_i moves by the Δc_i it pushed, which the server folds as sent."""
    from fedcore.training.terms import scale_move

    before = {"gradient": {"w": torch.tensor([1.0, 2.0])}, "control": {"w": torch.tensor([5.0])}}
    after = {
        "gradient": {"w": torch.tensor([3.0, -6.0])},
        "drift": {"w": torch.tensor([4.0, 8.0])},  # none held before: the step is the value
        "control": {"w": torch.tensor([9.0])},
    }
    out = scale_move(before, after, 0.5)
    assert torch.equal(out["gradient"]["w"], torch.tensor([2.0, -2.0]))
    assert torch.equal(out["drift"]["w"], torch.tensor([2.0, 4.0]))
    assert torch.equal(out["control"]["w"], torch.tensor([9.0]))
    assert torch.equal(after["gradient"]["w"], torch.tensor([3.0, -6.0]))  # the input is left as it was


class _Streamed(torch.utils.data.Dataset):
    """A user's Dataset: items read one at a time, no ``x``/``y``/``targets`` to check ahead."""

    def __init__(self, data: Toy) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data.x[i], self.data.y[i]


@pytest.mark.parametrize("streamed", [False, True], ids=["in-memory", "streamed"])
@pytest.mark.parametrize("factorization", ["none", "atoms-lowrank"])
def test_labels_the_model_cannot_score_are_refused_in_words(streamed: bool, factorization: str) -> None:
    """Cross-entropy failed on the index (IndexError; on CUDA a device-side assert that ends the process)."""
    rank = 0.5 if factorization == "atoms-lowrank" else 1.0
    data = blobs(32, classes=4)
    past = Toy(data.x, torch.where(torch.arange(32) == 17, 6, data.y))
    wrap = _Streamed if streamed else (lambda d: d)
    with pytest.raises(ValueError, match=r"the data has label 6 but the model has 4 classes \(labels 0..3\)"):
        local_update(digits(factorization, rank), wrap(past), cfg(), seed=0)
    with pytest.raises(ValueError, match=r"the data has label 6 but the model has 4 classes"):
        evaluate(digits(factorization, rank), wrap(past), device=CPU)
    negative = Toy(data.x, torch.where(torch.arange(32) == 3, -1, data.y))
    with pytest.raises(ValueError, match=r"dataset label -1 is negative"):
        local_update(digits(factorization, rank), wrap(negative), cfg(), seed=0)
    fractional = Toy(data.x, data.y.float())
    with pytest.raises(ValueError, match=r"dataset labels are torch.float32 .*one integer class index"):
        local_update(digits(factorization, rank), wrap(fractional), cfg(), seed=0)
    assert local_update(digits(factorization, rank), wrap(data), cfg(), seed=0).num_samples == 32  # the same, fine


@pytest.mark.parametrize("factorization", ["none", "atoms", "atoms-lowrank", "lowrank"])
@pytest.mark.parametrize("atom_lr", ["preconditioned", "scaled"])
def test_a_nan_in_the_inputs_gives_a_non_finite_update_whatever_the_factorization(
    factorization: str, atom_lr: str
) -> None:
    """The agent reports a non-finite update as diverged training (exit 5); with atoms the per-step rates once
    failed first, in ``eigvalsh`` on the non-finite coefficients (LinAlgError, a traceback)."""
    data = blobs(32, classes=4)
    data.x[:, 0, 2, 2] = float("nan")  # a dead pixel in every image: the first step's factors are NaN
    rank = 0.5 if "lowrank" in factorization else 1.0
    result = local_update(digits(factorization, rank), data, cfg(atom_lr=atom_lr), seed=0)
    assert not all(bool(torch.isfinite(t).all()) for t in result.tensors.values())
