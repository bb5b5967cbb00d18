"""What a request must be before any handler sees it: decodable, its names printable and short, its rounds in range.

gRPC Python answers INTERNAL ("Exception deserializing request!") when a request's bytes do not
parse, and a NUL byte, a megabyte name or round 2^63−1 reach the database as its own error
(PostgreSQL's DataError: INTERNAL as well). The servicer therefore receives raw bytes, decodes
them here and checks every field a client controls by the same rules on every backend; each
violation is an :class:`~aggregator_service.errors.InvalidArgument` that names the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from aggregator_service.errors import InvalidArgument

__all__ = ["MAX_MAP_ENTRIES", "MAX_NAME_CHARS", "MAX_ROUND", "MAX_TEXT_CHARS", "check_message", "check_name", "decode"]

#: Rounds and counts are stored as 32-bit integers (PostgreSQL ``integer``); no federation gets near.
MAX_ROUND = 2**31 - 1
#: Names a client chooses (client_name, device_name, metric keys, tensor names) are at most this long.
MAX_NAME_CHARS = 128
#: Any other string a client sends (the enrollment secret, dtype names).
MAX_TEXT_CHARS = 1024
#: Entries of a map a client sends (a push's or an evaluation's metrics): each round stores the cohort's keys.
MAX_MAP_ENTRIES = 256

_NAMES = frozenset({"client_name", "device_name", "name", "update_id", "dtype"})
_COUNTS = frozenset({"round", "num_samples"})
# counts a domain rule bounds with a better message: a push claims at most what its client registered, and
# Register caps the declaration at max_client_samples
_BOUNDED_ELSEWHERE = frozenset({("PushHeader", "num_samples"), ("CapabilityProfile", "num_samples")})

M = TypeVar("M", bound=Message)


def decode(parse: Callable[[bytes], M], data: bytes, what: str) -> M:
    """``parse(data)``; bytes that are not a ``what`` message are the caller's error, not the server's."""
    try:
        return parse(data)
    except Exception as exc:
        raise InvalidArgument(
            f"the request is not a valid {what} message ({type(exc).__name__}): "
            "send it with the fedatoms.v1 stubs (fedwire/v1, proto/fedatoms/v1)"
        ) from exc


def check_name(what: str, value: str, limit: int = MAX_NAME_CHARS) -> None:
    """At most ``limit`` printable characters: no NUL, newline or other control character."""
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long; at most {limit} are accepted")
    if not value.isprintable():
        bad = next(ch for ch in value if not ch.isprintable())
        raise InvalidArgument(
            f"{what} contains the non-printable character U+{ord(bad):04X}; use printable characters only"
        )


def check_message(message: Message, path: str = "") -> None:
    """Every string, round and count of ``message`` (nested messages and map keys included) within bounds."""
    for field, value in message.ListFields():
        where = f"{path}{field.name}"
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            if len(value) > MAX_MAP_ENTRIES:
                raise InvalidArgument(f"{where} has {len(value)} entries; at most {MAX_MAP_ENTRIES} are accepted")
            for key in value:
                if isinstance(key, str):
                    check_name(f"{where} key {key[:40]!r}", key)
            continue
        values: list[Any] = list(value) if _repeated(field) else [value]
        for v in values:
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                check_message(v, f"{where}.")
            elif field.type == FieldDescriptor.TYPE_STRING:
                check_name(where, v, MAX_NAME_CHARS if field.name in _NAMES else MAX_TEXT_CHARS)
            elif field.type == FieldDescriptor.TYPE_ENUM and v not in field.enum_type.values_by_number:
                known = ", ".join(f"{e.number} ({e.name})" for e in field.enum_type.values)
                raise InvalidArgument(f"{where} = {v} is not a value this server knows: {known}")
            elif _counted(message, field) and not 0 <= v <= MAX_ROUND:
                raise InvalidArgument(f"{where} = {v} is out of range: it must be between 0 and {MAX_ROUND}")


def _counted(message: Message, field: FieldDescriptor) -> bool:
    return field.name in _COUNTS and (message.DESCRIPTOR.name, field.name) not in _BOUNDED_ELSEWHERE


def _repeated(field: FieldDescriptor) -> bool:
    # protobuf ≥ 5 has is_repeated; older ones only label
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == FieldDescriptor.LABEL_REPEATED
