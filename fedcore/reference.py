"""Model references: ``"package.module:attribute"`` plus keyword arguments, or a zoo name.

A federation names its model the way a Python user would write it: an importable callable
(a class or a function) that returns an ``nn.Module``, with the keyword arguments to call it
with, e.g. ``"torchvision.models:mobilenet_v3_small"`` and ``{"num_classes": 10}``. The zoo's
short names (``"resnet18"``) are references like any other: they stand for
``"fedcore.models:resnet18"``. Nothing is ever unpickled; a reference is text, and
:func:`reference_module` reads the module it would import without importing it, so a client can
check it against its allow-list first.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from fedcore.models import MODELS

__all__ = [
    "build_reference",
    "canonical",
    "import_attribute",
    "is_reference",
    "is_zoo",
    "parse_reference",
    "reference_module",
    "resolve",
]

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_REFERENCE = re.compile(rf"^({_DOTTED}):({_DOTTED})$")


def is_zoo(model: str) -> bool:
    return model in MODELS


def parse_reference(text: str) -> tuple[str, str] | None:
    """``(module, attribute)`` of ``package.module:attribute``; None for any other text."""
    match = _REFERENCE.match(text)
    return None if match is None else (match.group(1), match.group(2))


def is_reference(text: str) -> bool:
    return parse_reference(text) is not None


def import_attribute(module_name: str, attr: str, label: str) -> Any:
    """Import ``module_name`` and return its (dotted) ``attr``; a ``ValueError`` starting with ``label`` otherwise.

    The user's working directory is importable, as uvicorn and flwr read ``my_pkg.mod:thing``:
    a model, dataset or strategy usually lives beside the user, not in site-packages.
    """
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, "")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # a user's module may fail in any way at import; say which
        raise ValueError(f"{label}: cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"{label}: module {module_name!r} has no attribute {attr!r}") from None
    return target


def _parse(model: str) -> tuple[str, str]:
    if is_zoo(model):
        module, _, attr = MODELS[model].reference.partition(":")
        return module, attr
    parsed = parse_reference(model)
    if parsed is None:
        raise ValueError(
            f"unknown model {model!r}: give a zoo name ({', '.join(MODELS)}) or an import reference "
            "'package.module:callable', e.g. 'torchvision.models:resnet18'"
        )
    return parsed


def canonical(model: str) -> str:
    """``package.module:attribute`` of a reference or a zoo name (validated, not imported)."""
    module, attr = _parse(model)
    return f"{module}:{attr}"


def reference_module(model: str) -> str:
    """The module a reference would import, read from its text alone."""
    return _parse(model)[0]


def resolve(model: str) -> Any:
    """Import the reference's module and return its attribute (the model's builder)."""
    module_name, attr = _parse(model)
    target = import_attribute(module_name, attr, f"model {model!r}")
    if not callable(target):
        raise ValueError(
            f"model {model!r}: {attr!r} is not callable; name a class or a function returning an nn.Module"
        )
    return target


def build_reference(model: str, args: Mapping[str, Any]) -> nn.Module:
    """Call the reference's builder with ``args``; the result must be an ``nn.Module``."""
    builder = resolve(model)
    try:
        net = builder(**dict(args))
    except Exception as exc:  # the user's builder: whatever it raises is the model's error, named
        raise ValueError(
            f"model {model!r} cannot be built with arguments {dict(args)}: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(net, nn.Module):
        raise ValueError(f"model {model!r} returned {type(net).__name__}, not an nn.Module")
    lazy = sorted({type(m).__name__ for m in net.modules() if isinstance(m, LazyModuleMixin)})
    if lazy:
        raise ValueError(
            f"model {model!r} has lazy modules ({', '.join(lazy)}): the aggregator needs every tensor's shape "
            "before any data is seen; give their input sizes (nn.Conv2d, nn.Linear, …)"
        )
    return net
