"""The durable round lifecycle behind the gRPC service: plain Python, no transport.

:class:`Coordinator` owns the store's session factory and an in-memory
:class:`aggregator_service.rounds.Federation` rebuilt from the database at start (and after a
failed close), so a restarted aggregator continues the open round where it stood. Every
state change happens under one lock and becomes visible to clients only after its
transaction committed; SQLite transactions are ``BEGIN IMMEDIATE``, so no session stays open
while bytes stream.

The servicer calls: :meth:`register`, :meth:`authenticate`, :meth:`heartbeat`,
:meth:`get_task`, :meth:`fetch`, :meth:`record_download`, :meth:`push`,
:meth:`report_evaluation`; a background thread calls :meth:`tick` for deadlines. Rounds are
computed exactly as the in-process simulator computes them: the same plan, updates folded in
client-id order, each client's task seeded with ``derive_seed(seed, round, client_id)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import torch
from sqlalchemy import func, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from torch import Tensor

from aggregator_service import store
from aggregator_service.config import AggregatorSettings
from aggregator_service.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unauthenticated
from aggregator_service.group_commit import GroupCommit
from aggregator_service.metrics import fedavg_equivalent_bytes, total_dispersion
from aggregator_service.rounds import Federation, RoundOutcome, RoundPlan
from aggregator_service.token_lookup import TokenLookup
from aggregator_service.updates import ClientUpdate
from aggregator_service.validation import check_header, check_tensors
from fedcore.keys import client_key, client_number, derive_seed
from fedcore.tiers import CapabilityProfile, NoTierFitsError, assign_tier
from fedcore.training import TrainConfig

__all__ = ["ClientInfo", "Coordinator", "Done", "PushResult", "Registration", "Train", "Wait"]

log = logging.getLogger("fedatoms.aggregator")

# Keys of the federation config an operator may change between restarts (everything else defines the run).
_MUTABLE_CONFIG_KEYS = frozenset({"rounds"})
_STATE_TENSOR_KEY = "controls"  # the strategy-state entry holding tensors (SCAFFOLD's server control)


def kv(event: str, **fields: Any) -> str:
    """A structured log line: ``event key=value …``."""

    def fmt(value: Any) -> str:
        text = str(value)
        return json.dumps(text) if (" " in text or not text) else text

    return " ".join([f"event={event}", *(f"{k}={fmt(v)}" for k, v in fields.items())])


@dataclass(frozen=True)
class ClientInfo:
    id: str
    tier: float
    name: str
    key: str  # the round engine's name for the client (:func:`fedcore.keys.client_key`)


class Registration(NamedTuple):
    client_id: str
    token: str
    tier: float
    spec_json: str


@dataclass(frozen=True)
class Wait:
    retry_after: float
    reason: str


@dataclass(frozen=True)
class Train:
    round: int
    due: tuple[str, ...]
    train_config: TrainConfig
    strategy_config: dict[str, Any]
    continue_unsynced: bool
    seed: int
    deadline: datetime
    personal_atoms: bool
    local: tuple[str, ...] = ()  # tier tensors that never leave the client


@dataclass(frozen=True)
class Done:
    reason: str
    final_round: int


class _LatePush(FailedPrecondition):
    """A push for a round that is not open (see :meth:`Coordinator._refuse_late`)."""


class PushResult(NamedTuple):
    accepted: bool
    duplicate: bool
    round: int
    message: str


@dataclass
class _OpenRound:
    plan: RoundPlan  # cohort as engine keys
    deadline: datetime
    extended: bool
    ids: dict[str, str]  # engine key → client id, for the cohort
    reported: set[str] = field(default_factory=set)  # engine keys


_TransferKey = tuple[int, str, str]  # (round, client id, direction)


class Coordinator:
    """Rounds of one federation, durable in the store; thread-safe."""

    def __init__(
        self,
        settings: AggregatorSettings,
        factory: sessionmaker[Session],
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        enrollment_iterations: int = store.ENROLLMENT_PBKDF2_ITERATIONS,
    ) -> None:
        self.settings = settings
        self.config = settings.federation
        self.clock = clock
        self._factory = factory
        self._reader = _reader_for(factory)
        self._lookup_token = TokenLookup(factory.kw["bind"])
        self._writes = GroupCommit(factory)  # pushes and evaluation reports: one commit per batch
        self._iterations = enrollment_iterations
        self._lock = threading.RLock()
        self._accepted_secrets: set[str] = set()
        self._touched: dict[str, datetime] = {}
        self._touch_every = timedelta(seconds=min(5.0, settings.heartbeat_timeout_seconds / 4))
        self._eval_data: Any = None
        # bytes moved since the last write: (round, client id, direction) → (bytes, bytes per full-rank tensor)
        self._transfers: dict[_TransferKey, tuple[int, dict[str, int]]] = {}
        self._transfers_lock = threading.Lock()
        # pushes between their write and their count, (round, client id, update id) → (client, bytes, per
        # tensor): a close that folds one of them counts it (see :meth:`_count_folded_uploads`)
        self._uploading: dict[tuple[int, str, str], tuple[ClientInfo, int, Mapping[str, int]]] = {}
        self._closed_rounds: set[int] = set()  # rounds known closed: a closed round never reopens
        # the open round's updates as validated, (client id, update id) → arrays, so its close need not
        # read back and decode every blob (a fifth of the close, which every client waits on), within
        # a memory budget; the store still decides which updates count
        self._decoded: dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any] | None]] = {}
        self._decoded_round: int | None = None
        self._decoded_bytes = 0
        self._touch_guard = threading.Lock()
        self._pending_touches: dict[str, datetime] = {}  # client id → last seen, not yet written
        self._pending_since: datetime | None = None
        if settings.eval_dataset:
            from fedcore.data import load_dataset

            self._eval_data = load_dataset(settings.eval_dataset, settings.eval_data_dir)[1]
        self._load()

    @classmethod
    def from_settings(cls, settings: AggregatorSettings, **kwargs: Any) -> Coordinator:
        """Migrate the database to the newest schema, connect, and load (or create) the federation."""
        store.upgrade(settings.database_url)
        return cls(settings, store.session_factory(store.create_engine_for(settings.database_url)), **kwargs)

    # ------------------------------------------------------------------ loading

    DECODED_BUDGET_BYTES = 256 * 2**20

    def _forget_decoded(self) -> None:
        self._decoded, self._decoded_round, self._decoded_bytes = {}, None, 0

    def _load(self) -> None:
        """(Re)build the in-memory federation from the database; create it on first start."""
        self._forget_decoded()
        with self._lock, self._factory.begin() as s:
            row = store.get_federation(s, self.settings.federation_name)
            created = row is None
            if row is None:
                row = store.create_federation(
                    s,
                    self.settings.federation_name,
                    self._config_json(),
                    self.settings.enrollment_secret,
                    iterations=self._iterations,
                )
            else:
                self._check_config(row.config)
            total = store.count_clients(s, row, include_revoked=False)
            fed = self.config.build_federation(num_clients_total=max(1, total))
            if created:
                intervals = fed.policy.intervals()
                store.save_global_tensors(s, row, {n: (t, 0, intervals[n]) for n, t in fed.global_tensors.items()})
                json_state, tensors = self._split_strategy_state(fed.strategy.state_dict())
                store.save_strategy_tensors(s, row, tensors)
                store.save_engine_state(s, row, json_state, fed.policy.state_dict(), 0)
            else:
                self._restore(s, row, fed)
            self._fed_row, self.federation = row, fed
            self._state = row.state
            self._open = self._load_open_round(s, row, fed)
        log.info(
            kv(
                "federation_loaded",
                name=self.settings.federation_name,
                created=created,
                round=self.federation.round,
                open_round=self._open.plan.round if self._open else None,
                state=self._state,
            )
        )

    def _config_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.config.to_dict()))

    def _check_config(self, stored: Mapping[str, Any]) -> None:
        current = self._config_json()
        differ = sorted(
            k for k in set(stored) | set(current) if k not in _MUTABLE_CONFIG_KEYS and stored.get(k) != current.get(k)
        )
        if differ:
            detail = ", ".join(f"{k}: stored {stored.get(k)!r}, configured {current.get(k)!r}" for k in differ[:6])
            raise ValueError(
                f"federation {self.settings.federation_name!r} in {self.settings.database_url} was created with a "
                f"different method ({detail}). Use the original [federation] settings, or a new federation_name "
                "to start another federation in the same database"
            )

    @staticmethod
    def _split_strategy_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
        tensors = dict(state.get(_STATE_TENSOR_KEY, {}))
        return {k: v for k, v in state.items() if k != _STATE_TENSOR_KEY}, tensors

    def _restore(self, s: Session, row: store.Federation, fed: Federation) -> None:
        loaded = store.load_global_tensors(s, row)
        missing = set(fed.spec.names) - set(loaded)
        if missing:
            raise ValueError(
                f"the database lacks global tensors {sorted(missing)[:5]}; was it written by another model?"
            )
        for name in fed.spec.names:
            array, version, _interval = loaded[name]
            fed.global_tensors[name] = torch.from_numpy(array)
            fed.versions[name] = version
        if row.policy_state:
            fed.policy.load_state_dict(row.policy_state)
        strategy_state = dict(row.strategy_state or {})
        controls = store.load_strategy_tensors(s, row)
        if controls:
            strategy_state[_STATE_TENSOR_KEY] = {n: torch.from_numpy(a) for n, a in controls.items()}
        if strategy_state:
            fed.strategy.load_state_dict(strategy_state)
        last_closed = s.scalar(
            select(func.max(store.Round.number)).where(
                store.Round.federation_id == row.id, store.Round.state == "closed"
            )
        )
        fed.round = int(last_closed or 0)
        latest = s.scalar(
            select(store.Round).where(store.Round.federation_id == row.id).order_by(store.Round.number.desc()).limit(1)
        )
        # a kept cohort continues after a restart; an abandoned round's cohort is resampled
        kept = latest is not None and latest.state != "abandoned"
        fed.cohort = tuple(sorted(_keys(s, latest.cohort).values())) if kept and latest is not None else ()

    def _load_open_round(self, s: Session, row: store.Federation, fed: Federation) -> _OpenRound | None:
        rnd = store.get_open_round(s, row)
        if rnd is None:
            return None
        keys = _keys(s, rnd.cohort)
        plan = RoundPlan(rnd.number, tuple(sorted(keys.values())), tuple(rnd.due), bool(rnd.continue_unsynced))
        fed.cohort = plan.cohort
        reported = {keys[c] for c in store.reported_clients(s, row, rnd.number) if c in keys}
        return _OpenRound(plan, rnd.deadline, bool(rnd.extended), {k: i for i, k in keys.items()}, reported)

    # ------------------------------------------------------------------ clients

    def register(
        self, profile: CapabilityProfile, secret: str, name: str | None = None, cert_sha256: str | None = None
    ) -> Registration:
        """Enroll a device: check the enrollment secret, assign the largest tier that fits, store it.

        ``cert_sha256`` (mutual TLS): the client certificate the token will be honoured with.
        """
        self._check_secret(secret)
        try:
            tier = assign_tier(profile, self.config.spec, tuple(self.config.tiers))
        except NoTierFitsError as exc:
            raise FailedPrecondition(f"no tier of this federation fits the device: {exc}") from exc
        except ValueError as exc:
            raise InvalidArgument(f"{exc} (tiers offered: {', '.join(f'{t:g}' for t in self.config.tiers)})") from exc
        for attempt in range(5):  # another replica may take the same registration number: retry
            try:
                with self._lock, self._factory.begin() as s:
                    client, token = store.register_client(
                        s, self._fed_row, profile.to_dict(), tier, name, cert_sha256=cert_sha256
                    )
                break
            except IntegrityError:
                if attempt == 4:
                    raise
        log.info(kv("client_registered", client=client.id, name=client.name, tier=tier))
        return Registration(client.id, token, tier, self.federation.tier_spec(tier).to_json())

    def _check_secret(self, secret: str) -> None:
        digest = hashlib.sha256(secret.encode()).hexdigest()
        if digest in self._accepted_secrets:
            return
        if not store.check_enrollment_secret(self._fed_row, secret):
            log.warning(kv("register_refused", reason="wrong_enrollment_secret"))
            raise Unauthenticated(
                "wrong enrollment secret: ask the operator of this federation for its current enrollment secret"
            )
        self._accepted_secrets.add(digest)  # PBKDF2 costs ~0.15 s: verify each secret once per process

    def authenticate(self, token: str, cert_sha256: str | None = None) -> ClientInfo:
        """The client holding ``token``; refreshes its last-seen time (at most every few seconds).

        Every call reads the database (no cached tokens), so a revocation by any process (the
        dashboard, ``fedatoms aggregator revoke``) refuses the very next call. Under mutual TLS
        (``cert_sha256`` given), a token bound to a certificate is honoured only with that certificate:
        a stolen token alone does not make another enrolled device that client.
        """
        if not token:
            raise Unauthenticated("missing bearer token: send metadata 'authorization: Bearer <token from Register>'")
        now = self.clock()
        row = self._lookup_token(store.hash_token(token))
        if row is None or row.federation_id != self._fed_row.id:
            raise Unauthenticated("unknown token: register again to get a new client id and token")
        if row.revoked_at is not None:
            raise Unauthenticated(f"token revoked for client {row.id}: the operator removed this client")
        if cert_sha256 is not None and row.cert_sha256 is not None and row.cert_sha256 != cert_sha256:
            raise PermissionDenied(
                f"the token of client {row.id} is bound to the client certificate it registered with "
                f"(sha256 {row.cert_sha256[:16]}…); this connection presents another (sha256 {cert_sha256[:16]}…)"
            )
        due = self._touch(row.id, row.last_seen, now)
        if due:
            with self._factory.begin() as s:
                _write_touches(s, due)
        return ClientInfo(row.id, float(row.tier), row.name, client_key(row.number))

    # Last-seen refreshes are written behind, batched: each write is a commit (an fsync on SQLite,
    # ~5 ms), so 1,000 polling clients touched one by one serialize on the write lock.
    _TOUCH_BATCH = timedelta(seconds=1)

    def _touch(self, client_id: str, last_seen: datetime, now: datetime) -> dict[str, datetime] | None:
        """Refresh a client's last-seen time (at most every ``_touch_every``): the refreshes due now, or None.

        A refresh is only deferred while the stored time is well inside the heartbeat timeout
        (younger than half of it), so the database never shows an active client as offline;
        deferred refreshes are written together, by the first due refresh that finds the oldest
        one ``_TOUCH_BATCH`` old (or that must be written at once).
        """
        last = self._touched.get(client_id)
        if last is not None and now - last < self._touch_every:
            return None
        self._touched[client_id] = now
        fresh = now - last_seen < timedelta(seconds=self.settings.heartbeat_timeout_seconds / 2)
        with self._touch_guard:
            self._pending_touches[client_id] = now
            since = self._pending_since = self._pending_since or now
            if fresh and now - since < self._TOUCH_BATCH:
                return None
            return self._drain_touches()

    def _drain_touches(self) -> dict[str, datetime]:
        pending, self._pending_touches, self._pending_since = self._pending_touches, {}, None
        return pending

    def heartbeat(self, client: ClientInfo) -> tuple[float, int, int]:
        """``(server time, current round, last closed round)``; :meth:`authenticate` refreshed last-seen."""
        with self._lock:
            current = self._open.plan.round if self._open else self.federation.round
            closed = self.federation.round
        return self.clock().timestamp(), current, closed

    # ------------------------------------------------------------------ tasks

    def _quorum(self, cohort_size: int) -> int:
        return max(1, math.ceil(self.settings.quorum * cohort_size - 1e-9))

    def _retry(self) -> float:
        if self.settings.poll_interval_seconds is not None:
            return float(self.settings.poll_interval_seconds)
        return float(min(5.0, self.settings.heartbeat_timeout_seconds / 4))

    def get_task(self, client: ClientInfo) -> Wait | Train | Done:
        with self._lock:
            if self._state == "done" or self.federation.round >= self.config.rounds:
                return Done(f"federation finished after {self.federation.round} rounds", self.federation.round)
            if self._state == "paused":
                return Wait(self._retry(), "federation paused by the operator")
            if self._open is None:
                self._try_open()
            if self._open is None:
                return Wait(self._retry(), f"waiting for at least {self.config.min_clients} online clients")
            op = self._open
            r = op.plan.round
            if client.key not in op.plan.cohort:
                return Wait(self._retry(), f"not selected for round {r}")
            if client.key in op.reported:
                return Wait(self._retry(), f"round {r} update received; waiting for the round to close")
            fed = self.federation
            config = dict(fed.strategy.client_config())
            if self.config.fp16:  # push in fp16 too, as the in-process transport does
                config["fp16_transport"] = True
            local = fed.local_tier_tensors(client.tier)
            return Train(
                round=r,
                due=fed.tier_due(client.tier, op.plan.due),
                train_config=self.config.train_config(),
                strategy_config=config,
                continue_unsynced=op.plan.continue_unsynced,
                seed=derive_seed(self.config.seed, r, client.key),
                deadline=op.deadline,
                personal_atoms=self.config.personal_atoms,
                local=local,
            )

    def _try_open(self) -> None:
        now = self.clock()
        since = now - timedelta(seconds=self.settings.heartbeat_timeout_seconds)
        with self._factory.begin() as s:
            candidates = {client_key(c.number): c.id for c in store.online_clients(s, self._fed_row, since)}
            if len(candidates) < self.config.min_clients:
                return
            last = s.scalar(select(func.max(store.Round.number)).where(store.Round.federation_id == self._fed_row.id))
            number = int(last or 0) + 1
            kept = dict(zip(self.federation.cohort, _ids(s, self._fed_row, self.federation.cohort), strict=True))
            plan = self.federation.plan(number, list(candidates))
            ids = {k: candidates.get(k) or kept[k] for k in plan.cohort}
            deadline = now + timedelta(seconds=self.settings.deadline_seconds)
            try:
                cohort_ids = [ids[k] for k in plan.cohort]
                store.open_round(s, self._fed_row, plan.round, cohort_ids, plan.due, plan.continue_unsynced, deadline)
            except store.RoundStateError:
                s.rollback()
                self._load()  # another process opened or changed rounds: follow the database
                return
        self._open = _OpenRound(plan, deadline, False, ids)
        log.info(kv("round_opened", round=plan.round, cohort=len(plan.cohort), due=len(plan.due)))

    # ------------------------------------------------------------------ model transfer

    def fetch(
        self, client: ClientInfo, held: Mapping[str, int], include_server_control: bool = False
    ) -> tuple[list[tuple[str, Tensor, int]], list[tuple[str, Tensor, int]]]:
        """``(model tensors newer than held, server control)`` for the client's tier, in spec order."""
        with self._lock:
            fed = self.federation
            newer = fed.fetch(client.tier, held)
            order = fed.tier_spec(client.tier).names
            model = [(n, *newer[n]) for n in order if n in newer]
            control: list[tuple[str, Tensor, int]] = []
            if include_server_control and fed.strategy.client_config().get("scaffold"):
                sc = fed.strategy.server_control(fed.spec) or {}
                version = fed.round if fed.round > 0 else 0
                control = [(n, t, version) for n, t in sc.items()]
        return model, control

    def download_round(self, requested: int | None) -> int:
        """The round a fetch's bytes count toward: ``requested`` (validated), else the open round, else the last."""
        with self._lock:
            current = self._open.plan.round if self._open else self.federation.round
        if requested is None:
            return current
        if requested > current:  # rare: a round abandoned since the client's task still counts
            with self._reader.connect() as conn:
                last = conn.execute(
                    select(func.max(store.Round.number)).where(store.Round.federation_id == self._fed_row.id)
                ).scalar()
            current = max(current, int(last or 0))
        if not 1 <= requested <= current:
            raise InvalidArgument(
                f"FetchRequest.round {requested} is not a round of this federation yet (current round: {current})"
            )
        return requested

    def record_download(
        self, client: ClientInfo, nbytes: int, per_tensor: Mapping[str, int] | None = None, round_: int | None = None
    ) -> None:
        """Count bytes sent to ``client`` toward ``round_`` (see :meth:`download_round`), per full-rank tensor too."""
        self._count_transfer(
            client, "down", self.download_round(None) if round_ is None else round_, nbytes, per_tensor
        )

    def _count_transfer(
        self, client: ClientInfo, direction: str, round_: int, nbytes: int, per_tensor: Mapping[str, int] | None
    ) -> None:
        """Count moved bytes in memory; :meth:`_write_transfers` writes them with a round's close or the
        ticker's next second (:meth:`flush`), a few statements for all of them.

        A fetch or a push so costs no statements of its own for bandwidth. A SIGKILL loses at
        most about a second of byte counts, never an update (updates are committed before the ack).
        """
        if nbytes <= 0 or round_ < 1:
            return
        per = self._owners(client.tier, per_tensor or {})
        key = (round_, client.id, direction)
        with self._transfers_lock:
            total, tensors = self._transfers.get(key, (0, {}))
            for name, b in per.items():
                tensors[name] = tensors.get(name, 0) + b
            self._transfers[key] = (total + nbytes, tensors)

    def _write_transfers(self, s: Session) -> dict[_TransferKey, tuple[int, dict[str, int]]]:
        """Write the counted transfers in ``s``; returns them, for :meth:`_unwrite_transfers` after a rollback."""
        with self._transfers_lock:
            drained, self._transfers = self._transfers, {}
        try:
            store.record_transfers(
                s, self._fed_row, ((r, cid, d, n, per) for (r, cid, d), (n, per) in sorted(drained.items()))
            )
        except BaseException:
            self._unwrite_transfers(drained)
            raise
        return drained

    def _count_folded_uploads(self, round_: int, folded: set[tuple[str, str]]) -> None:
        """Count the uploads this close folds whose pushes have not counted them yet.

        A push counts its bytes after its commit; a deadline can close the round in between. The
        close then counts them itself, so the round's ``bytes_up`` has every update it aggregated.
        """
        with self._transfers_lock:
            taken = [self._uploading.pop(k) for k in list(self._uploading) if k[0] == round_ and k[1:] in folded]
        for client, size, per_tensor in taken:
            self._count_transfer(client, "up", round_, size, per_tensor)

    def _unwrite_transfers(self, drained: Mapping[_TransferKey, tuple[int, dict[str, int]]]) -> None:
        with self._transfers_lock:
            for key, (nbytes, tensors) in drained.items():
                total, now = self._transfers.get(key, (0, {}))
                for name, b in tensors.items():
                    now[name] = now.get(name, 0) + b
                self._transfers[key] = (total + nbytes, now)

    def flush(self) -> None:
        """Write counted transfers and deferred last-seen times now (the ticker: every second; shutdown)."""
        with self._touch_guard:
            touches = self._drain_touches()
        with self._transfers_lock:
            if not self._transfers and not touches:
                return
        drained: Mapping[_TransferKey, tuple[int, dict[str, int]]] = {}
        try:
            with self._factory.begin() as s:
                drained = self._write_transfers(s)
                _write_touches(s, touches)
        except Exception:
            self._unwrite_transfers(drained)
            raise

    def _owners(self, tier: float, per_tensor: Mapping[str, int]) -> dict[str, int]:
        """Tier tensors' bytes counted toward the full-rank tensor each belongs to (a factor pair: what it rebuilds)."""
        owner = self.federation.tier_spec(tier).owners
        out: dict[str, int] = {}
        for name, nbytes in per_tensor.items():
            full = owner.get(name, name)
            out[full] = out.get(full, 0) + nbytes
        return out

    def push(
        self,
        client: ClientInfo,
        round_: int,
        update_id: str,
        num_samples: int,
        metrics: Mapping[str, float],
        tensors: Mapping[str, Any],
        control_delta: Mapping[str, Any] | None = None,
        nbytes: int | None = None,
        tensor_bytes: Mapping[str, int] | None = None,
    ) -> PushResult:
        """Validate and store one update; acknowledged only after the commit. Closes the round when complete."""
        clean_metrics = check_header(update_id, num_samples, metrics)
        try:
            with self._lock:
                op = self._open
                if op is None or op.plan.round != round_:
                    current = f"round {op.plan.round} is open" if op else "no round is open"
                    raise _LatePush(
                        f"round {round_} is not open ({current}, last closed: {self.federation.round}); "
                        "the update came too late or is for another round: poll GetTask for the current task"
                    )
                if client.key not in op.plan.cohort:
                    raise FailedPrecondition(f"client {client.id} is not in round {round_}'s cohort: poll GetTask")
                spec = self.federation.tier_spec(client.tier)
                due = self.federation.tier_due(client.tier, op.plan.due)
                scaffold = bool(self.federation.strategy.client_config().get("scaffold"))
                model, deltas = check_tensors(spec, round_, due, tensors, control_delta, scaffold=scaffold)
                size = (
                    nbytes if nbytes is not None else sum(a.nbytes for a in [*model.values(), *(deltas or {}).values()])
                )
                if tensor_bytes is None:
                    tensor_bytes = {}
                    for n, a in [*model.items(), *(deltas or {}).items()]:
                        tensor_bytes[n] = tensor_bytes.get(n, 0) + a.nbytes
        except _LatePush as late:  # answered outside the lock: it writes
            return self._refuse_late(client, round_, update_id, late)

        def write(s: Session) -> bool:
            return store.store_update(
                s, self._fed_row, round_, client.id, update_id, int(num_samples), clean_metrics, model, deltas
            )[1]

        # written outside the lock, so fetches and polls never wait on an fsync; the store re-checks
        # (in the transaction) that the round is still open, so a close in between refuses the update
        upload = (round_, client.id, update_id)
        with self._transfers_lock:
            self._uploading[upload] = (client, size, tensor_bytes)
        try:
            duplicate = self._writes.run(write)
        except store.UpdateConflict as exc:
            raise FailedPrecondition(f"{exc}; a retry must reuse the original update_id") from exc
        except store.RoundStateError as exc:  # the round closed after the checks above: late after all
            return self._refuse_late(client, round_, update_id, FailedPrecondition(f"{exc}: poll GetTask"))
        except (store.NotInCohort, store.NotFound) as exc:
            raise FailedPrecondition(f"{exc}: poll GetTask for the current task") from exc
        finally:
            with self._transfers_lock:
                uncounted = self._uploading.pop(upload, None) is not None  # else a close counted it
        if not duplicate and uncounted:
            self._count_transfer(client, "up", round_, size, tensor_bytes)
        log.info(
            kv("update_stored", round=round_, client=client.id, duplicate=duplicate, tensors=len(model), bytes=size)
        )
        with self._lock:
            now_open = self._open  # the same round, or a reload of it, unless it closed (with this update:
            if now_open is not None and now_open.plan.round == round_:  # it committed first) or was abandoned
                now_open.reported.add(client.key)
                if not duplicate:
                    self._keep_decoded(round_, client.id, update_id, model, deltas)
                if now_open.reported.issuperset(now_open.plan.cohort):
                    self._close_logged("cohort_complete")
        note = "duplicate of an update already stored" if duplicate else f"stored {len(model)} tensors, {size} bytes"
        return PushResult(True, duplicate, round_, note)

    def _refuse_late(self, client: ClientInfo, round_: int, update_id: str, refusal: FailedPrecondition) -> PushResult:
        """A push for a round that is not open: a retry of an update that round consumed is a duplicate (its
        acknowledgement was lost, then its push closed the round); anything else is refused, and a straggler's
        push is counted in its round's ``late_pushes``."""

        def write(s: Session) -> bool:
            return store.refuse_late_push(s, self._fed_row, round_, client.id, update_id) is not None

        if self._writes.run(write):
            log.info(kv("update_stored", round=round_, client=client.id, duplicate=True, consumed=True))
            return PushResult(True, True, round_, f"duplicate of an update consumed by round {round_}")
        log.warning(kv("late_push_refused", round=round_, client=client.id, update_id=update_id))
        raise refusal

    def _keep_decoded(
        self, round_: int, client_id: str, update_id: str, model: dict[str, Any], deltas: dict[str, Any] | None
    ) -> None:
        if self._decoded_round != round_:
            self._forget_decoded()
            self._decoded_round = round_
        size = sum(a.nbytes for a in model.values()) + sum(a.nbytes for a in (deltas or {}).values())
        if self._decoded_bytes + size <= self.DECODED_BUDGET_BYTES:
            self._decoded[(client_id, update_id)] = (model, deltas)
            self._decoded_bytes += size

    # ------------------------------------------------------------------ closing

    def _close_logged(self, reason: str) -> None:
        try:
            self._close(reason)
        except Exception:
            log.exception(kv("round_close_failed", round=self._open.plan.round if self._open else None))

    def _close(self, reason: str) -> RoundOutcome:
        """Aggregate the open round from the stored updates and write the result, in one transaction."""
        op = self._open
        assert op is not None
        fed, plan = self.federation, op.plan
        drained: Mapping[_TransferKey, tuple[int, dict[str, int]]] = {}
        try:
            with self._factory.begin() as s:
                store.lock_round(s, self._fed_row, plan.round)
                members = {
                    cid: (client_key(number), float(tier))
                    for cid, number, tier in s.execute(
                        select(store.Client.id, store.Client.number, store.Client.tier).where(
                            store.Client.id.in_(list(op.ids.values()))
                        )
                    ).all()
                }
                if hasattr(fed.strategy, "num_clients_total"):  # SCAFFOLD's N: clients enrolled now
                    fed.strategy.num_clients_total = max(
                        1, store.count_clients(s, self._fed_row, include_revoked=False)
                    )
                fed.begin(plan)
                decoded = self._decoded if self._decoded_round == plan.round else None
                folded: set[tuple[str, str]] = set()
                for header, tensors, deltas in store.iter_round_updates(s, self._fed_row, plan.round, decoded):
                    folded.add((header.client_id, header.update_id))
                    key, tier = members[header.client_id]
                    fed.fold(
                        ClientUpdate(
                            client_id=key,
                            num_samples=header.num_samples,
                            tier=tier,
                            spec=fed.tier_spec(tier),
                            tensors={n: torch.from_numpy(a) for n, a in tensors.items()},
                            control_delta=None
                            if deltas is None
                            else {n: torch.from_numpy(a) for n, a in deltas.items()},
                            metrics=dict(header.metrics or {}),
                        )
                    )
                outcome = fed.close()
                self._count_folded_uploads(plan.round, folded)
                drained = self._write_transfers(s)  # the round's metrics sum its transfers
                json_state, strategy_tensors = self._split_strategy_state(fed.strategy.state_dict())
                done = outcome.round >= self.config.rounds
                store.close_round(
                    s,
                    self._fed_row,
                    plan.round,
                    new_tensors={
                        n: (t, fed.versions[n], outcome.intervals[n]) for n, t in outcome.result.tensors.items()
                    },
                    intervals=outcome.intervals,
                    round_metrics=self._round_metrics(outcome),
                    tensor_metrics=self._tensor_metrics(outcome),
                    transfers=[],
                    strategy_state=json_state,
                    policy_state=fed.policy.state_dict(),
                    strategy_tensors=strategy_tensors,
                    next_round=None if done else plan.round + 1,
                )
        except Exception:
            self._unwrite_transfers(drained)
            self._load()  # the transaction rolled back: the in-memory engine must forget the fold
            raise
        self._open = None
        self._forget_decoded()
        if done:
            self._state = "done"
        log.info(
            kv("round_closed", round=plan.round, reason=reason, reported=outcome.reported, cohort=len(plan.cohort))
        )
        return outcome

    def _round_metrics(self, outcome: RoundOutcome) -> dict[str, Any]:
        fed = self.federation
        weights = {n: v for n, v in outcome.result.dispersion.items() if fed.spec.tensor(n).role != "buffer"}
        metrics: dict[str, Any] = {
            "dispersion": _finite_or_none(total_dispersion(weights)),
            "latent_clients": outcome.latent_clients,
            "fedavg_equivalent_bytes": fedavg_equivalent_bytes(fed.spec, len(outcome.cohort)),
            "extra": {
                "effective_dispersion": _finite_dict(outcome.result.effective_dispersion),
                "client_metrics": _finite_dict(outcome.result.metrics),
                "reported": outcome.reported,
                "cohort": len(outcome.cohort),
            },
        }
        if self._eval_data is not None:
            from fedcore.training import evaluate

            model = fed.spec.build()
            model.load_state_dict(fed.global_tensors)
            result = evaluate(model, self._eval_data, device="cpu")
            metrics["test_accuracy"], metrics["test_loss"] = result.accuracy, _finite_or_none(result.loss)
        return metrics

    def _tensor_metrics(self, outcome: RoundOutcome) -> list[dict[str, Any]]:
        rows = []
        for t in self.federation.spec.tensors:
            row: dict[str, Any] = {
                "name": t.name,
                "role": t.role,
                "interval": outcome.intervals[t.name],
                "version": self.federation.versions[t.name],
            }
            for key, source in (("d_l", outcome.discrepancy), ("dispersion", outcome.result.dispersion)):
                value = source.get(t.name)
                if value is not None and math.isfinite(value):
                    row[key] = value
            rows.append(row)
        return rows

    def tick(self, now: datetime | None = None) -> None:
        """Deadlines: close with the quorum, else extend once, else abandon (the next GetTask resamples)."""
        now = now or self.clock()
        self.flush()
        with self._lock:
            self._refresh_state()
            op = self._open
            if op is not None and self._state == "running" and op.reported.issuperset(op.plan.cohort):
                self._close_logged("cohort_complete")  # an earlier close attempt failed: try again
                return
            if op is None or self._state != "running" or now < op.deadline:
                return
            r, needed = op.plan.round, self._quorum(len(op.plan.cohort))
            if len(op.reported) >= needed:
                self._close_logged("deadline_quorum")
                return
            deadline = now + timedelta(seconds=self.settings.deadline_seconds)
            with self._factory.begin() as s:
                # A push commits before it re-takes the lock to count itself (group commit): read who
                # reported from the store, in the transaction that would extend or abandon the round,
                # so an acknowledged update is never abandoned with a quorum that was in fact met.
                store.lock_round(s, self._fed_row, r)
                keys = {cid: key for key, cid in op.ids.items()}
                op.reported.update(keys[c] for c in store.reported_clients(s, self._fed_row, r) if c in keys)
                met = len(op.reported) >= needed
                if not met and not op.extended:
                    store.extend_round(s, self._fed_row, r, deadline)
                elif not met:
                    store.abandon_round(s, self._fed_row, r, now=now)
            if met:
                self._close_logged("deadline_quorum")
            elif not op.extended:
                op.deadline, op.extended = deadline, True
                log.warning(kv("round_extended", round=r, reported=len(op.reported), needed=needed))
            else:
                self._open = None
                self._forget_decoded()
                self.federation.cohort = ()
                log.warning(kv("round_abandoned", round=r, reported=len(op.reported), needed=needed))

    def _refresh_state(self) -> None:
        with self._factory.begin() as s:
            state = s.scalar(select(store.Federation.state).where(store.Federation.id == self._fed_row.id))
        if state is not None:
            self._state = state

    def set_paused(self, paused: bool) -> None:
        """Pause (GetTask answers Wait, deadlines stop) or resume the federation."""
        with self._lock, self._factory.begin() as s:
            if self._state == "done":
                raise FailedPrecondition("the federation is done; it cannot be paused or resumed")
            store.set_federation_state(s, self._fed_row, "paused" if paused else "running")
            self._state = "paused" if paused else "running"

    @property
    def state(self) -> str:
        return self._state

    @property
    def open_round(self) -> RoundPlan | None:
        with self._lock:
            return self._open.plan if self._open else None

    # ------------------------------------------------------------------ evaluations

    def report_evaluation(
        self,
        client: ClientInfo,
        round_: int,
        global_accuracy: float,
        global_loss: float,
        personalized_accuracy: float | None,
        num_samples: int,
    ) -> bool:
        """Store a client's evaluation of round ``round_``; ``False`` when it already reported (the first stands)."""
        for what, value in (("global_accuracy", global_accuracy), ("personalized_accuracy", personalized_accuracy)):
            if value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise InvalidArgument(f"{what} must be a fraction in [0, 1], got {value}")
        if not (math.isfinite(global_loss) and global_loss >= 0.0):
            raise InvalidArgument(f"global_loss must be a finite number ≥ 0, got {global_loss}")
        if num_samples < 1:
            raise InvalidArgument(f"num_samples must be ≥ 1, got {num_samples}")
        if round_ not in self._closed_rounds:
            with self._reader.connect() as conn:
                state = conn.execute(
                    select(store.Round.state).where(
                        store.Round.federation_id == self._fed_row.id, store.Round.number == round_
                    )
                ).scalar()
            if state != "closed":
                raise FailedPrecondition(f"round {round_} has not closed: evaluate a model version you fetched")
            self._closed_rounds.add(round_)
        return self._writes.run(
            lambda s: store.record_evaluation(
                s,
                self._fed_row,
                round_,
                client.id,
                global_accuracy=global_accuracy,
                global_loss=global_loss,
                personalized_accuracy=personalized_accuracy,
                num_samples=num_samples,
            )
        )


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _finite_dict(values: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if math.isfinite(v)}


