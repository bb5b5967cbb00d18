"""Client keys and derived seeds: the names and random streams every transport computes the same way.

Cohorts are sampled, local training seeded and updates folded by client key, so an in-process
simulation, a gRPC federation and a client pool reproduce each other's rounds exactly.
"""

from __future__ import annotations

import hashlib

__all__ = ["client_key", "client_number", "derive_seed"]


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from (seed, round, client…): stable across processes and transports."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def client_key(number: int) -> str:
    """The engine's name for the ``number``-th client to join (0-based): cohorts are sampled, local
    training seeded and updates folded by it, so every transport computes the same rounds.
    Fixed width keeps string order equal to joining order."""
    if number < 0:
        raise ValueError(f"client number must be ≥ 0, got {number}")
    return f"client-{number:06d}"


def client_number(key: str) -> int:
    """The inverse of :func:`client_key`."""
    prefix, _, digits = key.partition("-")
    if prefix != "client" or not digits.isdigit():
        raise ValueError(f"not a client key: {key!r}")
    return int(digits)
