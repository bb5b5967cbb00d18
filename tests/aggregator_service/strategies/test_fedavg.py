"""FedAvg and FedHM against batch references: aligned low-rank updates, tier weights, due tensors, buffers."""

from __future__ import annotations

import math

import pytest
import torch
from strategy_helpers import DIGITS, LENET, TIERS, batch_mean, random_tensors, run_round, update
from torch import Tensor

from aggregator_service.refactorization import refactorize
from aggregator_service.strategies import STRATEGIES, FedAvg, FedProx
from aggregator_service.updates import ClientUpdate
from fedcore.spec import ModelSpec

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


# --------------------------------------------------------------------------- BatchNorm statistics


@pytest.mark.parametrize("strategy", [FedAvg, lambda **kw: FedProx(mu=0.01, **kw)])
def test_batchnorm_variance_is_pooled_over_the_clients_data(strategy) -> None:
    """Each client reports its activations' mean and unbiased variance; the aggregate equals the statistics of
    all clients' activations together (the oracle concatenates them), not the average of the variances."""
    spec = ModelSpec("resnet18", 10, "none")
    names = ["bn1.weight", "bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"]
    gen = torch.Generator().manual_seed(8)
    every = random_tensors(spec, gen)
    global_tensors = {n: every[n] for n in names}
    sizes, shifts = [40, 120, 40], [-3.0, 0.5, 4.0]  # non-IID: each client's activations sit elsewhere
    acts = [
        torch.randn(n, 64, generator=gen, dtype=torch.float64) * (1 + i) + s
        for i, (n, s) in enumerate(zip(sizes, shifts, strict=True))
    ]

    def client(i: int) -> ClientUpdate:
        a = acts[i]
        # the biased variance of each client's n samples, so the pooled one is the biased variance of all
        tensors = {
            **global_tensors,
            "bn1.running_mean": a.mean(0).float(),
            "bn1.running_var": a.var(0, unbiased=False).float(),
        }
        return update(spec, tensors, sizes[i], f"c{i}")

    updates = [client(i) for i in range(3)]
    pooled = run_round(strategy(), global_tensors, updates, names)
    everything = torch.cat(acts)
    torch.testing.assert_close(pooled.tensors["bn1.running_mean"], everything.mean(0).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        pooled.tensors["bn1.running_var"], everything.var(0, unbiased=False).float(), rtol=1e-5, atol=1e-5
    )
    assert float((pooled.tensors["bn1.running_var"] - everything.var(0, unbiased=False)).abs().max()) < 1e-3
    averaged = run_round(strategy(bn_statistics="running"), global_tensors, updates, names)
    plain = sum(n * a.var(0, unbiased=False) for n, a in zip(sizes, acts, strict=True)) / sum(sizes)
    torch.testing.assert_close(averaged.tensors["bn1.running_var"], plain.float(), rtol=1e-5, atol=1e-5)
    assert float((pooled.tensors["bn1.running_var"] - averaged.tensors["bn1.running_var"]).min()) > 1.0


def test_a_running_var_without_its_mean_is_averaged() -> None:
    spec = ModelSpec("resnet18", 10, "none")
    names = ["bn1.running_var"]
    global_tensors = {"bn1.running_var": torch.ones(64)}
    updates = [update(spec, {"bn1.running_var": torch.full((64,), float(v))}, 10, f"c{v}") for v in (1, 3)]
    result = run_round(FedAvg(), global_tensors, updates, names)
    torch.testing.assert_close(result.tensors["bn1.running_var"], torch.full((64,), 2.0))


def test_bn_statistics_is_checked_by_the_strategy() -> None:
    with pytest.raises(ValueError, match="bn_statistics must be one of precise, running"):
        FedAvg(bn_statistics="pooled")


