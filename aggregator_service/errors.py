"""The aggregator's domain errors, one class per gRPC status code the service answers with.

The coordinator raises them with a message meant for the person reading the client's log;
the servicer (``aggregator_service.server``) turns each into ``context.abort(code, message)``
by its :attr:`ServiceError.code` name, so this module needs no grpc import.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "Aborted",
    "FailedPrecondition",
    "IncompleteUpdate",
    "InvalidArgument",
    "PermissionDenied",
    "ResourceExhausted",
    "ServiceError",
    "Unauthenticated",
    "Unavailable",
]


class ServiceError(Exception):
    """Base class; ``code`` is the name of a ``grpc.StatusCode`` member."""

    code: ClassVar[str] = "UNKNOWN"

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.code.lower()


class Unauthenticated(ServiceError):
    """Missing, unknown or revoked bearer token; wrong enrollment secret."""

    code = "UNAUTHENTICATED"


class PermissionDenied(ServiceError):
    """Authenticated, but not allowed (e.g. a client certificate that names another client)."""

    code = "PERMISSION_DENIED"


class InvalidArgument(ServiceError):
    """A malformed request: unknown tensor, wrong shape or dtype, NaN/Inf, bad header fields."""

    code = "INVALID_ARGUMENT"


class IncompleteUpdate(InvalidArgument):
    """A push stream that ended before the update did (due tensors or control deltas missing): a client's
    mistake, or a stream cut at a tensor's end, which the servicer keeps for a resumed push."""


class FailedPrecondition(ServiceError):
    """Valid, but not now: stale round, not in the cohort, no tier fits the device."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(ServiceError):
    """Too large: a push over the configured byte limit."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(ServiceError):
    """Try again later (shutting down, database busy)."""

    code = "UNAVAILABLE"


class Aborted(ServiceError):
    """The call's premise is gone; retry at a higher level (a resumed push whose kept part expired: push it whole)."""

    code = "ABORTED"
