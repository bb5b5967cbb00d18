"""A push is received into a spool file, not memory, and decoded only once it has arrived whole.

The aggregator runs in this process, so its open files are this process's: while a push is half sent,
exactly one unlinked file in ``spool_dir`` holds the bytes received so far; after the acknowledgement it
is closed, and the stored update equals what was sent. A ``spool_dir`` that cannot hold files is refused
when the settings are read.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from grpc_helpers import register, shards, small_federation
from pydantic import ValidationError
from support import spool_files, stored_update

from aggregator_service import store
from aggregator_service.config import AggregatorSettings
from fedwire.v1 import aggregator_pb2 as pb


def _wait_for(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _half_sent_push_is_in_a_spool_file(start_service, url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    service = start_service(url, small_federation(min_clients=2), spool_dir=spool)
    a, _ = (register(service.stub, 1.0, d) for d in shards(2))
    task = a.task()
    a.fetch()
    push = a.train(task)
    header = pb.PushHeader(round=task.train.round, update_id="spooled-1", num_samples=push.num_samples)
    names = list(push.tensors)
    first, rest = names[: len(names) // 2], names[len(names) // 2 :]
    sent_first = sum(push.tensors[n].numel() * 4 for n in first)
    go_on = threading.Event()

    def messages():
        yield pb.PushMessage(header=header)
        from fedwire import framing

        for n in first:
            for msg in framing.tensor_messages(n, push.tensors[n]):
                yield pb.PushMessage(chunk=msg)
        go_on.wait(60)
        for n in rest:
            for msg in framing.tensor_messages(n, push.tensors[n]):
                yield pb.PushMessage(chunk=msg)

    replies: list[pb.PushReply] = []
    pusher = threading.Thread(target=lambda: replies.append(service.stub.PushUpdate(messages(), metadata=a.auth)))
    pusher.start()
    try:
        sizes = _wait_for(lambda: (s := spool_files(spool)) and s == [sent_first] and s, "the first half spooled")
        assert sizes == [sent_first]
        assert os.listdir(spool) == []  # no name: nothing to clean up after a crash
        with store.session_factory(store.create_engine_for(url))() as s:
            assert store.count_updates(s, store.get_federation(s, "default"), task.train.round) == 0
    finally:
        go_on.set()
        pusher.join(60)
    assert replies and replies[0].accepted and not replies[0].duplicate
    _wait_for(lambda: spool_files(spool) == [] or None, "the spool file closed")
    service.stop()
    stored = stored_update(url, task.train.round)
    for name, tensor in push.tensors.items():
        np.testing.assert_array_equal(stored[name], tensor.numpy())
    assert set(stored) == set(push.tensors)


def test_a_half_sent_push_is_in_a_spool_file_sqlite(start_service, sqlite_url, tmp_path) -> None:
    _half_sent_push_is_in_a_spool_file(start_service, sqlite_url, tmp_path)


@pytest.mark.usefixtures("postgres_url")
def test_a_half_sent_push_is_in_a_spool_file_postgres(start_service, postgres_url, tmp_path) -> None:
    _half_sent_push_is_in_a_spool_file(start_service, postgres_url, tmp_path)


@pytest.mark.parametrize("make", ["missing", "file"])
def test_a_spool_dir_that_cannot_hold_files_is_refused_at_start(tmp_path, make: str) -> None:
    target = tmp_path / "spool"
    if make == "file":
        target.write_text("not a directory")
    with pytest.raises(ValidationError, match=r"spool_dir .* (does not exist|is not a directory this user can write)"):
        AggregatorSettings(spool_dir=target)
