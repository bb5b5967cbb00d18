"""A user's strategy by reference: ``"package.module:Class"``, imported like a user's model.

The grammar is the model references' (``package.module:attribute``, dotted names only).
Only the aggregator imports a strategy — its operator names it in the federation's own
config — so no client ever runs it and clients' model allow-lists do not apply.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

__all__ = ["import_reference", "is_reference"]

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_REFERENCE = re.compile(rf"^({_DOTTED}):({_DOTTED})$")


def is_reference(text: str) -> bool:
    return _REFERENCE.match(text) is not None


def import_reference(text: str) -> Any:
    """Import ``package.module`` and return its (dotted) attribute; a clear ``ValueError`` otherwise."""
    match = _REFERENCE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a reference: write 'package.module:Attribute'")
    module_name, attr = match.groups()
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{text!r}: cannot import {module_name!r} ({exc})") from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"{text!r}: module {module_name!r} has no attribute {attr!r}") from None
    return target
