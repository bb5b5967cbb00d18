"""Repository functions: every read and write the gRPC servicer and the dashboard make.

Each function takes the caller's :class:`~sqlalchemy.orm.Session` and works inside the
caller's transaction: nothing here commits. A unit of work is::

    with factory.begin() as session:          # factory = session_factory(engine)
        client = authenticate(session, token)
        ...

so everything a request writes lands together or not at all. Functions flush where a later
step (or the caller) needs database-generated values or constraint checks, never commit.

Tensors are stored as :func:`fedcore.codec.encode` produces them (little-endian bytes, wire
dtype name, shape) and read back through :func:`fedcore.codec.decode` with
``allow_nonfinite=False``; NaN/Inf are refused on the way in too, so a bad tensor fails the
request that brought it, not the round close that would read it.

Concurrency (several replicas, or the gRPC thread pool): a round closes under a row lock on
the round (:func:`lock_round`, ``SELECT … FOR UPDATE``) and :func:`store_update` takes a
shared lock on the same row, so an update is either stored before the close reads the
round's updates (and is aggregated) or sees the round closed (and is refused) — an
acknowledged update is never deleted unaggregated. On SQLite every transaction starts with
``BEGIN IMMEDIATE`` (see :mod:`.engine`), which serializes writers to the same effect.
"""

from ._common import FederationExists, NotFound, NotInCohort, RoundStateError, StoreError, UpdateConflict
from .closing import (
    ROUND_METRIC_FIELDS,
    TENSOR_METRIC_FIELDS,
    close_round,
    record_transfer,
    record_transfers,
    round_transfers,
)
from .enrollment import (
    ENROLLMENT_PBKDF2_ITERATIONS,
    authenticate,
    bind_certificate,
    certificate_sha256,
    check_enrollment_secret,
    count_clients,
    create_federation,
    get_client,
    get_federation,
    hash_secret,
    hash_token,
    list_clients,
    online_clients,
    register_client,
    revoke_client,
    save_engine_state,
    set_federation_state,
    touch_client,
    touch_clients,
    verify_secret,
)
from .reports import (
    evaluation_summary,
    keep_evaluation_summary,
    kept_evaluation_summary,
    list_rounds,
    record_evaluation,
    round_evaluations,
    round_tensor_metrics,
    tensor_metric_history,
)
from .retention import MAX_ROUNDS_PER_PRUNE, prune_history
from .rounds import (
    abandon_round,
    consume_round_updates,
    count_updates,
    delete_round_updates,
    extend_round,
    get_open_round,
    get_round,
    iter_round_updates,
    lock_round,
    open_round,
    refuse_late_push,
    reported_clients,
    retried_update,
    store_update,
)
from .tensors import (
    SERVER_CONTROL,
    load_global_tensors,
    load_strategy_tensors,
    save_global_tensors,
    save_strategy_tensors,
    tensor_intervals,
    tensor_versions,
)

__all__ = [
    "ENROLLMENT_PBKDF2_ITERATIONS",
    "MAX_ROUNDS_PER_PRUNE",
    "ROUND_METRIC_FIELDS",
    "SERVER_CONTROL",
    "TENSOR_METRIC_FIELDS",
    "FederationExists",
    "NotFound",
    "NotInCohort",
    "RoundStateError",
    "StoreError",
    "UpdateConflict",
    "abandon_round",
    "authenticate",
    "bind_certificate",
    "certificate_sha256",
    "check_enrollment_secret",
    "close_round",
    "consume_round_updates",
    "count_clients",
    "count_updates",
    "create_federation",
    "delete_round_updates",
    "evaluation_summary",
    "extend_round",
    "get_client",
    "get_federation",
    "get_open_round",
    "get_round",
    "hash_secret",
    "hash_token",
    "iter_round_updates",
    "keep_evaluation_summary",
    "kept_evaluation_summary",
    "list_clients",
    "list_rounds",
    "load_global_tensors",
    "load_strategy_tensors",
    "lock_round",
    "online_clients",
    "open_round",
    "prune_history",
    "record_evaluation",
    "record_transfer",
    "record_transfers",
    "refuse_late_push",
    "register_client",
    "reported_clients",
    "retried_update",
    "revoke_client",
    "round_evaluations",
    "round_tensor_metrics",
    "round_transfers",
    "save_engine_state",
    "save_global_tensors",
    "save_strategy_tensors",
    "set_federation_state",
    "store_update",
    "tensor_intervals",
    "tensor_metric_history",
    "tensor_versions",
    "touch_client",
    "touch_clients",
    "verify_secret",
]
