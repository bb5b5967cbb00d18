"""Tests for aggregator_service.aggregation: streaming means, alignment, FedHM weights, SCAFFOLD, re-factorization.

References are computed here in batch, independently of the streaming code: weighted sums
over stacked client tensors, ``spec.to_full`` per client, ``spec.from_full`` per tier.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from aggregator_service.aggregation import (
    STRATEGIES,
    AggregateResult,
    ClientUpdate,
    FedAvg,
    FedProx,
    Scaffold,
    Strategy,
    WeightedMean,
    build_strategy,
    client_weight,
    refactorize,
)
from fedcore.spec import ModelSpec

TIERS = (1.0, 0.5, 0.25, 0.125)
LENET = ModelSpec("lenet-cifar10", 10, "atoms-lowrank")
DIGITS = ModelSpec("digits-cnn", 10, "none")


def random_tensors(spec: ModelSpec, gen: torch.Generator, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Random values for every tensor of ``spec`` (ints for integer tensors)."""
    out = {}
    for t in spec.tensors:
        torch_dtype = getattr(torch, t.dtype)
        if torch_dtype.is_floating_point:
            out[t.name] = torch.randn(t.shape, generator=gen, dtype=dtype or torch_dtype)
        else:
            out[t.name] = torch.randint(0, 1000, t.shape, generator=gen, dtype=torch_dtype)
    return out


def update(
    spec: ModelSpec, tensors: dict[str, Tensor], n: int, cid: str, control_delta: dict[str, Tensor] | None = None
) -> ClientUpdate:
    return ClientUpdate(cid, n, spec.rank_ratio, spec, tensors, control_delta)


def run_round(
    strategy: Strategy, global_tensors: dict[str, Tensor], updates: list[ClientUpdate], due: list[str] | None = None
) -> AggregateResult:
    acc = strategy.begin(global_tensors, list(global_tensors) if due is None else due)
    for u in updates:
        strategy.fold(acc, u)
    return strategy.finish(acc, global_tensors)


def batch_mean(xs: list[Tensor], weights: Sequence[float]) -> tuple[Tensor, float]:
    """Reference weighted mean and Σ p‖x − u‖², in float64 over the stacked tensors."""
    p = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    stack = torch.stack([x.to(torch.float64) for x in xs])
    u = torch.einsum("k,k...->...", p, stack)
    disp = float(p @ ((stack - u) ** 2).reshape(len(xs), -1).sum(1))
    return u, disp