def _write_touches(s: Session, touches: Mapping[str, datetime]) -> None:
    if touches:
        s.execute(update(store.Client), [{"id": cid, "last_seen": t} for cid, t in touches.items()])


def _reader_for(factory: sessionmaker[Session]) -> Engine:
    """An engine for reads that take no lock: on a SQLite file, one that begins DEFERRED (WAL readers
    never wait for the writer); elsewhere the writer's own engine."""
    bind = factory.kw["bind"]
    if bind.dialect.name != "sqlite" or bind.url.database in (None, "", ":memory:"):
        return bind
    return store.create_engine_for(bind.url, sqlite_begin="DEFERRED")


def _keys(s: Session, ids: Any) -> dict[str, str]:
    """Client id → engine key, for the given ids."""
    rows = s.execute(select(store.Client.id, store.Client.number).where(store.Client.id.in_(list(ids)))).all()
    return {cid: client_key(number) for cid, number in rows}


def _ids(s: Session, fed: store.Federation, keys: Any) -> list[str]:
    """Engine key → client id, in the order given."""
    numbers = [client_number(k) for k in keys]
    found = dict(
        s.execute(
            select(store.Client.number, store.Client.id).where(
                store.Client.federation_id == fed.id, store.Client.number.in_(numbers)
            )
        ).all()
    )
    return [found[n] for n in numbers]