@pytest.mark.parametrize("mode", ["precise", "running"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_the_federation_sets_bn_statistics_on_both_sides(strategy: str, mode: str) -> None:
    """FedYogi took no ``bn_statistics``: its server pooled the variance while its clients were told to average."""
    from aggregator_service.config import FederationConfig

    config = FederationConfig(model="resnet18", strategy=strategy, bn_statistics=mode)
    assert config.train_config().bn_statistics == mode  # what clients are told to push
    assert config.build_federation(4).strategy.bn_statistics == mode  # how the server combines it


class KeepsItsOwnBatchNorm(FedAvg):
    """A user's strategy whose ``__init__`` takes no ``bn_statistics`` (nor ``weighting``)."""

    def __init__(self, keep_local_buffers: bool = False) -> None:
        super().__init__(keep_local_buffers=keep_local_buffers)


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("bn_statistics", "running", "'running'"),
        ("weighting", "tier-softmax", "'tier-softmax'"),
        ("temperature", 2.0, "2"),
    ],
)
def test_a_federation_key_a_users_strategy_does_not_take_is_refused(key: str, value: object, says: str) -> None:
    from aggregator_service.config import FederationConfig

    reference = "test_fedavg:KeepsItsOwnBatchNorm"
    with pytest.raises(ValueError, match=f"{key} = {says} is not used by strategy '{reference}', whose __init__"):
        FederationConfig(model="resnet18", strategy=reference, **{key: value})
    assert (
        FederationConfig(model="resnet18", strategy=reference).build_federation(2).strategy.bn_statistics == "precise"
    )


# --------------------------------------------------------------------------- one module at a time


class _Watched(dict):
    """An update's tensors handed out as fresh copies, as the store's lazy mapping does, counting the bytes
    of copies still alive (a copy dies when the folding code drops it) and their peak."""

    def __init__(self, tensors: dict[str, Tensor], meter: dict[str, int]) -> None:
        super().__init__(tensors)
        self.shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        self.meter = meter

    def __getitem__(self, name: str) -> Tensor:
        import weakref

        copy = super().__getitem__(name).clone()
        nbytes = copy.numel() * copy.element_size()
        self.meter["live"] += nbytes
        self.meter["peak"] = max(self.meter["peak"], self.meter["live"])
        self.meter["lookups"] += 1
        weakref.finalize(copy, lambda: self.meter.__setitem__("live", self.meter["live"] - nbytes))
        return copy

    def items(self):  # type: ignore[override]
        return ((n, self[n]) for n in self)

    def values(self):  # type: ignore[override]
        return (self[n] for n in self)


def test_a_resnet18_update_is_folded_holding_one_layer_of_it_at_a_time() -> None:
    """The close folds stored updates read tensor by tensor: what the fold holds of an update at once is one
    module (here a conv's weight, at most 9.4 MB), not the model (44.7 MB); the means are the batch means."""
    spec = ModelSpec("resnet18", 10, "none")
    gen = torch.Generator().manual_seed(3)
    clients = [random_tensors(spec, gen) for _ in range(3)]
    samples = [10, 30, 20]
    global_tensors = {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in spec.tensors}
    meter = {"live": 0, "peak": 0, "lookups": 0}
    updates = [
        update(spec, _Watched(t, meter), n, f"c{i}") for i, (t, n) in enumerate(zip(clients, samples, strict=True))
    ]
    result = run_round(FedAvg(bn_statistics="running"), global_tensors, updates)
    largest = max(t.numel() * 4 for t in clients[0].values())
    model = sum(t.numel() * t.element_size() for t in clients[0].values())
    assert largest == 512 * 512 * 9 * 4 and model > 4 * largest
    assert meter["lookups"] == 3 * len(spec.tensors)  # each tensor read once
    assert meter["peak"] <= largest, (meter["peak"], largest, model)
    for name in ("conv1.weight", "layer4.1.conv2.weight", "layer2.0.bn1.running_var", spec.tensors[-1].name):
        expected, _ = batch_mean([c[name] for c in clients], samples)
        torch.testing.assert_close(result.tensors[name], expected.to(torch.float32), rtol=1e-6, atol=1e-6)


def test_an_update_with_a_wrong_shape_is_refused_before_anything_is_folded() -> None:
    """The shapes are checked (from the lazy mapping's ``shapes``, without reading a tensor) before the first
    module is folded: the refused update leaves the round as if it never came."""
    spec = DIGITS
    gen = torch.Generator().manual_seed(5)
    good, bad = random_tensors(spec, gen), random_tensors(spec, gen)
    last = spec.tensors[-1].name
    bad[last] = torch.zeros((*bad[last].shape, 1))
    global_tensors = {t.name: torch.zeros(t.shape) for t in spec.tensors}
    meter = {"live": 0, "peak": 0, "lookups": 0}
    strategy = FedAvg()
    acc = strategy.begin(global_tensors, list(global_tensors))
    with pytest.raises(ValueError, match=f"{last!r} has shape"):
        strategy.fold(acc, update(spec, _Watched(bad, meter), 10, "bad"))
    assert meter["lookups"] == 0
    strategy.fold(acc, update(spec, good, 10, "good"))
    result = strategy.finish(acc, global_tensors)
    for name, value in good.items():
        assert torch.equal(result.tensors[name], value), name
