"""Registration and tokens: who may enroll, who a bearer token is, and when each client was last seen.

Last-seen refreshes are written behind, batched: each write is a commit, and a commit is an
fsync on SQLite, so a thousand polling clients refreshed one by one would queue on the write
lock. The ledger's flush writes what is pending (:meth:`Registry.drain_touches`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from datetime import datetime, timedelta

from sqlalchemy.exc import IntegrityError

from aggregator_service import store
from aggregator_service.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unauthenticated
from aggregator_service.logfmt import kv
from aggregator_service.token_lookup import TokenLookup
from fedcore.keys import client_key
from fedcore.tiers import CapabilityProfile, NoTierFitsError, assign_tier

from .answers import ClientInfo, Registration
from .shared import Shared

__all__ = ["Registry"]

log = logging.getLogger("fedatoms.aggregator")


class Registry:
    """Enrollment, authentication and last-seen batching; its one lock guards the pending refreshes."""

    # a deferred refresh waits at most this long for others to share its commit
    TOUCH_BATCH = timedelta(seconds=1)

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self._lookup_token = TokenLookup(shared.factory.kw["bind"])
        # (stored PBKDF2 hash, SHA-256 of the one secret it accepts): once known, a wrong secret is refused
        # by a constant-time compare of digests instead of a deliberately slow PBKDF2 run
        self._secret: tuple[str, bytes] | None = None
        self._secret_lock = threading.Lock()
        self._tried_configured: str | None = None  # the stored hash the configured secret was tried against
        self._refusals = 0  # wrong secrets not yet logged: a flood is logged as counts, not line by line
        self._refusals_logged = float("-inf")
        # client id → when its last-seen time was last refreshed; only the last ``touch_every`` matters,
        # so older entries are dropped as it passes (months of churning client ids would otherwise pile up)
        self._touched: dict[str, datetime] = {}
        self._touched_pruned: datetime | None = None
        self.touch_every = timedelta(seconds=min(5.0, shared.settings.heartbeat_timeout_seconds / 4))
        self._lock = threading.Lock()
        self._pending: dict[str, datetime] = {}  # client id → last seen, not yet written
        self._pending_since: datetime | None = None

    def register(
        self, profile: CapabilityProfile, secret: str, name: str | None = None, cert_sha256: str | None = None
    ) -> Registration:
        """Enroll a device: check the enrollment secret, assign the largest tier that fits, store it.

        ``cert_sha256`` (mutual TLS): the client certificate the token will be honoured with.
        """
        shared, config = self.shared, self.shared.config
        self._check_secret(secret)
        cap = shared.settings.max_client_samples
        if profile.num_samples > cap:
            raise InvalidArgument(
                f"num_samples {profile.num_samples} is more than this federation accepts from one client "
                f"(max_client_samples = {cap})"
            )
        try:
            tier = assign_tier(
                profile,
                config.spec,
                tuple(config.tiers),
                batch_size=config.batch_size,
                nested_rank_ratio=config.nested_rank_ratio,
            )
        except NoTierFitsError as exc:
            raise FailedPrecondition(f"no tier of this federation fits the device: {exc}") from exc
        except ValueError as exc:
            raise InvalidArgument(f"{exc} (tiers offered: {', '.join(f'{t:g}' for t in config.tiers)})") from exc
        for attempt in range(5):  # another replica may take the same registration number: retry
            try:
                with shared.lock, shared.factory.begin() as s:
                    client, token = store.register_client(
                        s, shared.fed_row, profile.to_dict(), tier, name, cert_sha256=cert_sha256
                    )
                break
            except IntegrityError:
                if attempt == 4:
                    raise
        with shared.lock:
            shared.settle()  # held polls waiting for enough clients look again
        log.info(kv("client_registered", client=client.id, name=client.name, tier=tier))
        return Registration(client.id, token, tier, shared.federation.tier_spec(tier).to_json())

    def _check_secret(self, secret: str) -> None:
        """Refuse a wrong secret before any database work; PBKDF2 runs only until the right secret is known."""
        digest = hashlib.sha256(secret.encode()).digest()
        stored = self.shared.fed_row.enrollment_secret_hash
        known = self._known_secret(stored)
        if known is not None:
            ok = bool(secret) and hmac.compare_digest(digest, known)
        else:  # the configured secret is not the stored one: verify slowly until a right one is seen
            ok = store.check_enrollment_secret(self.shared.fed_row, secret)
            if ok:
                self._secret = (stored, digest)
        if not ok:
            self._log_refusal()
            raise Unauthenticated(
                "wrong enrollment secret: ask the operator of this federation for its current enrollment secret"
            )

    def _known_secret(self, stored: str) -> bytes | None:
        """SHA-256 of the secret ``stored`` accepts, learnt from the configured secret (one PBKDF2 run per hash)."""
        known = self._secret
        if known is not None and known[0] == stored:
            return known[1]
        with self._secret_lock:
            if self._tried_configured != stored:
                self._tried_configured = stored
                configured = self.shared.settings.enrollment_secret
                if store.check_enrollment_secret(self.shared.fed_row, configured):
                    self._secret = (stored, hashlib.sha256(configured.encode()).digest())
                else:
                    log.warning(
                        kv(
                            "enrollment_secret_mismatch",
                            hint="the configured enrollment_secret is not the one this federation was created "
                            "with; the federation's own secret stays in force",
                        )
                    )
        known = self._secret
        return known[1] if known is not None and known[0] == stored else None

    def _log_refusal(self, every: float = 10.0) -> None:
        """Log wrong secrets at most once per ``every`` seconds, with how many there were."""
        with self._secret_lock:
            self._refusals += 1
            now = time.monotonic()
            if now - self._refusals_logged < every:
                return
            count, self._refusals, self._refusals_logged = self._refusals, 0, now
        log.warning(kv("register_refused", reason="wrong_enrollment_secret", count=count))

    def authenticate(self, token: str, cert_sha256: str | None = None) -> ClientInfo:
        """The client holding ``token``; refreshes its last-seen time (at most every few seconds).

        Every call reads the database (no cached tokens), so a revocation by any process (the
        dashboard, ``fedatoms aggregator revoke``) refuses the very next call. Under mutual TLS
        (``cert_sha256`` given), a token bound to a certificate is honoured only with that certificate:
        a stolen token alone does not make another enrolled device that client.
        """
        if not token:
            raise Unauthenticated("missing bearer token: send metadata 'authorization: Bearer <token from Register>'")
        now = self.shared.clock()
        row = self._lookup_token(store.hash_token(token))
        if row is None or row.federation_id != self.shared.fed_row.id:
            raise Unauthenticated("unknown token: register again to get a new client id and token")
        if row.revoked_at is not None:
            raise Unauthenticated(f"token revoked for client {row.id}: the operator removed this client")
        if cert_sha256 is not None and row.cert_sha256 is not None and row.cert_sha256 != cert_sha256:
            raise PermissionDenied(
                f"the token of client {row.id} is bound to the client certificate it registered with "
                f"(sha256 {row.cert_sha256[:16]}…); this connection presents another (sha256 {cert_sha256[:16]}…)"
            )
        if now - row.last_seen >= timedelta(seconds=self.shared.settings.heartbeat_timeout_seconds):
            with self.shared.lock:  # back online: held polls waiting for enough clients look again
                self.shared.settle()
        due = self._touch(row.id, row.last_seen, now)
        if due:
            with self.shared.factory.begin() as s:
                store.touch_clients(s, due)
        return ClientInfo(row.id, float(row.tier), row.name, client_key(row.number))

    def _touch(self, client_id: str, last_seen: datetime, now: datetime) -> dict[str, datetime] | None:
        """Refresh a client's last-seen time (at most every ``touch_every``): the refreshes due now, or None.

        A refresh is only deferred while the stored time is well inside the heartbeat timeout
        (younger than half of it), so the database never shows an active client as offline;
        deferred refreshes are written together, by the first due refresh that finds the oldest
        one ``TOUCH_BATCH`` old (or that must be written at once).
        """
        last = self._touched.get(client_id)
        if last is not None and now - last < self.touch_every:
            return None
        fresh = now - last_seen < timedelta(seconds=self.shared.settings.heartbeat_timeout_seconds / 2)
        with self._lock:  # writers of ``_touched`` hold it, so the pruning never iterates a dict being changed
            if self._touched_pruned is None or now - self._touched_pruned >= self.touch_every:
                self._touched = {c: t for c, t in self._touched.items() if now - t < self.touch_every}
                self._touched_pruned = now
            self._touched[client_id] = now
            self._pending[client_id] = now
            since = self._pending_since = self._pending_since or now
            if fresh and now - since < self.TOUCH_BATCH:
                return None
            return self._drain()

    def drain_touches(self) -> dict[str, datetime]:
        """The deferred refreshes, handed to whoever writes them next."""
        with self._lock:
            return self._drain()

    def _drain(self) -> dict[str, datetime]:
        pending, self._pending, self._pending_since = self._pending, {}, None
        return pending
