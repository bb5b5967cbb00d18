"""GetTask long polls over real gRPC: a held call answers the moment a task is ready, never later than
asked, never for a client that did not ask (old clients), and never takes the threads other calls need."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_helpers import register, shards

from fedwire.v1 import aggregator_pb2 as pb


def _task(client, wait: float, timeout: float = 60) -> tuple[pb.Task, float]:
    """GetTask with ``wait_seconds``; the answer and how long the call took."""
    started = time.monotonic()
    task = client.stub.GetTask(pb.GetTaskRequest(wait_seconds=wait), metadata=client.auth, timeout=timeout)
    return task, time.monotonic() - started


def test_a_held_poll_answers_when_the_round_opens_and_when_it_closes(start_service, sqlite_url) -> None:
    service = start_service(sqlite_url)  # min_clients = 2
    data = shards(2)
    a = register(service.stub, 1.0, data[0])
    with ThreadPoolExecutor(2) as pool:
        # a alone: no round can open, so its poll is held …
        held = pool.submit(_task, a, 25.0)
        time.sleep(1.0)
        assert not held.done()
        # … until b enrolls: the round opens, and a's held call answers with its task, long before its 25 s
        b = register(service.stub, 1.0, data[1])
        task_a, took = held.result(timeout=20)
        first_b, _ = _task(b, 0.0)
        assert first_b.WhichOneof("kind") == "train"
        assert task_a.WhichOneof("kind") == "train" and task_a.train.round == first_b.train.round == 1
        assert took < 20

        # a pushes first; its next poll waits for the round to close, which b's push does
        a.fetch()
        push_a = a.train(task_a)
        assert a.push(1, push_a.tensors, num_samples=push_a.num_samples).accepted
        held = pool.submit(_task, a, 25.0)
        time.sleep(1.0)
        assert not held.done()
        b.fetch()
        push_b = b.train(first_b)
        assert b.push(1, push_b.tensors, num_samples=push_b.num_samples).accepted
        task_a, took = held.result(timeout=20)
        assert task_a.WhichOneof("kind") == "train" and task_a.train.round == 2
        assert took < 20


def test_an_old_client_without_wait_seconds_gets_its_answer_at_once(start_service, sqlite_url) -> None:
    service = start_service(sqlite_url, poll_interval_seconds=2.5)
    (a,) = (register(service.stub, 1.0, d) for d in shards(1))
    started = time.monotonic()
    task = a.stub.GetTask(pb.GetTaskRequest(), metadata=a.auth, timeout=10)
    assert time.monotonic() - started < 2.0
    assert task.WhichOneof("kind") == "wait" and task.wait.retry_after_seconds == 2.5


def test_a_hold_ends_at_its_wait_seconds_with_retry_now(start_service, sqlite_url) -> None:
    service = start_service(sqlite_url, poll_interval_seconds=2.5)
    (a,) = (register(service.stub, 1.0, d) for d in shards(1))
    task, took = _task(a, 1.5)
    assert task.WhichOneof("kind") == "wait"
    assert task.wait.retry_after_seconds == 0.0  # the server already waited
    assert 1.4 <= took < 10


def test_a_hold_ends_before_the_callers_deadline(start_service, sqlite_url) -> None:
    service = start_service(sqlite_url)
    (a,) = (register(service.stub, 1.0, d) for d in shards(1))
    task, took = _task(a, 30.0, timeout=3.0)  # no DEADLINE_EXCEEDED: the server answers within the deadline
    assert task.WhichOneof("kind") == "wait"
    assert took < 3.0


@pytest.mark.parametrize("wait", [float("nan"), float("inf"), -1.0])
def test_a_wait_that_is_no_duration_is_invalid_argument(start_service, sqlite_url, wait) -> None:
    service = start_service(sqlite_url)
    (a,) = (register(service.stub, 1.0, d) for d in shards(1))
    with pytest.raises(grpc.RpcError) as err:
        a.stub.GetTask(pb.GetTaskRequest(wait_seconds=wait), metadata=a.auth, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "wait_seconds" in err.value.details()


def test_held_polls_past_the_bound_answer_at_once_and_heartbeats_go_on(start_service, sqlite_url) -> None:
    # 8 workers (the fixture's) + 2 holders: the third long poll is answered at once, and with both
    # holders taken, every worker is still free for heartbeats
    service = start_service(sqlite_url, long_poll_waiters=2, poll_interval_seconds=2.5)
    clients = [register(service.stub, 1.0, d) for d in shards(1)] * 3
    with ThreadPoolExecutor(3) as pool:
        holds = [pool.submit(_task, c, 20.0) for c in clients[:2]]
        time.sleep(1.0)
        assert not any(h.done() for h in holds)
        task, took = _task(clients[2], 20.0)
        assert task.WhichOneof("kind") == "wait" and task.wait.retry_after_seconds == 2.5
        assert took < 5
        for _ in range(20):
            beat = clients[0].stub.Heartbeat(pb.HeartbeatRequest(), metadata=clients[0].auth, timeout=5)
            assert beat.current_round == 0
        assert not any(h.done() for h in holds)
        service.coordinator.shared.stop_waiting()  # shutdown answers held calls now
        for h in holds:
            task, took = h.result(timeout=10)
            assert task.WhichOneof("kind") == "wait" and took < 15


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_close_in_flight_holds_no_plain_poll(start_service, request, backend) -> None:
    """While a close computes (held in its strategy by the test), a plain GetTask is answered at once with a
    Wait that says so, Heartbeat answers too, and a held long poll waits for the outcome and then gets the
    next round's task; the close itself ends as it would have."""
    import close_gate
    from grpc_helpers import small_federation

    url = request.getfixturevalue(f"{backend}_url")
    close_gate.ENTERED.clear()
    close_gate.RELEASE.clear()
    service = start_service(url, small_federation(strategy="close_gate:GatedFedAvg"), poll_interval_seconds=3.0)
    a, b = (register(service.stub, t, d) for t, d in zip([1.0, 0.25], shards(2), strict=True))
    tasks = {c.client_id: _task(c, 0.0)[0] for c in (a, b)}
    pushes = {}
    for c in (a, b):
        c.fetch()
        pushes[c.client_id] = c.train(tasks[c.client_id])
    assert a.push(1, pushes[a.client_id].tensors, num_samples=pushes[a.client_id].num_samples).accepted
    with ThreadPoolExecutor(2) as pool:
        try:
            completing = pool.submit(
                b.push, 1, pushes[b.client_id].tensors, num_samples=pushes[b.client_id].num_samples
            )
            assert close_gate.ENTERED.wait(30), "the close never started"
            for c in (a, b):
                task, took = _task(c, 0.0, timeout=5)  # before the change: held until the close ended
                assert task.WhichOneof("kind") == "wait" and task.wait.reason == "round 1 is closing", task
                assert task.wait.retry_after_seconds == 3.0 and took < 2.0
            beat = a.stub.Heartbeat(pb.HeartbeatRequest(), metadata=a.auth, timeout=5)
            assert beat.current_round == 1 and beat.last_closed_round == 0
            held = pool.submit(_task, a, 25.0)
            time.sleep(0.5)
            assert not held.done() and not completing.done()
        finally:
            close_gate.RELEASE.set()
        assert completing.result(timeout=30).accepted
        task_a, _ = held.result(timeout=30)
    assert task_a.WhichOneof("kind") == "train" and task_a.train.round == 2
