"""Mixed tiers averaged where they hold, through a real round of the federation, against hand-derived entries.

The global ``fc1.weight`` (128 × 1024) is diagonal with distinct values, so its singular bases are
the coordinate axes (up to sign) and "the entries a rank-16 factor pair can move" are, by hand,
every entry in rows 0–15 or columns 0–15. A tier-1 client A and a tier-⅛ client B (rank 16) push;
the new value must be their weighted mean where B holds the entry and A's value elsewhere, except in
columns 128–1023, outside the global tensor's row space, where FedHM's weighted mean stays. When
only B reports, the entries past rank 16 that only tier 1 holds keep the old diagonal.
"""

from __future__ import annotations

import pytest
import torch

from aggregator_service.intervals import EveryRound
from aggregator_service.rounds import CohortSampler, Federation
from aggregator_service.strategies import FedAvg
from aggregator_service.updates import ClientUpdate
from fedcore.spec import ModelSpec

SPEC = ModelSpec("digits-cnn", 10, "lowrank")
ROWS, COLS, RANK = 128, 1024, 16  # fc1 at tier 1/8: round(128 / 8)
WEIGHTS = {"a": 10, "b": 30}  # num_samples: FedAvg's weights


def _federation(spec: ModelSpec, tiers, tier_average: str) -> Federation:
    """Plain FedAvg, every tensor every round, every client offered in every cohort."""
    full = spec.full()
    return Federation(
        full,
        FedAvg(),
        EveryRound(full.tensors),
        CohortSampler(1.0, 1, "per_round", seed=0),
        tiers=tiers,
        tier_average=tier_average,
    )


