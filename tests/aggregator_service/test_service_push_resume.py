"""A push that breaks off resumes where the server holds it (GetUploadProgress, PushHeader.resume).

The server keeps a broken stream's spool files; the client asks where to start and sends only the
rest. Hand-built streams stop at a known place (whole tensors, then half of one), so the progress the
server reports is known exactly; the update stored at the end must equal what was sent, counted once
in the bandwidth ledger.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from grpc_helpers import SECRET, register, shards, small_federation
from links import LinkProxy
from pydantic import ValidationError
from sqlalchemy import func, select
from support import free_port, spool_files, stored_update, wait_serving, wait_until

from aggregator_service import store
from aggregator_service.config import AggregatorSettings
from aggregator_service.server import DeadlineTicker
from aggregator_service.store.models import Transfer
from client_agent.transport import AggregatorClient
from fedcore import codec
from fedwire import framing
from fedwire.v1 import aggregator_pb2 as pb
from fedwire.v1 import aggregator_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]

BACKENDS = ["sqlite", "postgres"]


def _url(request: pytest.FixtureRequest, backend: str) -> str:
    return request.getfixturevalue(f"{backend}_url")


def _setup(start_service, url: str, tmp_path: Path, **settings):
    spool = tmp_path / "spool"
    spool.mkdir()
    service = start_service(url, small_federation(min_clients=2), spool_dir=spool, **settings)
    a, _ = (register(service.stub, 1.0, d) for d in shards(2))  # a second member keeps the round open
    task = a.task()
    a.fetch()
    return service, a, task, a.train(task), spool


def _break_off(
    service,
    a,
    header: pb.PushHeader,
    tensors: list[tuple[str, object]],
    spool: Path,
    cut: int,
    part: bool = True,
    pid: int | str = "self",
):
    """Send the header, the first ``cut`` tensors whole and (``part``) half of the next; wait until the server
    (this process, or process ``pid``) holds exactly that; then ask for the progress (which ends the stalled
    stream). Returns (progress, bytes held, bytes of the next tensor sent)."""
    encoded = [(n, codec.encode(t, name=n)) for n, t in tensors]
    half = len(encoded[cut][1].data) // 2 if part else 0
    stall = threading.Event()

    def messages():
        yield pb.PushMessage(header=header)
        for name, enc in encoded[:cut]:
            for chunk in codec.iter_chunks(name, enc):
                yield pb.PushMessage(chunk=framing.from_chunk(chunk, pb.TENSOR_KIND_MODEL))
        if half:
            name, enc = encoded[cut]
            first = next(codec.iter_chunks(name, enc, chunk_bytes=half))
            yield pb.PushMessage(chunk=framing.from_chunk(first, pb.TENSOR_KIND_MODEL))
        stall.wait(60)  # a link gone quiet: the server sees no end

    held = sum(len(e.data) for _, e in encoded[:cut]) + half
    call = service.stub.PushUpdate.future(messages(), metadata=a.auth)
    try:
        assert wait_until(lambda: spool_files(spool, pid) == [held], 30), (
            "the server holds the first tensors and a half"
        )
        progress = service.stub.GetUploadProgress(pb.UploadProgressRequest(update_id=header.update_id), metadata=a.auth)
        with pytest.raises(grpc.FutureCancelledError if call.cancelled() else grpc.RpcError) as info:
            call.result(timeout=30)
        if isinstance(info.value, grpc.RpcError):
            assert info.value.code() == grpc.StatusCode.CANCELLED  # the server ended the stalled stream
    finally:
        stall.set()
    return progress, held, half


def _pushed_bytes(url: str, round_: int) -> int:
    engine = store.create_engine_for(url)
    try:
        with store.session_factory(engine)() as s:
            query = select(func.sum(Transfer.bytes)).where(Transfer.round == round_, Transfer.category == "push")
            return int(s.execute(query).scalar_one() or 0)
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_push_cut_midway_resumes_where_the_server_holds_it(start_service, request, backend, tmp_path) -> None:
    url = _url(request, backend)
    service, a, task, push, spool = _setup(start_service, url, tmp_path)
    tensors = list(push.tensors.items())
    cut = max(range(len(tensors)), key=lambda i: tensors[i][1].numel())  # half of the largest tensor
    header = pb.PushHeader(round=task.train.round, update_id="resume-1", num_samples=push.num_samples)

    progress, held, half = _break_off(service, a, header, tensors, spool, cut)
    assert (progress.kept, progress.round, progress.tensors, progress.offset) == (True, task.train.round, cut, half)
    assert spool_files(spool) == [held]  # kept, not closed

    header.resume = True
    reply = framing.push_update(service.channel)(
        framing.push_messages(header, [(n, t, 0, pb.TENSOR_KIND_MODEL) for n, t in tensors], start=(cut, half)),
        metadata=a.auth,
    )
    assert reply.accepted and not reply.duplicate and reply.round == task.train.round
    assert wait_until(lambda: spool_files(spool) == [], 30), "the kept spool file closed"
    gone = service.stub.GetUploadProgress(pb.UploadProgressRequest(update_id="resume-1"), metadata=a.auth)
    assert not gone.kept
    service.stop()
    stored = stored_update(url, task.train.round)
    assert set(stored) == set(push.tensors)
    for name, tensor in push.tensors.items():
        np.testing.assert_array_equal(stored[name], tensor.numpy())
    # the ledger counts the update's bytes once: half a tensor sent, then the rest
    assert _pushed_bytes(url, task.train.round) == sum(t.numel() * t.element_size() for _, t in tensors)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_refusals_are_clear_and_change_nothing(start_service, request, backend, tmp_path) -> None:
    url = _url(request, backend)
    service, a, task, push, spool = _setup(start_service, url, tmp_path)
    tensors = list(push.tensors.items())
    entries = [(n, t, 0, pb.TENSOR_KIND_MODEL) for n, t in tensors]
    progress_of = lambda update_id: service.stub.GetUploadProgress(  # noqa: E731
        pb.UploadProgressRequest(update_id=update_id), metadata=a.auth
    )

    # nothing kept: ABORTED, which the client retries by pushing whole
    header = pb.PushHeader(round=task.train.round, update_id="never-sent", num_samples=push.num_samples, resume=True)
    with pytest.raises(grpc.RpcError) as info:
        framing.push_update(service.channel)(framing.push_messages(header, entries, start=(1, 0)), metadata=a.auth)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "nothing is kept of update 'never-sent'" in info.value.details()
    assert not progress_of("never-sent").kept

    # a malformed update_id, and no token: the usual refusals
    with pytest.raises(grpc.RpcError) as info:
        progress_of("has space")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "update_id" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        service.stub.GetUploadProgress(pb.UploadProgressRequest(update_id="x"))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # a stream broken where a tensor ends is kept too; a resume that changes the header is ABORTED (the client
    # pushes whole, rather than drop its update) and what was kept is dropped
    header = pb.PushHeader(round=task.train.round, update_id="resume-2", num_samples=push.num_samples)
    progress, _, _ = _break_off(service, a, header, tensors, spool, 2, part=False)
    assert (progress.kept, progress.tensors, progress.offset) == (True, 2, 0)
    changed = pb.PushHeader(round=task.train.round, update_id="resume-2", num_samples=push.num_samples + 1, resume=True)
    with pytest.raises(grpc.RpcError) as info:
        framing.push_update(service.channel)(framing.push_messages(changed, entries, start=(2, 0)), metadata=a.auth)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "repeats its first attempt's round, num_samples and metrics" in info.value.details()
    assert not progress_of("resume-2").kept
    assert wait_until(lambda: spool_files(spool) == [], 30), "the dropped spool file closed"

    # broken again, then another client cannot see or continue it
    progress, _, _ = _break_off(service, a, header, tensors, spool, 2, part=False)
    assert progress.kept
    b, _ = (register(service.stub, 1.0, d) for d in shards(2))
    assert not service.stub.GetUploadProgress(pb.UploadProgressRequest(update_id="resume-2"), metadata=b.auth).kept

    # the same update pushed whole drops what was kept, and is stored once
    header.ClearField("resume")
    reply = framing.push_update(service.channel)(framing.push_messages(header, entries), metadata=a.auth)
    assert reply.accepted and not reply.duplicate
    assert not progress_of("resume-2").kept
    assert wait_until(lambda: spool_files(spool) == [], 30), "the kept spool file closed"
    with store.session_factory(store.create_engine_for(url))() as s:
        assert store.count_updates(s, store.get_federation(s, "default"), task.train.round) == 1


def test_kept_push_bytes_zero_keeps_nothing(start_service, sqlite_url, tmp_path) -> None:
    service, a, task, push, spool = _setup(start_service, sqlite_url, tmp_path, kept_push_bytes=0)
    header = pb.PushHeader(round=task.train.round, update_id="not-kept", num_samples=push.num_samples)
    progress, _, _ = _break_off(service, a, header, list(push.tensors.items()), spool, 1)
    assert not progress.kept
    assert wait_until(lambda: spool_files(spool) == [], 30), "the broken push's spool file closed"
    with pytest.raises(ValidationError, match="kept_push_bytes"):
        AggregatorSettings(kept_push_bytes=-1)
    for seconds in (0, -1, 86_401):
        with pytest.raises(ValidationError, match="kept_push_seconds"):
            AggregatorSettings(kept_push_seconds=seconds)


def test_the_ticker_lets_go_of_a_kept_push_past_its_lifetime_on_an_idle_server(start_service, sqlite_url, tmp_path):
    """No push breaks off or resumes after it, no GetUploadProgress: only the ticker's housekeeping closes it."""
    service, a, task, push, spool = _setup(start_service, sqlite_url, tmp_path)
    servicer = service.server.aggregator_servicer
    ticker = DeadlineTicker(service.coordinator, interval=0.05, housekeeping=servicer.housekeeping)
    ticker.start()
    try:
        header = pb.PushHeader(round=task.train.round, update_id="idle", num_samples=push.num_samples)
        progress, held, _ = _break_off(service, a, header, list(push.tensors.items()), spool, 1)
        assert progress.kept and spool_files(spool) == [held]
        servicer._kept.ttl_seconds = 0.5  # its hour, shortened once it is kept
        assert wait_until(lambda: spool_files(spool) == [], 30), "the ticker closed the kept spool file"
        assert ticker.is_alive() and ticker.failures == 0
    finally:
        ticker.stop()
        ticker.join(10)
    assert not service.stub.GetUploadProgress(pb.UploadProgressRequest(update_id="idle"), metadata=a.auth).kept


