"""Where virtual clients run on a Ray cluster: resources per tier, and the rule that packs clients onto actors.

A heterogeneous fleet costs what its devices cost: ``[simulation.resources]`` gives each tier
the Ray resources one of its virtual clients takes while it trains (``num_cpus``, ``num_gpus``,
``memory`` in bytes), so tier-1/8 clients with ``num_cpus = 0.25`` pack four to a CPU and tier-1
clients may hold a GPU fraction. An actor is one such client-sized slot: it hosts a fixed set of
clients of one tier and trains one at a time.

The rule (:func:`place`), in three steps:

1. every tier with clients gets one actor (a tier whose one client does not fit the cluster is refused);
2. while another actor fits in what is left, it goes to the tier with the most clients per actor
   (ties: the larger tier), never more actors than the tier has clients;
3. a tier's ``j``-th client, counting in client index order, lives on that tier's actor ``j mod n``.

The rule reads only the population and the cluster's totals, so a run places its clients the
same way every time; results never depend on placement (each client's training is seeded by
(seed, round, client) and updates fold in client order).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedcore.tiers import match_tier

__all__ = ["DEFAULT_RESOURCES", "Slot", "TierResources", "parse_resources", "place"]

#: Ray's names for what a client takes, and the cluster totals :func:`place` compares them with.
KINDS = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}
_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


@dataclass(frozen=True)
class TierResources:
    """What one virtual client of a tier takes on the cluster while it trains."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: int = 0  # bytes; 0 asks for none

    def demand(self) -> dict[str, float]:
        """Ray resource name → amount, only what is asked for."""
        return {KINDS[k]: float(v) for k, v in vars(self).items() if v}

    def actor_options(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory:
            out["memory"] = self.memory
        return out


DEFAULT_RESOURCES = TierResources()


@dataclass(frozen=True)
class Slot:
    """One actor: the tier it serves, what it reserves, and the client indices it hosts."""

    tier: float
    resources: TierResources
    indices: tuple[int, ...]


def _tier(key: str) -> float:
    text = str(key).strip()
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"[simulation.resources]: {key!r} is not a tier (write 1, 0.5 or 1/8, or default)") from None


def _memory(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{where}: memory must be bytes or a size like '512MiB', got {value!r}")
    if isinstance(value, int | float):
        n = float(value)
    else:
        text = str(value).strip().upper().replace(" ", "")
        digits = text.rstrip("KMGIB")
        unit = text[len(digits) :]
        if unit not in _UNITS:
            raise ValueError(f"{where}: memory {value!r} has an unknown unit (use B, KiB, MiB, GiB, KB, MB, GB)")
        try:
            n = float(digits) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"{where}: memory {value!r} is not a size like '512MiB'") from None
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"{where}: memory must be a finite size ≥ 0, got {value!r}")
    return int(n)


def parse_resources(table: Mapping[str, Any] | None, tiers: Sequence[float]) -> dict[float, TierResources]:
    """``[simulation.resources]`` → tier → :class:`TierResources`, for every tier in ``tiers``.

    Keys are tiers (``"1"``, ``"0.5"``, ``"1/8"``) or ``"default"`` (tiers not named; otherwise one
    CPU per client); values are tables with ``num_cpus``, ``num_gpus``, ``memory``.
    """
    if table is not None and not isinstance(table, Mapping):
        raise ValueError(f"[simulation.resources] must be a table of tiers, got {table!r}")
    table = dict(table or {})
    known = sorted({float(t) for t in tiers}, reverse=True)
    default = DEFAULT_RESOURCES
    given: dict[float, TierResources] = {}
    for key, value in table.items():
        where = f"[simulation.resources] {key}"
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: give a table like {{num_cpus = 0.25, num_gpus = 0, memory = '512MiB'}}")
        unknown = set(value) - set(KINDS)
        if unknown:
            raise ValueError(f"{where}: unknown keys {', '.join(sorted(unknown))} (use {', '.join(KINDS)})")
        numbers = {}
        for k in ("num_cpus", "num_gpus"):
            v = value.get(k, getattr(DEFAULT_RESOURCES, k) if k == "num_cpus" else 0.0)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{where}: {k} must be a finite number ≥ 0, got {v!r}")
            numbers[k] = float(v)
        if numbers["num_gpus"] > 1 and numbers["num_gpus"] != int(numbers["num_gpus"]):
            raise ValueError(f"{where}: num_gpus above 1 must be whole (Ray's rule), got {numbers['num_gpus']}")
        res = TierResources(numbers["num_cpus"], numbers["num_gpus"], _memory(value.get("memory", 0), where))
        if not res.num_cpus and not res.num_gpus:
            raise ValueError(f"{where}: a client must take some num_cpus or num_gpus, or clients could not be placed")
        if key == "default":
            default = res
            continue
        tier = _tier(key)
        match = match_tier(tier, known)
        if match is None:
            raise ValueError(f"{where}: no client has tier {tier:g} (tiers: {', '.join(f'{t:g}' for t in known)})")
        if match in given:
            raise ValueError(f"{where}: tier {tier:g} is given twice")
        given[match] = res
    return {t: given.get(t, default) for t in known}


def place(
    client_tiers: Sequence[float], resources: Mapping[float, TierResources], capacity: Mapping[str, float]
) -> list[Slot]:
    """The actors for a population whose client ``i`` has tier ``client_tiers[i]`` (the rule in the module doc).

    ``capacity`` is the cluster's total resources (``ray.cluster_resources()``).
    """
    members: dict[float, list[int]] = {}
    for i, tier in enumerate(client_tiers):
        members.setdefault(float(tier), []).append(i)
    order = sorted(members, reverse=True)
    left = {k: float(v) for k, v in capacity.items()}

    def fits(tier: float) -> bool:
        return all(left.get(kind, 0.0) + 1e-9 >= amount for kind, amount in resources[tier].demand().items())

    def take(tier: float) -> None:
        for kind, amount in resources[tier].demand().items():
            left[kind] = left.get(kind, 0.0) - amount

    actors = dict.fromkeys(order, 0)
    for tier in order:
        if not fits(tier):
            need = ", ".join(f"{k}={v:g}" for k, v in resources[tier].demand().items())
            have = ", ".join(f"{k}={max(0.0, left.get(k, 0.0)):g}" for k in resources[tier].demand())
            total = ", ".join(f"{k}={capacity.get(k, 0.0):g}" for k in resources[tier].demand())
            raise ValueError(
                f"a tier-{tier:g} client asks for {need} but the cluster ({total}) has {have} left after one actor "
                "per larger tier: lower [simulation.resources] (e.g. default = {num_cpus = 0.5}) or add nodes"
            )
        take(tier)
        actors[tier] = 1
    while True:
        room = [t for t in order if actors[t] < len(members[t]) and fits(t)]
        if not room:
            break
        tier = max(room, key=lambda t: (len(members[t]) / actors[t], t))
        take(tier)
        actors[tier] += 1
    return [
        Slot(tier, resources[tier], tuple(members[tier][j :: actors[tier]]))
        for tier in order
        for j in range(actors[tier])
    ]
