"""A user's strategy by reference: ``"package.module:Class"``, imported like a user's model.

The grammar and the import are the model references' (:mod:`fedcore.reference`). Only the
aggregator imports a strategy — its operator names it in the federation's own config — so no
client ever runs it and clients' model allow-lists do not apply.
"""

from __future__ import annotations

from typing import Any

from fedcore.reference import import_attribute, is_reference, parse_reference

__all__ = ["import_reference", "is_reference"]


def import_reference(text: str) -> Any:
    """Import ``package.module`` and return its (dotted) attribute; a clear ``ValueError`` otherwise."""
    parsed = parse_reference(text)
    if parsed is None:
        raise ValueError(f"{text!r} is not a reference: write 'package.module:Attribute'")
    return import_attribute(*parsed, label=repr(text))