# --------------------------------------------------------------------------- WeightedMean


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streaming_mean_equals_batch_for_every_role(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    k = rng.randint(1, 20)
    roles = {t.role for t in LENET.tensors}
    assert {"atoms", "coefficients", "body", "head"} <= roles
    clients = []
    for _ in range(k):
        tensors = random_tensors(LENET, gen, torch.float64)
        tensors["bn.running_mean"] = torch.randn(64, generator=gen, dtype=torch.float64)  # a float buffer
        tensors["bn.num_batches_tracked"] = torch.randint(0, 10_000, (), generator=gen)  # an int64 buffer
        clients.append(tensors)
    weights = [rng.uniform(0.1, 100.0) for _ in range(k)]
    wm = WeightedMean()
    for tensors, w in zip(clients, weights, strict=True):
        wm.add(tensors, w)
    assert wm.count == k and wm.total_weight == pytest.approx(sum(weights), rel=1e-14)
    means, dispersion = wm.mean(), wm.dispersion()
    assert set(means) == set(clients[0])
    for name in clients[0]:
        ref, ref_disp = batch_mean([c[name] for c in clients], weights)
        assert means[name].dtype == clients[0][name].dtype
        if name.endswith("num_batches_tracked"):
            assert means[name].item() == round(ref.item())
        else:
            torch.testing.assert_close(means[name], ref, rtol=1e-12, atol=1e-12)
        assert dispersion[name] == pytest.approx(ref_disp, rel=1e-10, abs=1e-12)


def test_float32_in_float32_out_and_missing_tensors_weighted_separately() -> None:
    wm = WeightedMean()
    wm.add({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}, 1.0)
    wm.add({"a": torch.tensor([3.0, 4.0])}, 3.0)  # "b" missing from this contribution
    wm.add({"flag": torch.tensor([True, False])}, 2.0)
    means = wm.mean()
    assert means["a"].dtype == torch.float32
    torch.testing.assert_close(means["a"], torch.tensor([2.5, 3.5]))
    torch.testing.assert_close(means["b"], torch.tensor([3.0]))  # only its own contributor
    assert means["flag"].dtype == torch.bool
    assert wm.weight("a") == 4.0 and wm.weight("b") == 1.0 and wm.total_weight == 6.0
    assert wm.dispersion()["a"] == pytest.approx(0.25 * 2 * (1.5**2) + 0.75 * 2 * (0.5**2))
    assert wm.dispersion()["b"] == 0.0


def test_weighted_mean_rejects_bad_input() -> None:
    wm = WeightedMean()
    with pytest.raises(ValueError, match="positive"):
        wm.add({"a": torch.zeros(2)}, 0.0)
    with pytest.raises(ValueError, match="positive"):
        wm.add({"a": torch.zeros(2)}, math.nan)
    wm.add({"a": torch.zeros(2), "b": torch.zeros(1)}, 1.0)
    with pytest.raises(ValueError, match="shape"):
        wm.add({"b": torch.ones(1), "a": torch.zeros(3)}, 1.0)
    assert wm.count == 1 and wm.weight("b") == 1.0 and wm.mean()["b"].item() == 0.0  # nothing was folded


# --------------------------------------------------------------------------- alignment and FedHM


def tier_models(spec: ModelSpec, tiers: list[float], seed: int) -> list[tuple[ModelSpec, dict[str, Tensor]]]:
    """Independently initialized client models for each tier, as a client would push them."""
    out = []
    for i, tier in enumerate(tiers):
        tier_spec = spec.at_tier(tier)
        torch.manual_seed(seed + i)
        out.append((tier_spec, tier_spec.build().state_dict()))
    return out


@pytest.mark.parametrize(
    "spec", [LENET, ModelSpec("digits-cnn", 10, "lowrank"), ModelSpec("digits-cnn", 10, "atoms-lowrank")]
)
def test_low_rank_updates_are_aligned_before_averaging(spec: ModelSpec) -> None:
    clients = tier_models(spec, [1.0, 0.25, 1.0, 0.25], seed=10)
    samples = [30, 50, 20, 70]
    global_tensors = {n: torch.zeros(t.shape) for n, t in ((t.name, t) for t in spec.full().tensors)}
    updates = [update(s, t, n, f"c{i}") for i, ((s, t), n) in enumerate(zip(clients, samples, strict=True))]
    result = run_round(FedAvg(), global_tensors, updates)
    assert any(t.full_name for t in spec.at_tier(0.25).tensors)  # really factorized
    aligned = [s.to_full(t) for s, t in clients]
    assert set(result.tensors) == set(global_tensors)
    for name in global_tensors:
        ref, disp = batch_mean([a[name] for a in aligned], samples)
        torch.testing.assert_close(result.tensors[name], ref.to(torch.float32), rtol=1e-5, atol=1e-6)
        assert result.dispersion[name] == pytest.approx(disp, rel=1e-6)
    assert result.weights == pytest.approx([n / sum(samples) for n in samples])
    assert result.num_clients == 4 and result.total_weight == sum(samples)
    assert result.client_ids == ["c0", "c1", "c2", "c3"]


def test_fedhm_at_full_rank_and_infinite_temperature_is_fedavg() -> None:
    gen = torch.Generator().manual_seed(3)
    global_tensors = random_tensors(LENET, gen)
    updates = [update(LENET, random_tensors(LENET, gen), n, f"c{n}") for n in (10, 40, 25)]
    fedavg = run_round(FedAvg(), global_tensors, updates)
    fedhm = run_round(FedAvg("tier-softmax", math.inf), global_tensors, updates)
    assert fedavg.tensors.keys() == fedhm.tensors.keys()
    for name in fedavg.tensors:
        assert torch.equal(fedavg.tensors[name], fedhm.tensors[name])
    assert fedavg.dispersion == fedhm.dispersion
    assert fedavg.weights == fedhm.weights


def test_tier_softmax_weights_follow_eq2() -> None:
    gen = torch.Generator().manual_seed(4)
    global_tensors = random_tensors(LENET, gen)
    tiers = refactorize(global_tensors, [LENET.at_tier(g) for g in TIERS])
    updates = [update(LENET.at_tier(g), tiers[g], 100, f"c{i}") for i, g in enumerate(TIERS)]
    result = run_round(FedAvg("tier-softmax", 5.0), global_tensors, updates)
    assert result.weights == pytest.approx([0.2774, 0.2510, 0.2388, 0.2329], abs=1e-4)
    # unequal data keeps n_k: weight ∝ n_k·exp(γ_k/τ)
    uneven = [update(u.spec, dict(u.tensors), n, u.client_id) for u, n in zip(updates, (10, 20, 30, 40), strict=True)]
    result = run_round(FedAvg("tier-softmax", 5.0), global_tensors, uneven)
    raw = [n * math.exp(g / 5.0) for n, g in zip((10, 20, 30, 40), TIERS, strict=True)]
    assert result.weights == pytest.approx([r / sum(raw) for r in raw], rel=1e-12)


def test_client_weight_validation() -> None:
    u = update(DIGITS, {}, 7, "c")
    assert client_weight(u) == 7.0
    assert client_weight(u, "tier-softmax", math.inf) == 7.0
    with pytest.raises(ValueError, match="temperature"):
        client_weight(u, "tier-softmax", 0.0)
    with pytest.raises(ValueError, match="weighting"):
        client_weight(u, "uniform")
    with pytest.raises(ValueError, match="temperature"):
        FedAvg("tier-softmax", -1.0)
    with pytest.raises(ValueError, match="num_samples"):
        update(DIGITS, {}, 0, "c")
    with pytest.raises(ValueError, match="rank_ratio"):
        ClientUpdate("c", 5, 0.5, DIGITS, {})


# --------------------------------------------------------------------------- due tensors, buffers


def test_only_due_tensors_change() -> None:
    gen = torch.Generator().manual_seed(5)
    global_tensors = random_tensors(DIGITS, gen)
    due = ["conv2.weight", "head.bias"]
    # clients push their whole state; what is not due is ignored
    updates = [update(DIGITS, random_tensors(DIGITS, gen), 10 + i, f"c{i}") for i in range(3)]
    result = run_round(FedAvg(), global_tensors, updates, due)
    assert set(result.tensors) == set(due) == set(result.dispersion)
    new_global = {**global_tensors, **result.tensors}
    for name in global_tensors:
        if name not in due:
            assert torch.equal(new_global[name], global_tensors[name])
        else:
            assert not torch.equal(new_global[name], global_tensors[name])
    with pytest.raises(KeyError, match="not part of the global model"):
        FedAvg().begin(global_tensors, ["nope.weight"])


def test_keep_local_buffers_excludes_buffers() -> None:
    spec = ModelSpec("resnet18", 10, "none")
    names = ["conv1.weight", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"]
    buffers = {"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"}
    gen = torch.Generator().manual_seed(6)
    every = random_tensors(spec, gen)
    global_tensors = {n: every[n] for n in names}

    def client(i: int) -> ClientUpdate:
        tensors = {n: t + i for n, t in global_tensors.items()}
        return update(spec, tensors, 10, f"c{i}")

    kept = FedAvg(keep_local_buffers=True)
    assert buffers <= kept.local_tensors(spec)
    assert all(spec.tensor(n).role == "buffer" for n in kept.local_tensors(spec))
    assert FedAvg().local_tensors(spec) == frozenset()
    result = run_round(kept, global_tensors, [client(1), client(3)], names)
    assert set(result.tensors) == set(names) - buffers
    torch.testing.assert_close(result.tensors["bn1.weight"], global_tensors["bn1.weight"] + 2)
    shared = run_round(FedAvg(), global_tensors, [client(1), client(3)], names)
    assert set(shared.tensors) == set(names)
    assert shared.tensors["bn1.num_batches_tracked"].dtype == torch.int64
    assert shared.tensors["bn1.num_batches_tracked"] == global_tensors["bn1.num_batches_tracked"] + 2


def test_fold_rejects_bad_updates() -> None:
    gen = torch.Generator().manual_seed(7)
    global_tensors = random_tensors(DIGITS, gen)
    strategy = FedAvg()
    acc = strategy.begin(global_tensors, list(global_tensors))
    strategy.fold(acc, update(DIGITS, {"head.bias": torch.zeros(10)}, 5, "a"))
    with pytest.raises(ValueError, match="already folded"):
        strategy.fold(acc, update(DIGITS, {"head.bias": torch.zeros(10)}, 5, "a"))
    with pytest.raises(ValueError, match="shape"):
        strategy.fold(acc, update(DIGITS, {"head.bias": torch.zeros(11)}, 5, "b"))
    with pytest.raises(ValueError, match="not part of"):
        strategy.fold(acc, update(DIGITS, {"fc9.bias": torch.zeros(10)}, 5, "c"))
    low = ModelSpec("digits-cnn", 10, "lowrank", rank_ratio=0.25)
    with pytest.raises(ValueError, match="factor pair"):
        strategy.fold(acc, update(low, {"fc1.lowrank_u": torch.zeros(128, 32)}, 5, "d"))


def test_client_metrics_are_sample_weighted() -> None:
    global_tensors = {"head.bias": torch.zeros(10)}
    updates = [
        ClientUpdate("a", 10, 1.0, DIGITS, {"head.bias": torch.ones(10)}, metrics={"acc": 0.5, "loss": 1.0}),
        ClientUpdate("b", 30, 1.0, DIGITS, {"head.bias": torch.ones(10)}, metrics={"acc": 0.9}),
    ]
    result = run_round(FedAvg(), global_tensors, updates)
    assert result.metrics == pytest.approx({"acc": 0.8, "loss": 1.0})


# --------------------------------------------------------------------------- strategies


def test_fedprox_server_is_fedavg() -> None:
    gen = torch.Generator().manual_seed(8)
    global_tensors = random_tensors(DIGITS, gen)
    updates = [update(DIGITS, random_tensors(DIGITS, gen), n, f"c{n}") for n in (5, 9)]
    a, b = run_round(FedAvg(), global_tensors, updates), run_round(FedProx(0.1), global_tensors, updates)
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    assert FedProx(0.1).client_config() == {"prox_mu": 0.1}
    assert FedAvg().client_config() == {}
    with pytest.raises(ValueError, match="mu"):
        FedProx(-1.0)


def trainable(spec: ModelSpec) -> list[str]:
    return [t.name for t in spec.tensors if t.role != "buffer"]


def test_scaffold_with_zero_controls_is_fedavg_and_updates_controls_by_hand() -> None:
    gen = torch.Generator().manual_seed(9)
    global_tensors = random_tensors(DIGITS, gen)
    deltas = [{n: torch.randn(DIGITS.tensor(n).shape, generator=gen) for n in trainable(DIGITS)} for _ in range(3)]
    updates = [
        update(DIGITS, random_tensors(DIGITS, gen), n, f"c{i}", d)
        for i, (n, d) in enumerate(zip((5, 9, 3), deltas, strict=True))
    ]
    scaffold = Scaffold(num_clients_total=10, global_lr=1.0)
    assert scaffold.client_config() == {"scaffold": True}
    assert FedAvg().server_control() is None
    with pytest.raises(ValueError, match="spec"):
        scaffold.server_control()  # zeros of unknown shapes
    eager = Scaffold(num_clients_total=10, spec=LENET.at_tier(0.5)).server_control()
    assert eager is not None and set(eager) == set(trainable(LENET))  # the full model's trainables
    zeros = scaffold.server_control(DIGITS)
    assert set(zeros) == set(trainable(DIGITS)) and all(not c.any() for c in zeros.values())

    due = ["conv2.weight", "fc1.bias"]
    fedavg = run_round(FedAvg(), global_tensors, updates, due)
    result = run_round(scaffold, global_tensors, updates, due)
    assert result.tensors.keys() == fedavg.tensors.keys()
    assert all(torch.equal(result.tensors[n], fedavg.tensors[n]) for n in due)

    # c ← c + |S|/N · mean_k Δc_k, over every trainable tensor (due or not)
    control = scaffold.server_control(DIGITS)
    for name in trainable(DIGITS):
        expected = 0.3 * (deltas[0][name] + deltas[1][name] + deltas[2][name]) / 3
        torch.testing.assert_close(control[name], expected, rtol=1e-6, atol=1e-7)
    # a second round with two clients adds 2/10 of their mean
    run_round(scaffold, global_tensors, updates[:2], due)
    again = scaffold.server_control()
    name = "head.weight"
    expected = control[name] + 0.2 * (deltas[0][name] + deltas[1][name]) / 2
    torch.testing.assert_close(again[name], expected, rtol=1e-6, atol=1e-7)

    # state survives a restart
    restored = Scaffold(num_clients_total=10, spec=DIGITS)
    restored.load_state_dict(scaffold.state_dict())
    assert all(torch.equal(restored.server_control()[n], again[n]) for n in again)
    with pytest.raises(ValueError, match="does not fit"):
        restored.load_state_dict({"controls": {"head.weight": torch.zeros(3)}})


def test_scaffold_server_learning_rate() -> None:
    gen = torch.Generator().manual_seed(11)
    global_tensors = random_tensors(DIGITS, gen)
    deltas = {n: torch.zeros(DIGITS.tensor(n).shape) for n in trainable(DIGITS)}
    updates = [update(DIGITS, random_tensors(DIGITS, gen), n, f"c{n}", deltas) for n in (4, 6)]
    fedavg = run_round(FedAvg(), global_tensors, updates)
    result = run_round(Scaffold(5, global_lr=0.5), global_tensors, updates)
    for name in global_tensors:
        expected = global_tensors[name] + 0.5 * (fedavg.tensors[name] - global_tensors[name])
        torch.testing.assert_close(result.tensors[name], expected)


def test_scaffold_rejects_low_rank_and_missing_controls() -> None:
    low = LENET.at_tier(0.5)
    scaffold = Scaffold(4)
    acc = scaffold.begin({}, [])
    with pytest.raises(ValueError, match="γ = 1"):
        scaffold.fold(acc, update(low, {}, 5, "a", {}))
    with pytest.raises(ValueError, match="control delta"):
        scaffold.fold(acc, update(DIGITS, {}, 5, "b"))
    with pytest.raises(ValueError, match="not a trainable"):
        scaffold.fold(acc, update(DIGITS, {}, 5, "c", {"bogus": torch.zeros(1)}))
    with pytest.raises(ValueError, match="num_clients_total"):
        Scaffold(0)


def test_registry() -> None:
    assert set(STRATEGIES) == {"fedavg", "fedprox", "scaffold"}
    assert isinstance(build_strategy("fedavg", weighting="tier-softmax", temperature=5.0), FedAvg)
    prox = build_strategy("fedprox", mu=0.5)
    assert isinstance(prox, FedProx) and prox.client_config() == {"prox_mu": 0.5}
    assert isinstance(build_strategy("scaffold", num_clients_total=3), Scaffold)
    with pytest.raises(ValueError, match="unknown strategy"):
        build_strategy("fedyogi")
    with pytest.raises(ValueError, match="bad parameters"):
        build_strategy("fedavg", mu=1.0)
    assert FedAvg().state_dict() == {}
    with pytest.raises(ValueError, match="no state"):
        FedAvg().load_state_dict({"x": 1})


# --------------------------------------------------------------------------- re-factorization


@pytest.mark.parametrize("spec", [LENET, ModelSpec("digits-cnn", 10, "lowrank")])
def test_refactorize_equals_from_full_with_one_svd_per_tensor(spec: ModelSpec, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(12)
    global_tensors = random_tensors(spec, gen)
    tier_specs = [spec.at_tier(g) for g in TIERS]
    expected = {g: s.from_full(global_tensors) for g, s in zip(TIERS, tier_specs, strict=True)}

    calls: list[tuple[int, ...]] = []
    svd = torch.linalg.svd

    def counting_svd(matrix: Tensor, **kwargs):
        calls.append(tuple(matrix.shape))
        return svd(matrix, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", counting_svd)
    tiers = refactorize(global_tensors, tier_specs)
    monkeypatch.undo()
    factorized = {t.full_name for s in tier_specs for t in s.tensors if t.full_name}
    assert factorized and len(calls) == len(factorized)

    assert set(tiers) == set(TIERS)
    for g in TIERS:
        assert list(tiers[g]) == spec.at_tier(g).names
        for name, tensor in expected[g].items():
            assert torch.equal(tiers[g][name], tensor), (g, name)
    # γ = 1 receives the global tensors unchanged
    assert all(tiers[1.0][n] is global_tensors[n] for n in global_tensors)
