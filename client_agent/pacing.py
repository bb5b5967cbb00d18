"""Pacing for many agents in one simulation worker process: one heartbeat stream, one CPU slot.

A real device runs one agent, which polls for itself and owns its CPU. The simulation pool
(:mod:`client_agent.pool`) runs many agents per process: :class:`RoundWatch` lets them
wait on one shared heartbeat instead of each polling the server, and :class:`ComputeSlot`
lets them take turns on the process's one torch thread, trainings before evaluations, so
the round's pushes are not held up by evaluations of the previous round.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import grpc

from client_agent.transport import AggregatorClient
from fedwire.v1 import aggregator_pb2 as pb

__all__ = ["ComputeSlot", "RoundWatch"]


class RoundWatch:
    """One heartbeat stream for many agents in a process: they wait on it instead of each polling the server.

    A thread calls ``Heartbeat`` every ``interval`` seconds with ``client`` (any enrolled identity)
    and wakes the waiters whenever the reply changes. While an agent of the process is still
    training (:meth:`training`), the open round cannot close before its push (short of a
    deadline), so the thread asks only every ``training_interval`` seconds, and again as soon as
    the last one is done: a third of the heartbeats, with no later notice of a close.
    """

    def __init__(self, client: AggregatorClient, interval: float = 0.02, training_interval: float = 0.25) -> None:
        self.client, self.interval, self.training_interval = client, interval, training_interval
        self._latest: pb.HeartbeatReply | None = None
        self._training = 0  # agents of this process between a Train task and its push
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="round-watch", daemon=True)

    def start(self) -> RoundWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        self._thread.join(timeout=15)

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Held by an agent from its Train task until its push is answered."""
        with self._changed:
            self._training += 1
        try:
            yield
        finally:
            with self._changed:
                self._training -= 1
                if not self._training:
                    self._changed.notify_all()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                beat = self.client.heartbeat(retry=False)
            except grpc.RpcError:
                self._stop.wait(0.5)  # the agents' own calls retry and report; this one only waits
                continue
            with self._changed:
                last = self._latest
                if last is None or (last.current_round, last.last_closed_round) != (
                    beat.current_round,
                    beat.last_closed_round,
                ):
                    self._latest = beat
                    self._changed.notify_all()
                if self._training:
                    self._changed.wait_for(lambda: not self._training or self._stop.is_set(), self.training_interval)
                    continue
            self._stop.wait(self.interval)

    def wait(self, ready: Callable[[pb.HeartbeatReply], bool], timeout: float) -> pb.HeartbeatReply:
        """The latest reply once ``ready`` holds for it, else after ``timeout`` seconds (asked afresh if none yet)."""
        with self._changed:
            self._changed.wait_for(lambda: self._latest is not None and ready(self._latest), timeout)
            if self._latest is not None:
                return self._latest
        return self.client.heartbeat()


class ComputeSlot:
    """The one CPU slot the agents of a worker process take turns on: trainings first.

    ``with slot:`` is a training; ``with slot.deferred():`` an evaluation, which waits while any
    training waits. The round closes only after the last push, so evaluations of the previous
    round's model then fill the time the worker would idle through the close.
    """

    def __init__(self) -> None:
        lock = threading.Lock()
        # one condition per kind, so a release wakes one waiter, not all of a worker's agents
        self._training, self._evaluation = threading.Condition(lock), threading.Condition(lock)
        self._lock = lock
        self._busy = False
        self._waiting = {True: 0, False: 0}  # training? → waiters

    def _acquire(self, training: bool) -> None:
        cond = self._training if training else self._evaluation
        with self._lock:
            self._waiting[training] += 1
            try:
                cond.wait_for(lambda: not self._busy and (training or not self._waiting[True]))
            finally:
                self._waiting[training] -= 1
            self._busy = True

    def _release(self) -> None:
        with self._lock:
            self._busy = False
            if self._waiting[True]:
                self._training.notify()
            elif self._waiting[False]:
                self._evaluation.notify()

    def __enter__(self) -> None:
        self._acquire(True)

    def __exit__(self, *exc: object) -> None:
        self._release()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._acquire(False)
        try:
            yield
        finally:
            self._release()
