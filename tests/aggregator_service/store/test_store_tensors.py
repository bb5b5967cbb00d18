"""Global and strategy tensors: exact round trips, upserts with versions, NaN refused."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator_service import store
from fedcore.codec import CodecError


def _model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv1.atoms": rng.standard_normal((6, 3, 3)).astype(np.float32),
        "bn.num_batches_tracked": np.array(seed, dtype=np.int64),
        "fc.bias": rng.standard_normal(10).astype(np.float32),
        "steps": np.arange(5, dtype=np.int64) * seed,
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def test_global_tensors_round_trip_and_upsert(db, world):
    first = _model(1)
    with db.factory.begin() as s:
        store.save_global_tensors(s, world.fed, {n: (a, 0, 1) for n, a in first.items()})
    with db.factory() as s:
        loaded = store.load_global_tensors(s, world.fed)
    assert set(loaded) == set(first)
    for name, array in first.items():
        got, version, interval = loaded[name]
        assert got.dtype == array.dtype and got.shape == array.shape
        np.testing.assert_array_equal(got, array)
        assert (version, interval) == (0, 1)

    second = _model(2)
    with db.factory.begin() as s:
        store.save_global_tensors(
            s, world.fed, {"conv1.atoms": (second["conv1.atoms"], 3, 2), "new": (second["steps"], 3, 1)}
        )
    with db.factory() as s:
        assert store.tensor_versions(s, world.fed) == {
            "conv1.atoms": 3,
            "bn.num_batches_tracked": 0,
            "fc.bias": 0,
            "steps": 0,
            "empty": 0,
            "new": 3,
        }
        assert store.tensor_intervals(s, world.fed)["conv1.atoms"] == 2
        partial = store.load_global_tensors(s, world.fed, names=["conv1.atoms", "fc.bias", "unknown"])
    assert set(partial) == {"conv1.atoms", "fc.bias"}
    np.testing.assert_array_equal(partial["conv1.atoms"][0], second["conv1.atoms"])
    np.testing.assert_array_equal(partial["fc.bias"][0], first["fc.bias"])


def test_tensors_are_stored_little_endian_raw(db, world):
    big_endian = np.arange(4, dtype=">f4")
    with db.factory.begin() as s:
        store.save_global_tensors(s, world.fed, {"w": (big_endian, 0, 1)})
    with db.factory() as s:
        row = s.get(store.GlobalTensor, (world.fed.id, "w"))
        assert row is not None
        assert (row.dtype, row.shape) == ("float32", [4])
        assert row.data == np.arange(4, dtype="<f4").tobytes()
        np.testing.assert_array_equal(store.load_global_tensors(s, world.fed)["w"][0], np.arange(4))


def test_nonfinite_tensors_are_refused(db, world):
    bad = np.array([1.0, np.nan], dtype=np.float32)
    with db.factory.begin() as s:
        with pytest.raises(CodecError, match="NaN"):
            store.save_global_tensors(s, world.fed, {"ok": (np.ones(2, np.float32), 0, 1), "bad": (bad, 0, 1)})
        with pytest.raises(CodecError):
            store.save_strategy_tensors(s, world.fed, {"c": np.array([np.inf])})
        with pytest.raises(ValueError, match="interval"):
            store.save_global_tensors(s, world.fed, {"ok": (np.ones(2, np.float32), 0, 0)})
    with db.factory() as s:
        assert store.load_global_tensors(s, world.fed) == {}


def test_strategy_tensors(db, world):
    c1 = {"w": np.full((2, 2), 0.5, np.float32), "b": np.zeros(3, np.float64)}
    with db.factory.begin() as s:
        store.save_strategy_tensors(s, world.fed, c1)
        store.save_strategy_tensors(s, world.fed, {"w": np.ones(1, np.float32)}, kind="other")
    with db.factory.begin() as s:
        store.save_strategy_tensors(s, world.fed, {"w": np.full((2, 2), 1.5, np.float32)})
    with db.factory() as s:
        got = store.load_strategy_tensors(s, world.fed)
        assert set(got) == {"w", "b"}
        np.testing.assert_array_equal(got["w"], np.full((2, 2), 1.5, np.float32))
        assert got["b"].dtype == np.float64
        assert set(store.load_strategy_tensors(s, world.fed, kind="other")) == {"w"}