SERVED = f"""
enrollment_secret = "{SECRET}"
kept_push_seconds = 2

[federation]
model = "digits-cnn"
factorization = "atoms"
tiers = [1.0]
fraction = 1.0
min_clients = 2
rounds = 2
"""


def test_fedatoms_aggregator_serve_lets_go_of_a_kept_push_on_its_own_and_stops_cleanly(tmp_path) -> None:
    """A real ``fedatoms aggregator serve`` process: its ticker runs the housekeeping, so a kept push's spool
    file is closed once ``kept_push_seconds`` pass while nothing else happens; SIGTERM then stops it, exit 0."""
    spool = tmp_path / "spool"
    spool.mkdir()
    config = tmp_path / "federation.toml"
    config.write_text(SERVED.replace("kept_push_seconds = 2", f'kept_push_seconds = 2\nspool_dir = "{spool}"'))
    port, log = free_port(), tmp_path / "server.log"
    cmd = [sys.executable, "-m", "fedatoms", "aggregator", "serve", "--config", str(config)]
    cmd += ["--listen", f"127.0.0.1:{port}", "--database-url", f"sqlite:///{tmp_path / 'fedatoms.db'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        wait_serving(f"127.0.0.1:{port}")
        served = SimpleNamespace(stub=pb_grpc.AggregatorStub(channel))
        a, _ = (register(served.stub, 1.0, d) for d in shards(2))  # a second member keeps the round open
        task = a.task()
        a.fetch()
        push = a.train(task)
        header = pb.PushHeader(round=task.train.round, update_id="served", num_samples=push.num_samples)
        progress, held, _ = _break_off(served, a, header, list(push.tensors.items()), spool, 1, pid=proc.pid)
        assert progress.kept and spool_files(spool, proc.pid) == [held]
        assert wait_until(lambda: spool_files(spool, proc.pid) == [], 30), "the served ticker closed the spool file"
        progress = served.stub.GetUploadProgress(pb.UploadProgressRequest(update_id="served"), metadata=a.auth)
        assert not progress.kept
        # broken again, and kept while the server stops: it stops all the same
        assert _break_off(served, a, header, list(push.tensors.items()), spool, 1, pid=proc.pid)[0].kept
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "event=stopped" in log.read_text()


def test_a_failing_housekeeping_is_a_failing_tick_and_runs_when_the_tick_fails(
    start_service, sqlite_url, monkeypatch, caplog
) -> None:
    service = start_service(sqlite_url)
    ran: list[bool] = []
    failure = [OSError("spool unreadable")]

    def housekeeping() -> None:
        ran.append(True)
        if failure:
            raise failure.pop()

    def database_away() -> None:
        raise RuntimeError("database away")

    ticker = DeadlineTicker(service.coordinator, housekeeping=housekeeping)
    caplog.set_level(logging.INFO, logger="fedatoms.aggregator")
    ticker.tick_once()  # the housekeeping fails
    with monkeypatch.context() as patch:
        patch.setattr(service.coordinator, "tick", database_away)
        ticker.tick_once()  # the coordinator's tick fails: the housekeeping runs all the same
    ticker.tick_once()
    records = [r for r in caplog.records if r.getMessage().startswith(("event=tick_failed", "event=tick_recovered"))]
    assert [r.getMessage() for r in records] == [
        'event=tick_failed failures=1 error="OSError: spool unreadable"',
        'event=tick_failed failures=2 error="RuntimeError: database away"',
        "event=tick_recovered failures=2",
    ]
    assert [r.exc_info is not None for r in records] == [True, True, False]
    assert len(ran) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resume_that_does_not_continue_the_kept_stream_starts_over(start_service, request, backend, tmp_path) -> None:
    """Its tensors in another order (a client rebuilt the update differently): ABORTED, which the client
    retries by pushing whole, and what was kept is dropped; the whole push is then stored as sent."""
    url = _url(request, backend)
    service, a, task, push, spool = _setup(start_service, url, tmp_path)
    tensors = list(push.tensors.items())
    header = pb.PushHeader(round=task.train.round, update_id="reordered", num_samples=push.num_samples)
    progress, _, _ = _break_off(service, a, header, tensors, spool, 2, part=False)
    assert (progress.kept, progress.tensors, progress.offset) == (True, 2, 0)

    header.resume = True
    reordered = [(n, t, 0, pb.TENSOR_KIND_MODEL) for n, t in reversed(tensors)]
    with pytest.raises(grpc.RpcError) as info:
        framing.push_update(service.channel)(framing.push_messages(header, reordered, start=(2, 0)), metadata=a.auth)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "does not continue what is kept of update 'reordered'" in info.value.details()
    assert not service.stub.GetUploadProgress(pb.UploadProgressRequest(update_id="reordered"), metadata=a.auth).kept
    assert wait_until(lambda: spool_files(spool) == [], 30), "the dropped spool file closed"

    header.ClearField("resume")
    reply = framing.push_update(service.channel)(framing.push_messages(header, reordered), metadata=a.auth)
    assert reply.accepted and not reply.duplicate
    service.stop()
    stored = stored_update(url, task.train.round)
    for name, tensor in push.tensors.items():
        np.testing.assert_array_equal(stored[name], tensor.numpy())


def test_an_agent_pushing_a_saved_update_asks_first_and_sends_only_the_rest(start_service, sqlite_url, tmp_path):
    """``push(resume=True)``, what the agent does with an update an earlier process saved: the server holds its
    first tensors, so fewer bytes than the update cross the link, and the update is stored as sent."""
    service, a, task, push, spool = _setup(start_service, sqlite_url, tmp_path)
    tensors = sorted(push.tensors.items())  # the order client_agent sends
    header = pb.PushHeader(round=task.train.round, update_id="saved", num_samples=push.num_samples)
    progress, held, _ = _break_off(service, a, header, tensors, spool, len(tensors) - 1, part=False)
    assert progress.kept and progress.tensors == len(tensors) - 1
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    proxy = LinkProxy(service.port)
    agent = AggregatorClient(proxy.target, token=a.token)
    try:
        reply = agent.push(task.train.round, "saved", push.num_samples, {}, dict(push.tensors), resume=True)
    finally:
        agent.close()
        proxy.close()
    assert reply.accepted and not reply.duplicate
    assert proxy.up_bytes < total - held + 64 * 1024  # the last tensor and the calls' framing, not the update
    service.stop()
    stored = stored_update(sqlite_url, task.train.round)
    for name, tensor in push.tensors.items():
        np.testing.assert_array_equal(stored[name], tensor.numpy())


def test_one_progress_call_per_client_waits_at_a_time(start_service, sqlite_url, tmp_path) -> None:
    """GetUploadProgress ends the client's push in flight and waits for it; a push waiting at the full gate
    ends only once it gets in. A second GetUploadProgress of the same client meanwhile is UNAVAILABLE, so
    the call cannot hold more than one server thread per client."""
    service, a, task, push, spool = _setup(start_service, sqlite_url, tmp_path, max_concurrent_pushes=1)
    c = register(service.stub, 1.0, shards(1)[0])  # enrolled after round 1 opened: its push still takes the gate
    servicer = service.server.aggregator_servicer
    name, tensor = sorted(push.tensors.items())[0]
    first = next(codec.iter_chunks(name, codec.encode(tensor, name=name), chunk_bytes=64))
    stall = threading.Event()

    def stalled(update_id: str, chunk: bool):
        yield pb.PushMessage(header=pb.PushHeader(round=task.train.round, update_id=update_id, num_samples=10))
        if chunk:
            yield pb.PushMessage(chunk=framing.from_chunk(first, pb.TENSOR_KIND_MODEL))
        stall.wait(60)

    inside = service.stub.PushUpdate.future(stalled("c-1", True), metadata=c.auth)
    waiting = None
    asked = None
    try:
        # a's push starts only once c's holds the gate: started together, either could get in first
        assert wait_until(lambda: spool_files(spool) == [64], 30), "c's push holds the gate's one slot"
        waiting = service.stub.PushUpdate.future(stalled("a-1", False), metadata=a.auth)
        assert wait_until(lambda: servicer._pushes.in_line == 1, 30), "a's push waits in the gate's line"
        request = pb.UploadProgressRequest(update_id="a-1")
        asked = service.stub.GetUploadProgress.future(request, metadata=a.auth)
        assert wait_until(lambda: a.client_id in servicer._progress_calls, 30), "the first one waits for a's push"
        with pytest.raises(grpc.RpcError) as second:
            service.stub.GetUploadProgress(request, metadata=a.auth, timeout=30)
        assert second.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "already waiting" in (second.value.details() or "")
    finally:
        stall.set()  # c's stream ends: a's push gets in, finds itself ended, and the first call answers
    answer = asked.result(timeout=30) if asked is not None else None
    assert answer is not None and (answer.tensors, answer.offset) == (0, 0)  # a's push had sent no chunk
    for call in (inside, waiting):
        with pytest.raises((grpc.RpcError, grpc.FutureCancelledError)):
            call.result(timeout=30)
    assert servicer._progress_calls == set()
