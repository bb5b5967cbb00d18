"""A federation's name as the store keys it: checked in every settings class that names one, torch-free for the
dashboard."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

__all__ = ["FEDERATION_NAME_MAX", "FederationName", "check_federation_name"]

#: the longest federation name the store keeps (``federations.name``)
FEDERATION_NAME_MAX = 128


def check_federation_name(value: str) -> str:
    """A federation name the store can key: not blank, at most :data:`FEDERATION_NAME_MAX` characters."""
    if not value.strip():
        raise ValueError("federation_name must not be empty")
    if len(value) > FEDERATION_NAME_MAX:
        raise ValueError(f"federation_name is {len(value)} characters; the store keeps at most {FEDERATION_NAME_MAX}")
    return value


#: ``federation_name`` in every settings class that names one
FederationName = Annotated[str, AfterValidator(check_federation_name)]
