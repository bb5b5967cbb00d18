"""Checks on what a client pushes, before anything of it is stored.

An update is accepted whole or not at all: every model tensor must be one of the tensors due
for the client's tier this round (no more, no fewer), with the tier's shape, a float32 (or
float16, upcast) payload where the spec says float32, and only finite values. SCAFFOLD's
control deltas follow the same rules over the tier's trainable tensors. Every violation is an
:class:`~aggregator_service.errors.InvalidArgument` that names the tensor and the rule.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from aggregator_service.errors import IncompleteUpdate, InvalidArgument
from fedcore.codec import all_finite
from fedcore.spec import ModelSpec, TensorSpec

__all__ = ["check_header", "check_tensors"]

_UPCASTABLE = {"float32", "float64"}


def check_header(update_id: str, num_samples: int, metrics: Mapping[str, float]) -> dict[str, float]:
    """Validate a push header's fields; returns the metrics as plain floats."""
    if not update_id or len(update_id) > 128 or not all(33 <= ord(ch) <= 126 for ch in update_id):
        raise InvalidArgument(
            f"update_id must be 1 to 128 printable ASCII characters without spaces (e.g. a UUID4), got {update_id!r}"
        )
    if isinstance(num_samples, bool) or int(num_samples) != num_samples or num_samples < 1:
        raise InvalidArgument(
            f"num_samples must be an integer ≥ 1 (the update's aggregation weight), got {num_samples}"
        )
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not key.strip():
            raise InvalidArgument(f"metric name {key!r} is blank: name each metric, e.g. train_loss")
        f = float(value)
        if not math.isfinite(f):
            raise InvalidArgument(f"metric {key!r} is {value}: metrics must be finite numbers")
        out[str(key)] = f
    return out


def _fmt(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _check_one(what: str, name: str, array: Any, spec: TensorSpec, tier: str) -> np.ndarray:
    arr = np.asarray(array.detach().cpu().numpy() if hasattr(array, "detach") else array)
    got = arr.dtype.name
    if got != spec.dtype:
        if not (got == "float16" and spec.dtype in _UPCASTABLE):
            accepted = f"{spec.dtype} (or float16, upcast)" if spec.dtype in _UPCASTABLE else spec.dtype
            raise InvalidArgument(f"{what} {name!r}: dtype {got}, expected {accepted}")
    if tuple(arr.shape) != spec.shape:
        raise InvalidArgument(
            f"{what} {name!r}: shape {_fmt(tuple(arr.shape))} does not match {_fmt(spec.shape)} of tier {tier}"
        )
    if not all_finite(arr):
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise InvalidArgument(f"{what} {name!r}: {bad} NaN or Inf values; only finite values are accepted")
    # np.require keeps the rank: ascontiguousarray would turn BatchNorm's 0-d num_batches_tracked into (1,)
    return np.require(arr.astype(spec.dtype, copy=False), requirements="C")


def check_tensors(
    spec: ModelSpec,
    round_: int,
    due: Collection[str],
    tensors: Mapping[str, Any],
    control_delta: Mapping[str, Any] | None,
    *,
    scaffold: bool,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """The pushed tensors (and control deltas) validated against ``spec`` (the client's tier), upcast.

    ``due`` are the tier's tensor names due in ``round_``; the push must hold exactly those.
    """
    tier = spec.describe()
    known = {t.name: t for t in spec.tensors}
    for name in tensors:
        if name not in known:
            raise InvalidArgument(f"tensor {name!r}: unknown tensor, not part of {tier}")
        if name not in due:
            raise InvalidArgument(
                f"tensor {name!r}: not due in round {round_}; push only the task's due_tensors, keep the others local"
            )
    missing = [n for n in due if n not in tensors]
    if missing:
        raise IncompleteUpdate(
            f"missing due tensor(s) {', '.join(repr(n) for n in missing[:5])}"
            f"{' …' if len(missing) > 5 else ''} for round {round_}: push every name in the task's due_tensors"
        )
    clean = {name: _check_one("tensor", name, tensors[name], known[name], tier) for name in due}

    if not control_delta:
        if scaffold:
            raise IncompleteUpdate(
                "SCAFFOLD needs the control deltas Δc of local training (TENSOR_KIND_CONTROL_DELTA chunks)"
            )
        return clean, None
    if not scaffold:
        raise InvalidArgument("control deltas are only accepted when the federation's strategy is SCAFFOLD")
    deltas: dict[str, np.ndarray] = {}
    for name, array in control_delta.items():
        t = known.get(name)
        if t is None or t.role == "buffer":
            raise InvalidArgument(f"control delta {name!r}: not a trainable tensor of {tier}")
        deltas[name] = _check_one("control delta", name, array, t, tier)
    missing = [t.name for t in spec.tensors if t.role != "buffer" and t.name not in deltas]
    if missing:  # the server's mean of the controls must hold every client's Δc for every tensor
        raise IncompleteUpdate(
            f"missing control delta(s) {', '.join(repr(n) for n in missing[:5])}"
            f"{' …' if len(missing) > 5 else ''}: SCAFFOLD needs Δc for every trainable tensor of {tier}"
        )
    return clean, deltas
