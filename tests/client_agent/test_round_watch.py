"""A worker process's shared parts: one heartbeat stream (slow while an agent trains), one compute slot."""

from __future__ import annotations

import threading

from support import wait_until

from client_agent.pacing import ComputeSlot, RoundWatch
from fedwire.v1 import aggregator_pb2 as pb


class Client:
    """A stand-in for AggregatorClient: each heartbeat is counted and answers the same reply."""

    def __init__(self) -> None:
        self.beats = 0

    def heartbeat(self, *, retry: bool = True) -> pb.HeartbeatReply:
        self.beats += 1
        return pb.HeartbeatReply(current_round=1, last_closed_round=0)


def test_the_watch_asks_rarely_while_an_agent_trains_and_at_once_when_it_is_done() -> None:
    client = Client()
    # a training interval no test run reaches: while an agent trains, the watch asks only once more at most
    watch = RoundWatch(client, interval=0.01, training_interval=3600)  # type: ignore[arg-type]
    watch.start()
    try:
        assert wait_until(lambda: client.beats >= 10), client.beats  # every ~10 ms while nobody trains
        assert watch.wait(lambda beat: beat.current_round == 1, timeout=10).current_round == 1

        with watch.training():
            started = client.beats
            # the call in flight when training began may finish, and then the watch waits for the agent;
            # a watch that kept the fast interval would ask ~20 more times in this 0.2 s
            assert not wait_until(lambda: client.beats > started + 1, timeout=0.2), client.beats - started
            during = client.beats
        # asked again as soon as the last agent is done (not after the hour), and fast again
        assert wait_until(lambda: client.beats > during), "no heartbeat after the training ended"
        assert wait_until(lambda: client.beats >= during + 10), client.beats - during
    finally:
        watch.stop()


def test_the_compute_slot_gives_trainings_precedence_over_deferred_evaluations() -> None:
    slot = ComputeSlot()
    order: list[str] = []
    holder_in, release = threading.Event(), threading.Event()

    def hold() -> None:
        with slot:
            holder_in.set()
            release.wait()

    def evaluation(i: int) -> None:
        with slot.deferred():
            order.append(f"eval-{i}")

    def training(i: int) -> None:
        with slot:
            order.append(f"train-{i}")

    holder = threading.Thread(target=hold)
    holder.start()
    holder_in.wait()
    evals = [threading.Thread(target=evaluation, args=(i,)) for i in range(3)]
    for t in evals:
        t.start()
    assert wait_until(lambda: slot._waiting[False] == 3)  # the evaluations wait first ...
    trains = [threading.Thread(target=training, args=(i,)) for i in range(3)]
    for t in trains:
        t.start()
    assert wait_until(lambda: slot._waiting[True] == 3)
    release.set()  # ... yet every waiting training goes before them
    for t in [holder, *evals, *trains]:
        t.join(timeout=10)
        assert not t.is_alive()
    assert sorted(order[:3]) == ["train-0", "train-1", "train-2"]
    assert sorted(order[3:]) == ["eval-0", "eval-1", "eval-2"]
