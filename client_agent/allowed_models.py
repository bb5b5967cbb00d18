"""The model code a client's operator lets the aggregator make it import.

A federation names its model by an import reference, and building it runs that module's code
on the device. So the reference the server sends is read as text and checked against the
operator's allow-list *before* anything is imported; a refusal says which reference and how to
allow it. The zoo (fedatoms' own code) is always allowed; the default list adds
``torchvision.models``. Entries are module prefixes (``my_company.nets`` allows
``my_company.nets.cnn:Net``) or whole references (``my_pkg.nets:build``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from fedcore.reference import canonical, is_zoo, reference_module

__all__ = ["DEFAULT_ALLOWED_MODELS", "ModelNotAllowed", "check_model_allowed", "check_reference"]

DEFAULT_ALLOWED_MODELS: tuple[str, ...] = ("torchvision.models",)


class ModelNotAllowed(ValueError):
    """The aggregator asked for model code this client's operator did not allow."""


def _allows(entry: str, model: str) -> bool:
    if ":" in entry:
        return canonical(model) == entry
    module = reference_module(model)
    return module == entry or module.startswith(entry + ".")


def check_model_allowed(model_spec_json: str, allowed: Sequence[str]) -> str:
    """The model reference of a Register reply's spec, or :class:`ModelNotAllowed`; imports nothing."""
    try:
        model = json.loads(model_spec_json)["model"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the aggregator sent a malformed model spec ({exc})") from None
    if not isinstance(model, str):
        raise ValueError(f"the aggregator sent a model reference that is not text: {model!r}")
    return check_reference(model, allowed)


def check_reference(model: str, allowed: Sequence[str]) -> str:
    """``model`` when the zoo or ``allowed`` covers it, else :class:`ModelNotAllowed`; imports nothing."""
    if is_zoo(model):
        return model
    canonical(model)  # a malformed reference is refused as such, before any check by prefix
    if any(_allows(entry, model) for entry in allowed):
        return model
    raise ModelNotAllowed(
        f"model {model!r} is not allowed here: it would import "
        f"{reference_module(model)!r}. Allowed: the zoo"
        + (f", {', '.join(allowed)}" if allowed else "")
        + f". If you trust this federation's model code, allow it: --allow-model {reference_module(model)} "
        f"(fedatoms.load_model: allowed_models=[{reference_module(model)!r}])"
    )
