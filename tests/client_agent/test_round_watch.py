"""A worker process's shared parts: one heartbeat stream (slow while an agent trains), one compute slot."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from processes import SECRET

from aggregator_service import store
from aggregator_service.config import AggregatorSettings, FederationConfig
from aggregator_service.coordinator import Coordinator
from aggregator_service.server import build_server
from client_agent.pacing import ComputeSlot, RoundWatch
from client_agent.transport import AggregatorClient
from fedcore.tiers import CapabilityProfile


def test_the_watch_asks_rarely_while_an_agent_trains_and_at_once_when_it_is_done(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'agg.db'}"
    settings = AggregatorSettings(
        listen="127.0.0.1:0", database_url=url, enrollment_secret=SECRET, federation=FederationConfig(rounds=2)
    )
    store.upgrade(url)
    coordinator = Coordinator(settings, store.session_factory(store.create_engine_for(url)), enrollment_iterations=1000)
    server, port, _ = build_server(settings, coordinator, max_workers=4)
    server.start()
    client = AggregatorClient(f"127.0.0.1:{port}")
    beats: list[float] = []
    real = client.heartbeat

    def counted(*, retry: bool = True):  # the real call over gRPC, timestamped
        reply = real(retry=retry)
        beats.append(time.monotonic())
        return reply

    client.heartbeat = counted  # type: ignore[method-assign]
    watch = RoundWatch(client, interval=0.01, training_interval=0.5)
    try:
        client.register(CapabilityProfile(num_samples=10), SECRET)
        watch.start()
        time.sleep(1.0)
        idle = len(beats)
        assert idle >= 10, idle  # every ~10 ms (plus the call) while nobody trains

        done = threading.Event()

        def train() -> None:
            with watch.training():
                done.wait()

        trainer = threading.Thread(target=train)
        trainer.start()
        time.sleep(0.3)  # the watch may be mid-wait of the fast interval when training starts
        before = len(beats)
        time.sleep(1.2)
        assert len(beats) - before <= 4, len(beats) - before  # every 0.5 s while an agent trains
        finished = time.monotonic()
        done.set()
        trainer.join()
        time.sleep(0.8)
        after = [t for t in beats if t > finished]
        # asked again as soon as training ended (the call's own time under load aside), well before 0.5 s
        assert after and after[0] - finished < 0.4, after[:1]
        assert len(after) >= 5  # and fast again
    finally:
        watch.stop()
        client.close()
        server.stop(None)


def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


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
    _until(lambda: slot._waiting[False] == 3)  # the evaluations wait first ...
    trains = [threading.Thread(target=training, args=(i,)) for i in range(3)]
    for t in trains:
        t.start()
    _until(lambda: slot._waiting[True] == 3)
    release.set()  # ... yet every waiting training goes before them
    for t in [holder, *evals, *trains]:
        t.join(timeout=10)
    assert sorted(order[:3]) == ["train-0", "train-1", "train-2"]
    assert sorted(order[3:]) == ["eval-0", "eval-1", "eval-2"]
