"""An edge device's loop: register once, then poll, fetch what changed, train, push, evaluate.

:class:`Agent` is a small state machine driven by :meth:`Agent.step`, so one process can run
one agent (``fedatoms client run``: :meth:`Agent.run` with a heartbeat thread) or many
(:mod:`client_agent.pool`: a scheduler interleaves their steps). Every transition is saved
to the state directory before the next network call, which gives the restart rules:

- the token lives in ``credentials.json``: a restarted agent never registers again;
- a trained update is saved with its ``update_id`` before it is pushed: after a crash or a
  dropped link it is pushed again with the same id and the server counts it once;
- a crash during training loses only that training: the server hands out the same task
  (same seed) again, and the client's tensors were not yet overwritten on disk.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import torch

from client_agent.allowed_models import DEFAULT_ALLOWED_MODELS, check_model_allowed
from client_agent.memory import out_of_memory
from client_agent.pacing import ComputeSlot, RoundWatch
from client_agent.state import ClientState, PendingUpdate, TakenUpdate, sync_directory
from client_agent.transport import (
    LONG_POLL_SECONDS,
    RETRYABLE,
    AggregatorClient,
    Fetched,
    Stopped,
    Unauthenticated,
    task_from_proto,
)
from client_agent.update import ClientEvaluation, evaluate_client, on_device, run_task
from fedcore.data import check_labels
from fedcore.model_input import Normalization, fit_to_model, needs_fitting
from fedcore.spec import ModelSpec
from fedcore.tiers import CapabilityProfile
from fedcore.training import Dataset
from fedcore.training.terms import MOVE_GROUPS, scale_move
from fedwire.v1 import aggregator_pb2 as pb

__all__ = ["CREDENTIALS_FILE", "EXIT_CODES", "Agent", "Credentials", "TrainingDiverged", "UpdateRefused"]

log = logging.getLogger("fedatoms.client")

CREDENTIALS_FILE = "credentials.json"
#: ``fedatoms client run`` exit codes.
EXIT_CODES = {
    "done": 0,  # the federation finished
    "usage": 2,  # bad flags, unreadable profile or data
    "unauthenticated": 3,  # wrong enrollment secret, or the token was revoked / is unknown
    "unreachable": 4,  # gave up after --give-up-after seconds of network failures
    "diverged": 5,  # local training produced NaN/Inf: lower the federation's learning rate
    "out_of_memory": 6,  # the tier's model does not fit this device's memory: enroll anew, declaring less
    "interrupted": 130,  # SIGINT / SIGTERM
}


class TrainingDiverged(RuntimeError):
    """Local training produced NaN or Inf; pushing it would only be refused (INVALID_ARGUMENT)."""


class UpdateRefused(RuntimeError):
    """The aggregator refused an update as invalid, and this agent was told that ends its run (a simulation's)."""


@dataclass(frozen=True)
class Credentials:
    """Who this device is to the aggregator; written once, readable by the owner only."""

    client_id: str
    token: str
    tier: float
    model_spec_json: str
    federation: str
    heartbeat_interval_seconds: float
    #: the federation's input normalization ({mean, std}), or None: this client's own statistics
    normalization: dict[str, list[float]] | None = None

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{CREDENTIALS_FILE}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.__dict__, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / CREDENTIALS_FILE)
        sync_directory(directory)  # the rename too: a power cut now must not lose the identity registered

    @classmethod
    def load(cls, directory: Path) -> Credentials | None:
        path = directory / CREDENTIALS_FILE
        if not path.exists():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:  # truncated JSON, a key missing or unknown
            raise ValueError(
                f"{path}: not readable credentials ({exc}); restore it from a backup, or delete the state directory "
                "to enroll this device anew"
            ) from None


