"""What the aggregator keeps of broken pushes is bounded: one per client, a capacity, a lifetime."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from aggregator_service.kept_uploads import KeptUpload, KeptUploads
from fedcore import codec


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def upload(update_id: str, closed: list[str]) -> KeptUpload:
    files = contextlib.ExitStack()
    files.callback(closed.append, update_id)  # stands for the spool files: closing them is what we watch
    return KeptUpload(update_id, (1, 10, ()), codec.Reassembler(), None, {}, files)


def test_one_per_client_the_oldest_dropped_past_capacity_and_each_for_its_lifetime() -> None:
    clock, closed = Clock(), []
    kept = KeptUploads(10**6, capacity=2, ttl_seconds=60, clock=clock)
    kept.keep("c1", upload("u1", closed))
    kept.keep("c1", upload("u2", closed))  # the client's newer broken push replaces its older one
    assert closed == ["u1"] and kept.peek("c1", "u1") is None and kept.peek("c1", "u2") is not None
    clock.now = 10
    kept.keep("c2", upload("u3", closed))
    clock.now = 20
    kept.keep("c3", upload("u4", closed))  # a third client: the oldest (c1's, kept at 0) goes
    assert closed == ["u1", "u2"] and len(kept) == 2
    assert kept.peek("c2", "u3") is not None and kept.peek("c2", "u4") is None  # another client's id: nothing
    clock.now = 75  # c2's kept at 10: past its 60 s; c3's at 20, not yet
    assert kept.peek("c3", "u4") is not None
    assert closed == ["u1", "u2", "u3"] and len(kept) == 1


def test_expire_closes_those_past_their_lifetime_without_any_other_call() -> None:
    """What the server's ticker calls: on an idle server nothing else would let go of their spool files."""
    clock, closed = Clock(), []
    kept = KeptUploads(10**6, ttl_seconds=60, clock=clock)
    kept.keep("c1", upload("u1", closed))
    clock.now = 30
    kept.keep("c2", upload("u2", closed))
    clock.now = 60
    kept.expire()  # c1's is 60 s old: not yet past its lifetime
    assert closed == [] and len(kept) == 2
    clock.now = 61
    kept.expire()
    assert closed == ["u1"] and len(kept) == 1
    assert kept.take("c2", "u2") is not None  # the other one, left in place
    clock.now = 1000
    kept.expire()  # nothing kept: nothing to do
    assert closed == ["u1"]


def test_close_closes_every_kept_push() -> None:
    clock, closed = Clock(), []
    kept = KeptUploads(10**6, clock=clock)
    kept.keep("c1", upload("u1", closed))
    kept.keep("c2", upload("u2", closed))
    kept.close()
    assert sorted(closed) == ["u1", "u2"] and len(kept) == 0
    assert kept.peek("c1", "u1") is None
    kept.close()  # again: nothing more closed
    assert sorted(closed) == ["u1", "u2"]


def test_take_removes_without_closing_and_drop_closes() -> None:
    clock, closed = Clock(), []
    kept = KeptUploads(10**6, clock=clock)
    kept.keep("c1", upload("u1", closed))
    assert kept.take("c1", "other") is None and len(kept) == 1  # a different update_id leaves it
    taken = kept.take("c1", "u1")
    assert taken is not None and taken.update_id == "u1" and closed == [] and len(kept) == 0
    assert kept.take("c1", "u1") is None
    kept.keep("c1", taken)  # broken again: kept again
    kept.drop("c1")
    assert closed == ["u1"] and len(kept) == 0
    kept.drop("c1")  # nothing kept: nothing to do


def test_progress_counts_model_tensors_then_control_deltas() -> None:
    model, control = codec.Reassembler(), codec.Reassembler()
    for name in ("w", "b"):
        for chunk in codec.iter_chunks(name, codec.encode(np.zeros(4, dtype="float32"), name=name)):
            model.add(chunk)
    control.add(next(codec.iter_chunks("w", codec.encode(np.zeros(4, dtype="float32"), name="w"), chunk_bytes=4)))
    upload = KeptUpload("u", (1, 1, ()), model, control, {}, contextlib.ExitStack())
    assert upload.progress == (2, 4)
    assert upload.bytes_received == 16 + 16 + 4


def test_the_oldest_go_first_past_the_byte_budget() -> None:
    clock, closed = Clock(), []

    def sized(update_id: str, nbytes: int) -> KeptUpload:
        kept_upload = upload(update_id, closed)
        for chunk in codec.iter_chunks("w", codec.encode(np.zeros(nbytes, dtype=np.uint8), name="w"), chunk_bytes=10):
            kept_upload.model.add(chunk)
        return kept_upload

    kept = KeptUploads(100, clock=clock)
    kept.keep("c1", sized("u1", 40))
    kept.keep("c2", sized("u2", 50))
    assert closed == [] and len(kept) == 2  # 90 of 100 bytes
    kept.keep("c3", sized("u3", 30))  # 120: c1's goes, 80 left
    assert closed == ["u1"] and len(kept) == 2
    kept.keep("c4", sized("u4", 101))  # alone over the budget: kept by nobody
    assert closed == ["u1", "u2", "u3", "u4"] and len(kept) == 0
    assert KeptUploads(0).max_bytes == 0  # nothing kept: a broken push is sent again whole


def test_bad_bounds_are_refused() -> None:
    for kwargs in ({"max_bytes": -1}, {"max_bytes": 1, "capacity": -1}, {"max_bytes": 1, "ttl_seconds": 0}):
        with pytest.raises(ValueError, match="max_bytes ≥ 0, capacity ≥ 0 and ttl_seconds > 0"):
            KeptUploads(**kwargs)