def _round(
    tier_average: str, tiers=(1.0, 0.125), clients=("a", "b")
) -> tuple[Federation, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One round of ``clients``: ``a`` trains the largest tier, ``b`` the smallest, each adding noise."""
    fed = _federation(SPEC, tiers, tier_average)
    diagonal = torch.zeros(ROWS, COLS)
    diagonal[range(ROWS), range(ROWS)] = torch.linspace(3.0, 1.0, ROWS)
    fed.global_tensors["fc1.weight"] = diagonal
    gen = torch.Generator().manual_seed(7)
    tier_a, tier_b = max(tiers), min(tiers)
    a = {n: t + 0.1 * torch.randn(t.shape, generator=gen) for n, t in fed.tier_tensors(tier_a).items()}
    b = {n: t + 0.1 * torch.randn(t.shape, generator=gen) for n, t in fed.tier_tensors(tier_b).items()}
    plan = fed.plan(1, list(clients))
    fed.begin(plan)
    for cid, tier, local in (("a", tier_a, a), ("b", tier_b, b)):
        if cid in clients:
            names = fed.tier_due(tier, plan.due)
            fed.fold(ClientUpdate(cid, WEIGHTS[cid], tier, fed.tier_spec(tier), {n: local[n] for n in names}))
    fed.close()
    return fed, a, b


def _mean(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (WEIGHTS["a"] * x.double() + WEIGHTS["b"] * y.double()) / sum(WEIGHTS.values())


def test_entries_a_low_tier_holds_are_averaged_the_rest_is_the_full_tiers() -> None:
    fed, a, b = _round("held")
    b_fc1 = b["fc1.lowrank_u"].double() @ b["fc1.lowrank_v"].double()
    rows, cols = torch.arange(ROWS)[:, None], torch.arange(COLS)[None, :]
    held_by_b = (rows < RANK) | (cols < RANK)
    new_direction = cols >= ROWS  # outside the global tensor's row space: FedHM's average
    expected = torch.where(held_by_b | new_direction, _mean(a["fc1.weight"], b_fc1), a["fc1.weight"].double())
    torch.testing.assert_close(fed.global_tensors["fc1.weight"].double(), expected, rtol=0, atol=1e-5)
    # a tensor both tiers hold whole is their plain weighted mean
    torch.testing.assert_close(
        fed.global_tensors["fc1.bias"].double(), _mean(a["fc1.bias"], b["fc1.bias"]), rtol=0, atol=1e-6
    )


def test_entries_no_client_of_the_round_holds_keep_their_global_value() -> None:
    """A round whose cohort drew no tier-1 client: past rank 16 the global tensor stays as it was.

    HeteroFL keeps a parameter no client held; FedHM's average would put client B's (near-)zeros there
    and cut the global model to rank 16 until a tier-1 client comes back.
    """
    fed, _, b = _round("held", clients=("b",))
    b_fc1 = b["fc1.lowrank_u"].double() @ b["fc1.lowrank_v"].double()
    rows, cols = torch.arange(ROWS)[:, None], torch.arange(COLS)[None, :]
    before = torch.zeros(ROWS, COLS, dtype=torch.float64)
    before[range(ROWS), range(ROWS)] = torch.linspace(3.0, 1.0, ROWS, dtype=torch.float64)
    held_by_b = (rows < RANK) | (cols < RANK)
    new_direction = cols >= ROWS  # outside the global tensor's row space: FedHM's average, B's product alone
    expected = torch.where(held_by_b | new_direction, b_fc1, before)
    torch.testing.assert_close(fed.global_tensors["fc1.weight"].double(), expected, rtol=0, atol=1e-5)
    # FedHM's eq. 1 as printed cuts the tensor to B's rank 16
    aligned, _, b = _round("aligned", clients=("b",))
    b_fc1 = b["fc1.lowrank_u"].double() @ b["fc1.lowrank_v"].double()
    torch.testing.assert_close(aligned.global_tensors["fc1.weight"].double(), b_fc1, rtol=0, atol=1e-5)
    assert torch.linalg.matrix_rank(aligned.global_tensors["fc1.weight"].double(), rtol=1e-5) == RANK  # float32 storage


def test_aligned_is_fedhms_average_of_products() -> None:
    fed, a, b = _round("aligned")
    b_fc1 = b["fc1.lowrank_u"].double() @ b["fc1.lowrank_v"].double()
    torch.testing.assert_close(
        fed.global_tensors["fc1.weight"].double(), _mean(a["fc1.weight"], b_fc1), rtol=0, atol=1e-5
    )


def test_one_tier_alone_is_fedhm_exactly() -> None:
    """No client holds the entries past rank 16: FedHM's average of the products stays there."""
    held, _, _ = _round("held", tiers=(0.125,))
    aligned, _, _ = _round("aligned", tiers=(0.125,))
    for name in SPEC.full().names:
        assert torch.equal(held.global_tensors[name], aligned.global_tensors[name]), name


def test_an_unknown_tier_average_is_refused() -> None:
    from fedatoms.simulate import SimulationConfig

    with pytest.raises(ValueError, match="tier_average must be one of held, aligned"):
        SimulationConfig(tier_average="mean")


def test_resnet18_convs_differ_from_fedhms_average_only_where_the_low_tier_does_not_hold() -> None:
    """On a BatchNorm model's 4-D convs: the coordinates both tiers hold are their plain mean.

    With ``P = L_r`` and ``Q = R_r`` the global tensor's top-``r`` singular vectors (computed here by
    torch), ``held − aligned`` must vanish on ``Pᵀ X`` and ``X Q``: only coordinates the rank-``r``
    client cannot move may change. And the change must be there: tier-1 learned something past ``r``.
    """
    from fedcore.spec import factored_matrix

    spec = ModelSpec("resnet18", 10, "lowrank")
    results = {}
    for rule in ("held", "aligned"):
        fed = _federation(spec, (1.0, 0.25), rule)
        gen = torch.Generator().manual_seed(11)
        plan = fed.plan(1, ["a", "b"])
        fed.begin(plan)
        for cid, tier in (("a", 1.0), ("b", 0.25)):
            local = {
                n: t + 0.01 * torch.randn(t.shape, generator=gen) if t.is_floating_point() else t
                for n, t in fed.tier_tensors(tier).items()
            }
            names = fed.tier_due(tier, plan.due)
            fed.fold(ClientUpdate(cid, 50, tier, fed.tier_spec(tier), {n: local[n] for n in names}))
        start = {n: t.clone() for n, t in fed.global_tensors.items()}
        fed.close()
        results[rule] = (start, fed.global_tensors)
    start, held = results["held"]
    _, aligned = results["aligned"]
    low = spec.at_tier(0.25)
    factorized = {t.full_name: t.shape[1] for t in low.tensors if t.full_name and t.role.endswith("_u")}
    assert "layer4.1.conv2.weight" in factorized
    for name, rank in factorized.items():
        assert torch.isfinite(held[name]).all(), name
        left, _, right_t = torch.linalg.svd(factored_matrix(start[name]).double(), full_matrices=False)
        diff = factored_matrix(held[name]).double() - factored_matrix(aligned[name]).double()
        scale = float(factored_matrix(aligned[name]).double().abs().max())
        assert float((left[:, :rank].T @ diff).abs().max()) < 1e-5 * scale, name
        assert float((diff @ right_t[:rank].T).abs().max()) < 1e-5 * scale, name
        assert float(diff.abs().max()) > 1e-4 * scale, name
    for name in spec.full().names:
        if name not in factorized:
            assert torch.equal(held[name], aligned[name]), name  # BN, biases, 1×1 shortcuts, the head


def test_a_mixed_round_decomposes_each_factorized_tensor_once(monkeypatch) -> None:
    """The tiers' cuts and the held average decompose the same round-start tensors: one SVD each."""
    calls: list[tuple[int, ...]] = []
    svd = torch.linalg.svd

    def counting_svd(matrix: torch.Tensor, **kwargs):
        calls.append(tuple(matrix.shape))
        return svd(matrix, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", counting_svd)
    _round("held")
    factorized = [t.full_name for t in SPEC.at_tier(0.125).tensors if t.full_name and t.role.endswith("_u")]
    assert len(calls) == len(factorized) == 2  # conv2 and fc1 of the digits CNN, each once


def test_spectra_decompose_a_tensor_again_only_once_it_changed() -> None:
    from aggregator_service.refactorization import Spectra

    spectra = Spectra()
    tensor = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    first = spectra.of("w", tensor)
    assert spectra.of("w", tensor) is first
    assert first[1].tolist() == [3.0, 1.0]
    tensor.mul_(2.0)  # in place: the same object, changed
    assert spectra.of("w", tensor)[1].tolist() == [6.0, 2.0]
    assert spectra.of("w", torch.tensor([[0.0, 5.0], [4.0, 0.0]]))[1].tolist() == [5.0, 4.0]  # a new tensor