class Agent:
    """One client of the federation, durable in ``state_dir``."""

    def __init__(
        self,
        client: AggregatorClient,
        state_dir: str | Path,
        train_data: Dataset,
        test_data: Dataset | None = None,
        *,
        profile: CapabilityProfile | None = None,
        enrollment_secret: str = "",
        name: str | None = None,
        progress: bool = False,
        eval_poll_seconds: float = 1.0,
        compute_lock: threading.Lock | ComputeSlot | None = None,
        durable: bool = True,
        keep_state: bool = True,
        round_watch: RoundWatch | None = None,
        defer_evaluation: bool = False,
        long_poll_seconds: float = LONG_POLL_SECONDS,
        allowed_models: tuple[str, ...] = DEFAULT_ALLOWED_MODELS,
        device: str | None = None,
        refusal_ends_run: bool = False,
    ) -> None:
        self.client = client
        self.state_dir = Path(state_dir)
        self.train_data = train_data
        self.test_data = test_data
        self.profile = profile or CapabilityProfile(num_samples=len(train_data))
        self.enrollment_secret = enrollment_secret
        self.name = name
        self.progress = progress
        self.eval_poll_seconds = eval_poll_seconds
        # agents sharing a process take turns on the CPU, while their network waits overlap
        self.compute_lock = compute_lock or threading.Lock()
        # True: fsync every save, and save after every step. False (a simulation's virtual clients): no
        # fsync, and no save that only spares a repeat after a crash (a re-push is acknowledged as a
        # duplicate, a re-report is ignored); the update and personal state are still saved after training
        self.durable = durable
        # False: the state is never written (a simulation in a temporary directory nobody can resume from)
        self.keep_state = keep_state
        self.round_watch = round_watch  # shared by the agents of one process: one heartbeat stream, not one each
        self._warned_move_scale = False
        # model code the aggregator may make this client import, beyond the zoo (client_agent.allowed_models)
        self.allowed_models = tuple(allowed_models)
        # the torch device this client trains and evaluates on (auto, cpu, cuda[:N]), whatever the task's config
        # names: the device is the client's hardware, not the federation's; None: the task's (the server sends
        # "auto"). client_agent.update.on_device applies it, to both
        self.device = device
        # True (a simulation's virtual clients, which all run this code): an update the aggregator refuses as
        # invalid raises UpdateRefused, as diverged training does. Its round would wait for it until the
        # deadline; a device drops the update and trains the next round it is given
        self.refusal_ends_run = refusal_ends_run
        self.credentials: Credentials | None = None
        self.spec: ModelSpec | None = None
        self.state: ClientState | None = None
        # the agent holds the global model as of this round's close, or later (in memory: a restart fetches)
        self._model_round: int | None = None
        self._unsaved = False  # an optional save was skipped (see :meth:`_save`)
        # an evaluation not yet reported: it travels with the next GetTask (one call fewer per round)
        self._report: pb.EvaluationReport | None = None
        # True (virtual clients): evaluate a closed round's model after training the next round, on a
        # snapshot of what evaluation reads, at low priority (ComputeSlot.deferred)
        self.defer_evaluation = defer_evaluation
        self._deferred: tuple[int, ClientState] | None = None
        # GetTask is held by the server up to this long while there is nothing to do (0: plain polls)
        self.long_poll_seconds = long_poll_seconds
        self.stop = threading.Event()  # set: a held GetTask ends now (run() and the pool's driver share theirs)
        self._fitted = False  # the data are the model's input (see :meth:`_fit_data`)
        # the heartbeat thread's refusal (a revoked token): it ends the run as the main loop's own would
        self._refused: Unauthenticated | None = None

    # ------------------------------------------------------------------ identity

    def ensure_registered(self) -> Credentials:
        """Load the saved identity, or register (once) and save it."""
        creds = Credentials.load(self.state_dir)
        if creds is None:
            kept = ClientState.load(self.state_dir)
            if kept is not None:  # registering now would leave an orphan client, and this state refused after it
                raise ValueError(
                    f"{self.state_dir}: holds the state of client {kept.client_id} but no {CREDENTIALS_FILE}: restore "
                    "that file, or delete the state directory to enroll this device anew"
                )
            # the reply is saved before its model is checked (below): a refused client keeps its identity
            reply = self.client.register_reply(self.profile, self.enrollment_secret, self.name)
            creds = Credentials(
                reply.client_id,
                reply.token,
                reply.tier,
                reply.model_spec_json,
                reply.federation,
                reply.heartbeat_interval_seconds,
                {"mean": list(reply.normalization_mean), "std": list(reply.normalization_std)}
                if reply.normalization_mean
                else None,
            )
            creds.save(self.state_dir)
            log.info("event=registered client=%s tier=%g federation=%s", creds.client_id, creds.tier, creds.federation)
        else:
            log.info("event=resumed client=%s tier=%g", creds.client_id, creds.tier)
        self.client.token = creds.token
        self.credentials = creds
        # checked at every start, before the reference is imported: a widened allow-list lets a restart go on
        check_model_allowed(creds.model_spec_json, self.allowed_models)
        self.spec = ModelSpec.from_json(creds.model_spec_json)
        state = ClientState.load(self.state_dir)
        if state is not None and state.client_id != creds.client_id:
            raise ValueError(
                f"{self.state_dir}: state belongs to client {state.client_id}, credentials to {creds.client_id}"
            )
        if state is None:
            state = ClientState(creds.client_id, creds.tier)
            self.state = state
            self._save()
        self.state = state
        return creds

    def _fit_data(self) -> None:
        """Images become the model's input (resized, normalized) once the model is known: after Register,
        before the first step (a pool registers its agents without fitting their data)."""
        creds = self.credentials
        assert self.spec is not None and creds is not None
        given = None if creds.normalization is None else Normalization.from_dict(creds.normalization)
        if needs_fitting(self.train_data):
            log.info("event=fitting_data samples=%d input=%s", len(self.train_data), _shape(self.spec.input_shape))
        train, test, used = fit_to_model(
            self.train_data, self.test_data, self.spec.input_shape, given, input_dtype=self.spec.input_dtype
        )
        check_labels(train, self.spec.num_classes)
        if test is not None:
            check_labels(test, self.spec.num_classes)
        if used is not None:
            log.info(
                "event=data_fitted input=%s normalization=%s mean=%s std=%s",
                _shape(self.spec.input_shape),
                "federation" if given is not None else "computed",
                ",".join(f"{v:.4f}" for v in used.mean),
                ",".join(f"{v:.4f}" for v in used.std),
            )
        self.train_data, self.test_data = train, test
        self._fitted = True

    def _save(self, optional: bool = False) -> None:
        """Write the state; an ``optional`` save (one that only spares a repeat) waits when not durable."""
        assert self.state is not None
        if not self.keep_state:
            return
        if optional and not self.durable:
            self._unsaved = True
            return
        self.state.save(self.state_dir, fsync=self.durable)
        self._unsaved = False

    # ------------------------------------------------------------------ the loop

    def step(self) -> float | None:
        """Do the next piece of work; the seconds to wait before the next step, or ``None`` when done."""
        if self.state is None:
            self.ensure_registered()
        if not self._fitted:
            self._fit_data()
        s = self.state
        assert s is not None
        if s.pending is not None:
            self._push_pending(resume=True)  # saved by an earlier step or process: the server may hold part of it
            return 0.0
        if s.evaluate_round is not None:
            r = s.evaluate_round
            if self.round_watch is not None:
                beat = self.round_watch.wait(lambda b: b.last_closed_round >= r or b.current_round != r, timeout=1.0)
            else:
                beat = self.client.heartbeat()
            if (beat.last_closed_round >= r or beat.current_round != r) and s.taken is not None:
                self._settle_taken()  # the round ended: was the update folded? Then look again: settling may wait
                return 0.0
            if beat.last_closed_round >= s.evaluate_round:
                if self.defer_evaluation:
                    self._fetch_to_evaluate_later(beat.last_closed_round)
                else:
                    self._evaluate(beat.last_closed_round)
                return 0.0
            if beat.current_round != s.evaluate_round:  # neither open nor closed: it was abandoned
                log.warning("event=round_abandoned round=%d current=%d", s.evaluate_round, beat.current_round)
                s.evaluate_round = None
                self._save()
                return 0.0
            return self.eval_poll_seconds
        try:
            # held while nothing is to be done; not while an evaluation waits to run after this answer
            wait = self.long_poll_seconds if self._deferred is None else 0.0
            task = self.client.get_task(self._report, wait_seconds=wait, cancel=self.stop)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            if self._report is None or code not in (
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.INVALID_ARGUMENT,
            ):
                raise
            log.warning("event=report_refused round=%d detail=%s", self._report.round, json.dumps(exc.details()))  # type: ignore[attr-defined]
            self._report = None  # the report was the problem: ask again without it
            return 0.0
        self._report = None
        kind = task.WhichOneof("kind")
        if kind == "train":
            self._train(task.train)
            return 0.0
        if kind == "done":
            self._settle_taken()
            if self._deferred is not None:  # the last round's model: no training to go first
                self._evaluate_deferred()
                self._report_now()
            if self._unsaved:
                self._save()
            log.info("event=done reason=%s final_round=%d", json.dumps(task.done.reason), task.done.final_round)
            return None
        log.debug("event=wait reason=%s", json.dumps(task.wait.reason))
        if self._deferred is not None:  # no training of this agent goes first (not in this cohort): evaluate now
            self._evaluate_deferred()
            return 0.0  # the report goes with the next GetTask
        return max(0.0, task.wait.retry_after_seconds)

    def _train(self, train: pb.Task.Train) -> None:
        if not self._settle_taken():  # this round trains from the state the last one left
            return  # stopping
        with self.round_watch.training() if self.round_watch is not None else contextlib.nullcontext():
            self._train_and_push(train)
        if self._deferred is not None:
            self._evaluate_deferred()

    def _train_and_push(self, train: pb.Task.Train) -> None:
        s, spec = self.state, self.spec
        assert s is not None and spec is not None
        task = task_from_proto(train)
        task = replace(task, config=on_device(task.config, self.device))
        scaffold = bool(task.strategy.get("scaffold"))
        fetched_bytes = 0
        # round numbers never repeat, and round r trains a model no round past r − 1 made: a task below the
        # last round trained, or versions at or past the task's round, mean the federation was restored
        # from a backup (an agent that kept running across the restore holds the lost rounds' model)
        if train.round < s.last_round or max(s.versions.values(), default=0) >= train.round:
            log.warning(
                "event=federation_rewound round=%d last_round=%d detail=%s",
                train.round,
                s.last_round,
                json.dumps("the aggregator is behind this client: the whole model is fetched again"),
            )
            s.versions.clear()  # what it holds came from rounds the federation no longer has, some numbered alike
            self._model_round = None
        # round r trains the model round r−1 closed with: the evaluation fetch of r−1 already brought it
        # (no round closes between r−1's close and r's, and r cannot close before this client pushes)
        if scaffold or self._model_round is None or self._model_round < train.round - 1:
            fetched = self._fetch(train.round, include_server_control=scaffold)
            if fetched is None:  # the federation went back past this task's round: ask for the next task
                return
            s.receive(fetched.model)
            self._model_round, fetched_bytes = train.round - 1, fetched.nbytes
            if scaffold:
                task = replace(task, server_control=fetched.control)
        log.info("event=train round=%d fetched_bytes=%d due=%d", train.round, fetched_bytes, len(task.due))
        started = time.perf_counter()
        with self.compute_lock:
            push = run_task(
                s,
                spec,
                task,
                self.train_data,
                personal_atoms=train.personal_atoms,
                progress=self.progress,
                hold_strategy_state=True,  # held aside once the server takes the update, kept once its round closes
            )
        bad = [k for k, v in push.metrics.items() if not math.isfinite(v)]
        bad += [
            n for n, t in {**push.tensors, **(push.control_delta or {})}.items() if not bool(torch.isfinite(t).all())
        ]
        if bad:
            raise TrainingDiverged(
                f"round {train.round}: local training diverged ({', '.join(bad[:4])} not finite) with "
                f"lr={task.config.lr}; the server would refuse the update"
            )
        s.pending = PendingUpdate(
            train.round,
            uuid.uuid4().hex,
            push.num_samples,
            dict(push.metrics),
            push.tensors,
            push.control_delta,
            fp16=bool(task.strategy.get("fp16_transport")),
            strategy_state=push.strategy_state or {},
        )
        s.last_round = train.round
        self._save()  # the update survives a crash from here on, with its id
        log.info("event=trained round=%d seconds=%.2f", train.round, time.perf_counter() - started)
        self._push_pending()

    def _push_pending(self, resume: bool = False) -> None:
        s = self.state
        assert s is not None and s.pending is not None
        p = s.pending
        try:
            reply = self.client.push(
                p.round, p.update_id, p.num_samples, p.metrics, p.tensors, p.control_delta, fp16=p.fp16, resume=resume
            )
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            if code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                raise
            # refused for good (the round is over, or the update is malformed): re-pushing it after a
            # restart would only be refused again, so drop it. A round that closed meanwhile (a lost
            # acknowledgement, then the close) is still evaluated; an abandoned one is skipped.
            level = logging.WARNING if code == grpc.StatusCode.FAILED_PRECONDITION else logging.ERROR
            log.log(
                level, "event=push_refused round=%d code=%s detail=%s", p.round, code.name, json.dumps(exc.details())
            )  # type: ignore[attr-defined]
            s.pending = None  # and its strategy state with it: the server never folds this update
            s.evaluate_round = p.round if self.test_data is not None else None
            self._save()
            if code == grpc.StatusCode.INVALID_ARGUMENT and self.refusal_ends_run:
                who = self.credentials.client_id if self.credentials is not None else "?"
                raise UpdateRefused(
                    f"round {p.round}: the aggregator refused client {who}'s update: {exc.details()}"
                ) from None
            return
        log.info("event=pushed round=%d duplicate=%s message=%s", p.round, reply.duplicate, json.dumps(reply.message))
        if p.strategy_state:  # kept once its round closes (_settle_taken), moved as far as the server folds it
            state = p.strategy_state
            if reply.move_scale == 0.0 and not self._warned_move_scale and MOVE_GROUPS & state.keys():
                self._warned_move_scale = True  # once: a server without the field answers so on every push
                log.warning(
                    "event=move_scale_unknown round=%d hint=if the server clipped this update, its state step is "
                    "kept whole",
                    p.round,
                )
            elif reply.move_scale not in (0.0, 1.0):
                state = scale_move(s.strategy_state, state, reply.move_scale)
            s.taken = TakenUpdate(p.round, state)
        s.pending = None
        s.evaluate_round = p.round if self.test_data is not None else None
        self._save(optional=True)

    def _settle_taken(self) -> bool:
        """Keep the strategy state of the update the server took last if its round closed; drop it if the
        round was abandoned (nothing of it was folded, so the server's mean of these states never saw it).
        ``False`` when the agent stopped before it could learn which."""
        s = self.state
        assert s is not None
        taken = s.taken
        if taken is None:
            return True
        outcome = self.client.heartbeat(round_=taken.round).round_outcome
        while outcome == pb.ROUND_OUTCOME_OPEN:  # a task of a later round cannot come before it ends
            if self.stop.wait(max(self.eval_poll_seconds, 0.05)):
                return False
            outcome = self.client.heartbeat(round_=taken.round).round_outcome
        if outcome == pb.ROUND_OUTCOME_CLOSED:
            s.strategy_state.update(taken.strategy_state)
        elif outcome == pb.ROUND_OUTCOME_UNSPECIFIED:  # a server that cannot say: kept, as it always was
            log.warning(
                "event=round_outcome_unknown round=%d hint=the server predates HeartbeatRequest.round", taken.round
            )
            s.strategy_state.update(taken.strategy_state)
        else:
            known = outcome in pb.RoundOutcome.values()  # a newer server may say more
            name = pb.RoundOutcome.Name(outcome).removeprefix("ROUND_OUTCOME_").lower() if known else str(outcome)
            log.warning("event=strategy_state_dropped round=%d outcome=%s", taken.round, name)
        s.taken = None
        self._save(optional=True)  # settling again after a crash gives the same answer
        return True

    def _evaluate(self, closed: int) -> None:
        """Fetch the model round ``closed`` produced and evaluate it on the local test split (reported with
        the next GetTask)."""
        if not self._fetch_model_of(closed):
            return
        assert self.state is not None
        with self.compute_lock:
            ev = self._evaluation(self.state)
        self._keep_report(closed, ev)
        self.state.evaluate_round = None
        self._save(optional=True)

    def _fetch_model_of(self, closed: int) -> bool:
        """Fetch the model round ``closed`` produced; ``False`` when the federation went back past it."""
        s = self.state
        assert s is not None and self.test_data is not None
        fetched = self._fetch(closed, evaluate=True)
        if fetched is None:
            return False
        s.receive(fetched.model)
        self._model_round = closed
        return True

    def _fetch(self, round_: int, **how: bool) -> Fetched | None:
        """The tensors newer than the state holds, for round ``round_``; ``None`` when the server's federation
        has no round ``round_`` (yet): it was restored from a backup taken before it (:meth:`_rewound`).

        The round was the server's own word (a task, a heartbeat's closed round); a fetch retried across a
        restore reaches a federation that went back, and is refused ``INVALID_ARGUMENT``. Whether that is the
        refusal is asked, not read from its text: a heartbeat says the server's current round and what it
        knows of ``round_``. Any other ``INVALID_ARGUMENT`` is this client's mistake, and raised."""
        s, spec = self.state, self.spec
        assert s is not None and spec is not None
        try:
            return self.client.fetch(spec, s.versions, round_=round_, **how)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:  # type: ignore[attr-defined]
                raise
            beat = self.client.heartbeat(round_=round_)
            # ahead of the server's current round and of its last closed one, and no round the server holds
            # (one abandoned still has its row: a fetch for it is served). A server that predates
            # HeartbeatRequest.round answers UNSPECIFIED: its current round alone decides
            unknown = beat.round_outcome in (pb.ROUND_OUTCOME_UNKNOWN, pb.ROUND_OUTCOME_UNSPECIFIED)
            if not (unknown and round_ > max(beat.current_round, beat.last_closed_round)):
                raise
            self._rewound(round_, beat.current_round, exc.details())  # type: ignore[attr-defined]
            return None

    def _rewound(self, round_: int, server_round: int, detail: str) -> None:
        """The server's federation has no round ``round_``: restored from a backup taken before it. What this
        agent holds of the rounds past ``server_round`` came from rounds the federation no longer has: its
        versions (the whole model is fetched again), the evaluation of such a round, the round it trained last."""
        s = self.state
        assert s is not None
        log.warning(
            "event=federation_rewound round=%d last_round=%d server_round=%d detail=%s",
            round_,
            s.last_round,
            server_round,
            json.dumps(detail),
        )
        s.versions.clear()
        self._model_round = None
        s.last_round = min(s.last_round, server_round)
        s.evaluate_round = None
        if self._report is not None and self._report.round > server_round:
            self._report = None
        self._save()

    def _fetch_to_evaluate_later(self, closed: int) -> None:
        """Fetch round ``closed``'s model now (the next round trains on it) and keep what evaluating it reads."""
        if not self._fetch_model_of(closed):
            return
        s = self.state
        assert s is not None
        personal = dict(s.personal_atoms) if s.personal_atoms is not None else None
        model = dict(s.personal_model) if s.personal_model is not None else None
        # training replaces these tensors, never writes into them: copies of the dicts are a snapshot
        snapshot = replace(
            s, global_tensors=dict(s.global_tensors), local=dict(s.local), personal_atoms=personal, personal_model=model
        )
        self._deferred = (closed, snapshot)
        s.evaluate_round = None
        self._save(optional=True)

    def _evaluate_deferred(self) -> None:
        assert self._deferred is not None
        closed, snapshot = self._deferred
        slot = self.compute_lock
        with slot.deferred() if isinstance(slot, ComputeSlot) else slot:
            ev = self._evaluation(snapshot)
        self._keep_report(closed, ev)
        self._deferred = None

    def _evaluation(self, state: ClientState) -> ClientEvaluation:
        assert self.spec is not None and self.test_data is not None
        return evaluate_client(state, self.spec, self.test_data, self.train_data, device=self.device)

    def _keep_report(self, closed: int, ev: ClientEvaluation) -> None:
        """The evaluation goes with the next GetTask (every flow asks for a task before it evaluates again)."""
        self._report = self.client.evaluation(
            closed, ev.global_accuracy, ev.global_loss, ev.personalized_accuracy, ev.num_samples
        )
        log.info(
            "event=evaluated round=%d accuracy=%.4f personalized=%s",
            closed,
            ev.global_accuracy,
            "-" if ev.personalized_accuracy is None else f"{ev.personalized_accuracy:.4f}",
        )

    def _report_now(self) -> None:
        """Send the pending report on its own (ReportEvaluation) when no GetTask will carry it."""
        report, self._report = self._report, None
        if report is None:
            return
        try:
            self.client.report(report)
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):  # type: ignore[attr-defined]
                raise
            log.warning("event=report_refused round=%d detail=%s", report.round, json.dumps(exc.details()))  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ one agent per process

    def run(self, stop: threading.Event | None = None) -> int:
        """Run until the federation is done (exit code 0), keeping the client online meanwhile."""
        stop = self.stop = stop or threading.Event()
        self.client.stop_on(stop)  # a stop cancels the call in flight and the wait between retries
        with _only_agent(self.state_dir):
            return self._run(stop)

    def _run(self, stop: threading.Event) -> int:
        beat: threading.Thread | None = None
        try:
            creds = self.ensure_registered()
            beat = threading.Thread(
                target=self._heartbeats, args=(stop, creds.heartbeat_interval_seconds), name="heartbeat", daemon=True
            )
            beat.start()
            while not stop.is_set():
                delay = self.step()
                if delay is None:
                    return EXIT_CODES["done"]
                stop.wait(delay)
            if self._refused is not None:
                return _refused(self._refused)
            log.info("event=stopped detail=%s", json.dumps("interrupted between calls"))
            return EXIT_CODES["interrupted"]
        except Stopped:
            if self._refused is not None:  # the heartbeat was refused: the call in flight was cancelled for it
                return _refused(self._refused)
            log.info("event=stopped detail=%s", json.dumps("interrupted while a call was in flight or retried"))
            return EXIT_CODES["interrupted"]
        except Unauthenticated as exc:
            return _refused(exc)
        except TrainingDiverged as exc:
            log.error("event=diverged detail=%s", json.dumps(str(exc)))
            return EXIT_CODES["diverged"]
        except (MemoryError, RuntimeError) as exc:
            if not out_of_memory(exc):
                raise
            return self._out_of_memory(exc)
        except grpc.RpcError as exc:
            if exc.code() in RETRYABLE:  # type: ignore[attr-defined]  # retried until --give-up-after ran out
                log.error("event=unreachable detail=%s", json.dumps(exc.details()))  # type: ignore[attr-defined]
                return EXIT_CODES["unreachable"]
            raise
        finally:
            stop.set()
            if beat is not None:  # gRPC aborts the process if a thread is mid-call at exit
                beat.join(timeout=15)

    def _out_of_memory(self, exc: BaseException) -> int:
        """Say in one line what to do; the exit code that stops a service manager from restarting into the same
        failure (each restart fetched the model again, every 30 s)."""
        tier = self.credentials.tier if self.credentials is not None else None
        hint = (
            f"this device cannot train its tier{'' if tier is None else f' ({tier:g})'} in the memory it has, and a "
            f"restart would run out again: the tier is fixed at enrollment in {self.state_dir / CREDENTIALS_FILE}. "
            f"Declare a smaller memory_bytes in the capability profile (--profile) and delete {self.state_dir} to "
            "enroll anew as a new client, or give the agent more memory"
        )
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.error("event=out_of_memory detail=%s hint=%s", json.dumps(detail), json.dumps(hint))
        return EXIT_CODES["out_of_memory"]

    def _heartbeats(self, stop: threading.Event, interval: float) -> None:
        while not stop.wait(max(1.0, interval)):
            try:
                self.client.heartbeat(retry=False)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    # revoked: no later call can succeed, so the run ends now, not at the next long poll's end
                    self._refused = Unauthenticated(f"Heartbeat: {exc.details()}")  # type: ignore[attr-defined]
                    stop.set()
                    return
                log.debug("event=heartbeat_failed error=%s", code.name if code else type(exc).__name__)
            except Exception as exc:  # the main loop reports what matters; a missed beat is not fatal
                log.debug("event=heartbeat_failed error=%s", type(exc).__name__)


def _refused(exc: Unauthenticated) -> int:
    """Log why the aggregator refused this client; the exit code that says so."""
    hint = (
        "check --enrollment-secret: the federation's operator gives it"
        if "enrollment secret" in str(exc)
        else "the operator revoked this client or the server forgot it; delete the state dir to enroll anew"
    )
    log.error("event=unauthenticated detail=%s hint=%s", json.dumps(str(exc)), json.dumps(hint))
    return EXIT_CODES["unauthenticated"]


LOCK_FILE = ".agent.lock"


@contextlib.contextmanager
def _only_agent(state_dir: Path) -> Iterator[None]:
    """Hold ``state_dir`` for this agent alone while it runs: a second agent on it would push the same client's
    updates and cancel the first one's push stream (GetUploadProgress), and both would overwrite one state file.
    An OS lock (``flock``), so a killed agent leaves none behind."""
    import fcntl

    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / LOCK_FILE, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise ValueError(
                f"{state_dir}: another agent runs on this state directory (pid {holder}); one agent per device"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(v) for v in shape)
