"""The byte ledger: bytes each transfer moved, counted in memory and written a few statements at a time.

Every byte the service moves is counted here, under its category (``train_fetch``,
``eval_fetch``, ``push``: :data:`aggregator_service.metrics.CATEGORIES`), with the transfer's
FedAvg-equivalent (:func:`aggregator_service.metrics.fedavg_equivalent_bytes`, the rule the
in-process simulator applies too; a fetch cut midway counts its share,
:func:`aggregator_service.metrics.fedavg_equivalent_of_part`); the ``transfers`` table it writes, and its per-round sums
``round_bytes`` written with it, are what every surface reads.

A fetch so costs no statements of its own for bandwidth: its count is written with a round's
close (its metrics sum its transfers) or by the ticker's next flush; a SIGKILL loses at most the
fetches counted since the last flush. A push's bytes are written in the transaction that stores
its update (:meth:`Ledger.write_push`), so no kill can separate an aggregated update from its
bytes, and a retried push (a duplicate) adds nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from aggregator_service import store
from aggregator_service.errors import InvalidArgument
from aggregator_service.metrics import category_of, fedavg_equivalent_bytes, fedavg_equivalent_of_part

from .answers import ClientInfo
from .shared import Shared

__all__ = ["Counts", "Ledger", "ModelFetch"]

TransferKey = tuple[int, str, str]  # (round, client id, category)


@dataclass(frozen=True)
class ModelFetch:
    """What of the model one fetch offered (name → (version, bytes)), sent (name → bytes) and found held (the
    versions the client declared), and the tensors it resumed (name → the bytes of it the client held: the
    offer is the rest)."""

    offered: Mapping[str, tuple[int, int]]
    sent: Mapping[str, int]
    held: Mapping[str, int]
    resumed: Mapping[str, int] = field(default_factory=dict)


#: → (bytes, FedAvg-equivalent, bytes per full-rank tensor)
Counts = Mapping[TransferKey, tuple[int, int, dict[str, int]]]


class Ledger:
    """Transfer counts not written yet; its one lock guards them and the uploads between write and count."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self._lock = threading.Lock()
        # moved since the last write: (round, client id, category) → (bytes, FedAvg-equivalent, per full-rank tensor)
        self._counts: dict[TransferKey, tuple[int, int, dict[str, int]]] = {}
        # (client id, category) → (round, model tensors its fetches handed over whole: name → (version, bytes))
        self._cuts: dict[tuple[str, str], tuple[int, dict[str, tuple[int, int]]]] = {}
        self._cuts_newest = 0  # the newest round an entry of ``_cuts`` was written for

    def download_round(self, requested: int | None) -> int:
        """The round a fetch's bytes count toward: ``requested`` (validated), else the open round, else the last."""
        shared = self.shared
        with shared.lock:
            current = shared.current_round()
        if requested is None:
            return current
        if requested > current:  # rare: a round abandoned since the client's task still counts
            with shared.reader.connect() as conn:
                last = conn.execute(
                    select(func.max(store.Round.number)).where(store.Round.federation_id == shared.fed_row.id)
                ).scalar()
            current = max(current, int(last or 0))
        if not 1 <= requested <= current:
            raise InvalidArgument(
                f"FetchRequest.round {requested} is not a round of this federation yet (current round: {current})"
            )
        return requested

    def record_download(
        self,
        client: ClientInfo,
        nbytes: int,
        per_tensor: Mapping[str, int] | None = None,
        round_: int | None = None,
        category: str = "train_fetch",
        *,
        model: ModelFetch | None = None,
    ) -> None:
        """Count one fetch's bytes sent to ``client`` toward ``round_`` (see :meth:`download_round`), per
        full-rank tensor too, under ``category`` (``train_fetch`` or ``eval_fetch``), with its FedAvg-equivalent.

        ``model`` says what of the model the fetch offered and sent (unset: all it offered went out). A fetch cut
        midway counts the share of a FedAvg transfer it sent (:func:`.metrics.fedavg_equivalent_of_part`), and
        the tensors every fetch delivered whole are remembered for the round: the client's retry holds those that
        arrived, so the retry counts its share of the model those tensors and it make up: a cut and its resume
        count what moved, at FedAvg's rate, also where the server handed the whole model over before the cut.
        A fetch that moved only SCAFFOLD's control is none."""
        round_ = self.download_round(None) if round_ is None else round_
        if model is None:
            equivalent = fedavg_equivalent_of_part(self.shared.federation.spec, nbytes, nbytes)
        else:
            equivalent = self._fetch_equivalent(client.id, category, round_, model)
        self.count(client, category, round_, nbytes, per_tensor, equivalent)

    def _fetch_equivalent(self, client_id: str, category: str, round_: int, model: ModelFetch) -> int:
        key = (client_id, category)
        sent = sum(model.sent.values())
        whole = sum(n for _, n in model.offered.values())
        delivered = {
            n: (v, b + model.resumed.get(n, 0))
            for n, (v, b) in model.offered.items()
            if b > 0 and model.sent.get(n, 0) >= b
        }
        with self._lock:
            cut_round, earlier = self._cuts.get(key, (round_, {}))
            earlier = earlier if cut_round == round_ else {}
            kept = sum(b for n, (v, b) in earlier.items() if model.held.get(n) == v and n not in model.offered)
            # every fetch's deliveries, not only a cut's: a fetch the server handed over whole may still have been
            # cut on the way (socket and proxy buffers hold it), and its retry holds only what arrived
            if round_ > self._cuts_newest:  # entries of rounds before the previous one are read no more
                self._cuts = {k: entry for k, entry in self._cuts.items() if entry[0] >= round_ - 1}
                self._cuts_newest = round_
            self._cuts[key] = (round_, {**earlier, **delivered})
        held_part = sum(model.resumed.values())  # a resumed tensor's bytes the client held: part of the model too
        return fedavg_equivalent_of_part(self.shared.federation.spec, sent, whole + kept + held_part)

    def count(
        self,
        client: ClientInfo,
        category: str,
        round_: int,
        nbytes: int,
        per_tensor: Mapping[str, int] | None,
        equivalent: int,
    ) -> None:
        """Count one transfer in memory (``category``, or ``"down"``/``"up"``) and its FedAvg-equivalent bytes,
        toward the full-rank tensors its bytes belong to; a transfer that moved nothing is no transfer."""
        if nbytes <= 0 or round_ < 1:
            return
        per = self._owners(client.tier, per_tensor or {})
        key = (round_, client.id, category_of(category))
        with self._lock:
            total, fedavg, tensors = self._counts.get(key, (0, 0, {}))
            for name, b in per.items():
                tensors[name] = tensors.get(name, 0) + b
            self._counts[key] = (total + nbytes, fedavg + equivalent, tensors)

    def write_push(
        self, s: Session, client: ClientInfo, round_: int, nbytes: int, per_tensor: Mapping[str, int]
    ) -> None:
        """Write one push's bytes in ``s``, the transaction that stores the update: the round's bytes and
        the updates it aggregates can never disagree, whatever is killed when."""
        if nbytes <= 0:
            return
        spec = self.shared.federation.spec
        per = self._owners(client.tier, per_tensor)
        store.record_transfers(
            s,
            self.shared.fed_row,
            [(round_, client.id, "push", nbytes, per, fedavg_equivalent_bytes(spec, 1))],
            pruned_through=self._pruned_through(s),
        )

    def write(self, s: Session) -> Counts:
        """Write the counted transfers in ``s``; returns them, for :meth:`unwrite` after a rollback."""
        with self._lock:
            drained, self._counts = self._counts, {}
        try:
            store.record_transfers(
                s,
                self.shared.fed_row,
                ((r, cid, c, n, per, fedavg) for (r, cid, c), (n, fedavg, per) in sorted(drained.items())),
                pruned_through=self._pruned_through(s),
            )
        except BaseException:
            self.unwrite(drained)
            raise
        return drained

    def unwrite(self, drained: Counts) -> None:
        """Count again what a rolled-back transaction had written."""
        with self._lock:
            for key, (nbytes, fedavg, tensors) in drained.items():
                total, counted, now = self._counts.get(key, (0, 0, {}))
                for name, b in tensors.items():
                    now[name] = now.get(name, 0) + b
                self._counts[key] = (total + nbytes, counted + fedavg, now)

    def flush(self, touches: Mapping[str, datetime]) -> None:
        """Write counted transfers and the deferred last-seen ``touches`` now, in one transaction."""
        with self._lock:
            if not self._counts and not touches:
                return
        drained: Counts = {}
        try:
            with self.shared.prune_gate.write(), self.shared.factory.begin() as s:
                drained = self.write(s)
                store.touch_clients(s, touches)
        except Exception:
            self.unwrite(drained)
            raise

    def _pruned_through(self, s: Session) -> int:
        """The retention watermark (:attr:`Shared.history_pruned_through`) for a write in ``s``. A close moves
        it only after its commit, so it is never ahead of the database, and while holding the prune gate,
        which every write holds shared for its transaction (:mod:`.prune_gate`): no write reads one watermark
        and commits after a prune that moved it. A close's own write (before its prune) reads the old one, and
        its prune deletes what it wrote."""
        s.connection()
        return self.shared.history_pruned_through

    def _owners(self, tier: float, per_tensor: Mapping[str, int]) -> dict[str, int]:
        """Tier tensors' bytes counted toward the full-rank tensor each belongs to (a factor pair: what it rebuilds)."""
        owner = self.shared.federation.tier_spec(tier).owners
        out: dict[str, int] = {}
        for name, nbytes in per_tensor.items():
            full = owner.get(name, name)
            out[full] = out.get(full, 0) + nbytes
        return out
