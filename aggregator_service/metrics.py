"""Round metrics: latent clients, effective-filter dispersion, bandwidth accounting.

Everything here is pure (no database, no networking) so the simulator and the gRPC service
report identical numbers. FedLAMA's discrepancy ``d_l`` lives with the interval policies
(:mod:`aggregator_service.intervals`); the per-tensor dispersion ``Σ_k p_k ‖x_k − u‖²`` comes
from the streaming accumulator in :mod:`aggregator_service.weighted_mean`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from fedcore.codec import encoded_size
from fedcore.layers import reconstruct_filter
from fedcore.spec import ModelSpec

__all__ = [
    "CATEGORIES",
    "CATEGORY_DIRECTION",
    "DIRECTIONS",
    "BandwidthLedger",
    "Transfer",
    "atom_modules",
    "effective_dispersion",
    "effective_filters",
    "fedavg_equivalent_bytes",
    "fedavg_transfer_bytes",
    "latent_clients",
    "total_dispersion",
]

DIRECTIONS = ("down", "up")
#: What a transfer was for: a fetch to train on, a fetch of a closed round's model to evaluate, a push.
CATEGORIES = ("train_fetch", "eval_fetch", "push")
CATEGORY_DIRECTION = {"train_fetch": "down", "eval_fetch": "down", "push": "up"}
#: A bare direction, as older callers name it, stands for the category it always meant.
DIRECTION_CATEGORY = {"down": "train_fetch", "up": "push"}


def category_of(kind: str) -> str:
    """``kind`` as a category: a category itself, or ``"down"``/``"up"`` (a training fetch / a push)."""
    category = DIRECTION_CATEGORY.get(kind, kind)
    if category not in CATEGORIES:
        raise ValueError(f"direction (category) must be one of {', '.join(CATEGORIES)}, down, up; got {kind!r}")
    return category


# --------------------------------------------------------------------------- variance


def latent_clients(m: int) -> int:
    """Latent clients that ``m`` aggregated clients add by atom swapping: ``m² − m`` ordered pairs (§2.4)."""
    if m < 0:
        raise ValueError(f"number of clients must be ≥ 0, got {m}")
    return m * m - m


def total_dispersion(d: Mapping[str, float]) -> float:
    """Sum of per-tensor dispersions (the model-wide ``Σ_k p_k ‖x_k − u‖²``)."""
    return math.fsum(d.values())


def atom_modules(tensors: Mapping[str, Tensor]) -> list[str]:
    """Modules whose full-rank ``<mod>.atoms (m,k,k)`` and ``<mod>.coefficients (o,i,m)`` are both present."""
    out = []
    for name, atoms in tensors.items():
        if not name.endswith(".atoms") and name != "atoms":
            continue
        module = name.rpartition(".")[0]
        coefficients = tensors.get(f"{module}.coefficients" if module else "coefficients")
        if (
            coefficients is not None
            and atoms.dim() == 3
            and coefficients.dim() == 3
            and coefficients.shape[2] == atoms.shape[0]
        ):
            out.append(module)
    return out


def effective_filters(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """One client's effective filters ``W_k = α_k × D_k`` (float64) per module with both factors present.

    The streaming half of the effective-filter dispersion: fold these into a weighted mean
    with the client's weight, then call :func:`effective_dispersion` at the end of the round.
    """
    out = {}
    for module in atom_modules(tensors):
        prefix = f"{module}." if module else ""
        alpha = tensors[f"{prefix}coefficients"].detach().to(torch.float64)
        atoms = tensors[f"{prefix}atoms"].detach().to(torch.float64)
        out[module] = reconstruct_filter(alpha, atoms)
    return out


def effective_dispersion(
    filter_mean: Tensor, filter_dispersion: float, coefficients_mean: Tensor, atoms_mean: Tensor
) -> float:
    """``Σ_k p_k ‖α_k × D_k − ᾱ × D̄‖²`` from streaming sums.

    ``filter_mean`` ``= Σ p_k W_k`` (the average of products) and ``filter_dispersion``
    ``= Σ p_k ‖W_k − filter_mean‖²`` come from folding :func:`effective_filters`;
    ``coefficients_mean`` and ``atoms_mean`` are ``ᾱ`` and ``D̄`` with the same weights. By the
    parallel-axis identity the dispersion around ``ᾱ × D̄`` (the product of averages the
    server keeps) is ``filter_dispersion + ‖filter_mean − ᾱ × D̄‖²``.
    """
    product = reconstruct_filter(coefficients_mean.to(torch.float64), atoms_mean.to(torch.float64))
    gap = float(torch.sum((filter_mean.to(torch.float64) - product) ** 2))
    return filter_dispersion + gap


# --------------------------------------------------------------------------- bandwidth


@dataclass(frozen=True)
class Transfer:
    """Bytes of one tensor moved between the server and one client in one round, for one category."""

    round: int
    client_id: str
    direction: str
    tensor: str
    nbytes: int
    category: str = ""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class BandwidthLedger:
    """Bytes per (round, client, category, tensor), and transfers per (round, client, category).

    Bytes are what :mod:`fedcore.codec` encodes (``encoded_size``: elements × item size, 2
    bytes per float with ``fp16``); chunk headers and gRPC framing are not counted. A
    tensor recorded twice in a round (a retried fetch) counts twice: it did travel twice.
    :meth:`transfer` counts one transfer (a fetch that moved a tensor, or a push); each
    counts :func:`fedavg_transfer_bytes` in the FedAvg-equivalent (``fedavg_bytes``).
    """

    def __init__(self, fp16: bool = False, fedavg_bytes: int = 0) -> None:
        self.fp16 = fp16
        self.fedavg_bytes = fedavg_bytes
        self._bytes: dict[tuple[int, str, str, str], int] = defaultdict(int)
        self._transfers: dict[tuple[int, str, str], int] = defaultdict(int)

    def record(self, round_: int, client_id: str, direction: str, tensor: str, nbytes: int) -> None:
        """Count ``nbytes`` of ``tensor``; ``direction`` is a category (``"down"``/``"up"``: training fetch/push)."""
        category = category_of(direction)
        if nbytes < 0:
            raise ValueError(f"nbytes must be ≥ 0, got {nbytes}")
        self._bytes[(round_, client_id, category, tensor)] += int(nbytes)

    def transfer(self, round_: int, client_id: str, category: str) -> None:
        """Count one transfer of ``category`` (call it once per fetch that moved a tensor, once per push)."""
        self._transfers[(round_, client_id, category_of(category))] += 1

    def record_tensors(
        self, round_: int, client_id: str, direction: str, tensors: Mapping[str, Tensor], fp16: bool | None = None
    ) -> int:
        """Record every tensor at its encoded size; returns the bytes recorded."""
        half = self.fp16 if fp16 is None else fp16
        total = 0
        for name, t in tensors.items():
            nbytes = encoded_size(tuple(t.shape), _dtype_name(t.dtype), half)
            self.record(round_, client_id, direction, name, nbytes)
            total += nbytes
        return total

    def records(self) -> Iterator[Transfer]:
        for (round_, client, category, tensor), nbytes in self._bytes.items():
            yield Transfer(round_, client, CATEGORY_DIRECTION[category], tensor, nbytes, category)

    def total(
        self,
        *,
        round_: int | None = None,
        client_id: str | None = None,
        direction: str | None = None,
        tensor: str | None = None,
        category: str | None = None,
    ) -> int:
        """Bytes matching every given filter (all bytes when none is given)."""
        return sum(
            b
            for (r, c, k, t), b in self._bytes.items()
            if (round_ is None or r == round_)
            and (client_id is None or c == client_id)
            and (direction is None or CATEGORY_DIRECTION[k] == direction)
            and (category is None or k == category)
            and (tensor is None or t == tensor)
        )

    def fedavg_equivalent(self, *, round_: int | None = None, category: str | None = None) -> int:
        """What plain FedAvg moves for the counted transfers: :func:`fedavg_equivalent_bytes` of their number."""
        n = sum(
            count
            for (r, _, k), count in self._transfers.items()
            if (round_ is None or r == round_) and (category is None or k == category)
        )
        return n * self.fedavg_bytes

    def _by(self, axis: int, round_: int | None) -> dict:
        out: dict = defaultdict(lambda: dict.fromkeys(DIRECTIONS, 0))
        for key, b in self._bytes.items():
            if round_ is None or key[0] == round_:
                out[key[axis]][CATEGORY_DIRECTION[key[2]]] += b
        return {k: dict(v) for k, v in sorted(out.items())}

    def per_round(self) -> dict[int, dict[str, int]]:
        """Round → {"down": bytes, "up": bytes}."""
        return self._by(0, None)

    def per_client(self, round_: int | None = None) -> dict[str, dict[str, int]]:
        """Client → {"down", "up"} bytes, in one round or over all rounds."""
        return self._by(1, round_)

    def per_tensor(self, round_: int | None = None) -> dict[str, dict[str, int]]:
        """Tensor → {"down", "up"} bytes, in one round or over all rounds."""
        return self._by(3, round_)

    def cumulative(self) -> dict[int, dict[str, int]]:
        """Round → running totals {"down", "up"} up to and including that round."""
        running = dict.fromkeys(DIRECTIONS, 0)
        out = {}
        for round_, per_dir in self.per_round().items():
            for d in DIRECTIONS:
                running[d] += per_dir[d]
            out[round_] = dict(running)
        return out


def fedavg_transfer_bytes(spec: ModelSpec) -> int:
    """Payload bytes of one plain-FedAvg transfer: the whole unfactorized model, at full precision.

    The ``state_dict`` of ``spec.unfactorized()`` (buffers included,
    each in its own dtype: fp32 weights, int64 counters), without fp16, counted as
    :mod:`fedcore.codec` counts payload (elements × item size; no chunk headers or framing).
    Plain FedAvg changes every tensor at every close, so each of its fetches after a close
    moves all of it, and each push does too.
    """
    plain = spec.unfactorized()
    return sum(encoded_size(t.shape, t.dtype) for t in plain.tensors)


def fedavg_equivalent_bytes(spec: ModelSpec, transfers: int = 1) -> int:
    """The FedAvg-equivalent of ``transfers`` transfers: ``transfers × fedavg_transfer_bytes(spec)``.

    The one rule both the service's ledger and the in-process simulator apply: every transfer
    that happened (a fetch that moved at least one tensor — training or evaluation — or a
    push) counts what plain FedAvg moves in its place, the whole unfactorized fp32 model (a fetch
    cut midway: its share of it, :func:`fedavg_equivalent_of_part`). For
    plain FedAvg itself every such transfer moves exactly that, so its ratio is 1.000; a fetch
    that moves nothing counts nothing on either side.
    """
    if transfers < 0:
        raise ValueError(f"transfers must be ≥ 0, got {transfers}")
    return transfers * fedavg_transfer_bytes(spec)


def fedavg_equivalent_of_part(spec: ModelSpec, sent: int, whole: int) -> int:
    """The FedAvg-equivalent of a transfer cut after ``sent`` of its ``whole`` model bytes: the same share of
    FedAvg's transfer, rounded to the byte. Counting a cut fetch as a whole one would credit the retry that
    follows it with a second FedAvg transfer (plain FedAvg on a bad link would read below 1.000); in shares,
    plain FedAvg's equivalent is its bytes exactly, cut or not."""
    if not 0 <= sent <= whole:
        raise ValueError(f"sent must be in [0, whole = {whole}], got {sent}")
    if sent == 0:
        return 0  # no transfer
    unit = fedavg_transfer_bytes(spec)
    return unit if sent == whole else (2 * unit * sent + whole) // (2 * whole)
