"""Per-tensor aggregation intervals: which full-rank tensors the server averages in which round.

Every policy answers the same questions (``interval``, ``due``, ``sync_period``) and may
learn from what it sees (``observe``), so the round coordinator never needs to know which
method it runs. Conventions shared by all policies:

- A *round* is FedLAMA's "iteration k": one round is E local epochs on every cohort client.
  Rounds are 1-based, and a tensor with interval τ is **due** (aggregated) at round r iff
  ``r % τ == 0``. Every interval divides ``sync_period``, so every tensor syncs at each
  multiple of it, and a cohort kept for a whole sync period ends it fully synchronized.
- Intervals belong to *full-rank* tensor names (the server aggregates full-rank tensors,
  after FedHM alignment); a policy is built from the full spec's ``TensorSpec`` sequence.

The policies:

- ``EveryRound`` ("every_round"): τ = 1 for everything, i.e. FedAvg.
- ``FixedSchedule`` ("fixed", β): the decomposition paper's fast/slow protocol — "atom
  coefficients communicated every 1/β rounds, atoms every round". By default the slow roles
  are the coefficients (``coefficients`` on full tensors; the factor roles are accepted too).
  Phase: the paper aggregates α when ``βt ∈ ℕ`` with 0-based t, i.e. t = 0, 1/β, 2/β, … (1-based
  rounds 1, 1/β + 1, …); here coefficients are aggregated at rounds 1/β, 2/β, … — one round
  earlier, and not in round 1 — so that, as for every policy, the full syncs land on multiples
  of the sync period (β = 1/5: rounds 5, 10, 15, … instead of 1, 6, 11, …).
- ``FedLAMA`` ("fedlama", τ', φ): all τ_l start at τ'; every φτ' rounds (after an optional
  warm-up) Algorithm 2 moves the least-critical tensors to φτ' and everyone else back to τ'.
  The cut is the prose/official-code crossing rule (relax the ascending-d prefix up to and
  including the first tensor with δ_l > 1 − λ_l), not the printed ``δ_l < λ_l``, which relaxes
  almost everything (specs/fedlama.md §4.2, §12.1). Only ≥2-D, non-buffer tensors (kernels,
  atoms, coefficients, head weight) can be relaxed; biases, BN affine and buffers stay at τ'.

State is JSON-serializable (``state_dict``/``load_state_dict``) so the aggregator can persist
it with the round and resume identically after a restart.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

from fedcore.spec import ROLES, TensorSpec

__all__ = [
    "DEFAULT_SLOW_ROLES",
    "HOLD_COHORT",
    "LAMA_WARMUPS",
    "POLICIES",
    "PROTECT",
    "SLOW_TENSORS",
    "EveryRound",
    "FedLAMA",
    "FixedSchedule",
    "IntervalPolicy",
    "LamaTrace",
    "build_policy",
    "discrepancy",
    "is_relaxable",
    "lama_adjust",
    "lama_trace",
    "protected_modules",
    "warmup_for",
]

STATE_FORMAT = 1
# The decomposition paper's slow tensors are the atom coefficients (full-rank role and its tier factors).
DEFAULT_SLOW_ROLES: tuple[str, ...] = ("coefficients", "coefficients_u", "coefficients_v")
#: What the fast/slow protocol sends every 1/β rounds: the atom coefficients (the paper's §4.2, the default), or
#: every tensor but the atoms (its §6.4, "communicates filter atoms every round but transmits whole models every
#: 2nd, 5th, or 10th round"): only then does a round between syncs move the atoms alone, the cost ≈ β of App. F.
SLOW_TENSORS: dict[str, tuple[str, ...]] = {
    "coefficients": DEFAULT_SLOW_ROLES,
    "all_but_atoms": tuple(r for r in ROLES if r != "atoms"),
}


# -- helpers -----------------------------------------------------------------------------------


def _int_param(name: str, value: object, minimum: int) -> int:
    """An integer parameter (integral floats from config files accepted), or a ValueError saying what is wanted."""
    number: int | None = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    if number is None or number < minimum:
        raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}")
    return number


def _check_round(round: object) -> int:
    if isinstance(round, bool) or not isinstance(round, numbers.Integral) or round < 1:
        raise ValueError(f"rounds are integers ≥ 1, got {round!r}")
    return int(round)


def _check_d(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"discrepancy of {name!r} must be a finite number ≥ 0, got {value!r}")
    return float(value)


def _json_normal(value: Any) -> Any:
    return json.loads(json.dumps(value))


def discrepancy(dispersion: float, interval: int, numel: int) -> float:
    """FedLAMA eq. (2): d_l = Σ_k p_k‖u_l − x_l^k‖² / (τ_l · dim(u_l)).

    ``dispersion`` is the weighted Σ p_k‖u_l − x_l^k‖² of the pre-broadcast client values; dividing by
    τ_l makes it per round, by dim(u_l) per parameter: the discrepancy a sync removes per unit of cost.
    A streamed Σp‖x‖² − ‖u‖² can round a few ulps below zero, so negatives are clamped to 0. An empty
    tensor (a model's 0-element buffer) holds nothing clients could disagree on: 0.
    """
    interval = _int_param("interval", interval, 1)
    numel = _int_param("numel", numel, 0)
    if isinstance(dispersion, bool) or not isinstance(dispersion, numbers.Real) or not math.isfinite(dispersion):
        raise ValueError(f"dispersion must be a finite number, got {dispersion!r}")
    return 0.0 if numel == 0 else max(float(dispersion), 0.0) / (interval * numel)


def is_relaxable(tensor: TensorSpec) -> bool:
    """Whether FedLAMA may give ``tensor`` the long interval: kernels (≥2-D), never biases, BN affine or buffers.

    This follows the official code, where only ``kernel`` variables are candidates (specs/fedlama.md §4.2.4).
    """
    return len(tensor.shape) >= 2 and tensor.role != "buffer"


# -- Algorithm 2 ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LamaTrace:
    """The intermediate quantities of Algorithm 2, for docs, tests and the dashboard.

    ``order`` is the ascending-d order (ties in input order); ``delta[l]`` and ``lam[l]`` are δ and λ
    after the first l+1 tensors of it; ``crossing`` is the 0-based position of the first tensor with
    δ > 1 − λ (None when the total discrepancy is zero, so nothing is relaxed).
    """

    order: tuple[str, ...]
    delta: tuple[float, ...]
    lam: tuple[float, ...]
    crossing: int | None

    @property
    def relaxed(self) -> tuple[str, ...]:
        """The least-critical tensors: the ascending prefix up to and including the crossing tensor."""
        return () if self.crossing is None else self.order[: self.crossing + 1]


def lama_trace(d: Mapping[str, float], dims: Mapping[str, int]) -> LamaTrace:
    """Sort, accumulate δ_l and λ_l, and find the crossing δ_l > 1 − λ_l (specs/fedlama.md §4.2 item 3).

    ``dims`` names the candidate tensors in tie-break (spec) order; ``d`` must hold a value for each.
    The comparison runs in exact rational arithmetic: with equal d, δ_l = λ_l exactly and a tie at
    λ_l = ½ must not flip with rounding (the rule is strict, so a tie does not cross).
    """
    names = list(dims)
    missing = [n for n in names if n not in d]
    if missing:
        raise ValueError(f"no discrepancy for {missing[:5]}")
    size = {n: _int_param(f"dim of {n!r}", dims[n], 1) for n in names}
    dval = {n: _check_d(n, d[n]) for n in names}
    order = tuple(sorted(names, key=lambda n: dval[n]))  # stable: ties keep spec order
    total_dim = sum(size.values())
    total_d = sum((Fraction(dval[n]) * size[n] for n in names), Fraction(0))
    delta: list[float] = []
    lam: list[float] = []
    crossing: int | None = None
    cum_d, cum_dim = Fraction(0), 0
    for i, n in enumerate(order):
        cum_d += Fraction(dval[n]) * size[n]
        cum_dim += size[n]
        delta.append(float(cum_d / total_d) if total_d else 0.0)
        lam.append(cum_dim / total_dim)
        # δ_l > 1 − λ_l  ⇔  cum_d · Λ > (Λ − cum_dim) · D, all exact
        if crossing is None and total_d and cum_d * total_dim > (total_dim - cum_dim) * total_d:
            crossing = i
    return LamaTrace(order, tuple(delta), tuple(lam), crossing)


def lama_adjust(d: Mapping[str, float], dims: Mapping[str, int], tau_base: int, phi: int) -> dict[str, int]:
    """Algorithm 2 with the crossing rule: the least-critical tensors get φτ', all others τ' (no memory).

    Returns an interval for every name in ``dims`` (the relaxable candidates); with all d zero, all keep τ'.
    """
    tau_base = _int_param("tau_base", tau_base, 1)
    phi = _int_param("phi", phi, 1)
    relaxed = set(lama_trace(d, dims).relaxed)
    return {n: phi * tau_base if n in relaxed else tau_base for n in dims}


# -- policies ------------------------------------------------------------------------------------


class IntervalPolicy(ABC):
    """Per-tensor intervals over a fixed, ordered set of full-rank tensors."""

    name: ClassVar[str]

    def __init__(self, tensors: Sequence[TensorSpec]) -> None:
        self.tensors: tuple[TensorSpec, ...] = tuple(tensors)
        names = [t.name for t in self.tensors]
        dupes = sorted(n for n, count in Counter(names).items() if count > 1)
        if dupes:
            raise ValueError(f"duplicate tensor names {dupes[:5]}")
        self.names: tuple[str, ...] = tuple(names)
        self._intervals: dict[str, int] = dict.fromkeys(names, 1)
        self.last_observed = 0  # last round passed to observe(); rounds are observed in increasing order

    # -- the verbs
    def interval(self, name: str) -> int:
        try:
            return self._intervals[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} has no interval under the {self.name!r} policy") from None

    def intervals(self) -> dict[str, int]:
        """Current intervals in spec order (a copy)."""
        return dict(self._intervals)

    def due(self, round: int) -> list[str]:
        """Tensors aggregated at the end of ``round`` (spec order): those whose interval divides it."""
        r = _check_round(round)
        return [n for n, tau in self._intervals.items() if r % tau == 0]

    @property
    @abstractmethod
    def sync_period(self) -> int:
        """Rounds after which every tensor has synced: the lcm of the intervals the policy can use."""

    @property
    def cohort_period(self) -> int:
        """Rounds a cohort is kept (from a round ``r`` with ``(r − 1) mod cohort_period = 0``): the sync period."""
        return self.sync_period

    #: saved parameters that change nothing here, ignored when a saved state is loaded
    unread_params: frozenset[str] = frozenset()

    @abstractmethod
    def params(self) -> dict[str, Any]:
        """Constructor parameters (JSON types), recorded in the state so a resume under other settings fails."""

    def observe(self, round: int, discrepancy: Mapping[str, float]) -> dict[str, int] | None:
        """Record d_l of the tensors aggregated at ``round``; returns the new intervals if it changed them.

        Called once per aggregated round, in increasing order, before ``due(round + 1)``; any change
        applies from the next round on.
        """
        r = _check_round(round)
        if r <= self.last_observed:
            raise ValueError(f"round {r} observed after round {self.last_observed}; rounds are observed in order")
        unknown = [n for n in discrepancy if n not in self._intervals]
        if unknown:
            raise ValueError(f"discrepancy for tensors not in this policy: {unknown[:5]}")
        d = {n: _check_d(n, v) for n, v in discrepancy.items()}
        changed = self._observe(r, d)
        self.last_observed = r
        return changed

    def _observe(self, round: int, d: dict[str, float]) -> dict[str, int] | None:
        return None

    # -- persistence
    def state_dict(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "format": STATE_FORMAT,
            "params": self.params(),
            "intervals": self.intervals(),
            "last_observed": self.last_observed,
            **self._extra_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a saved state; everything is checked before anything changes."""
        if state.get("policy") != self.name:
            raise ValueError(f"state belongs to policy {state.get('policy')!r}, not {self.name!r}")
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"unsupported interval state format {state.get('format')!r}")
        saved, mine = _json_normal(state.get("params")), _json_normal(self.params())
        if isinstance(saved, dict):  # a parameter this policy no longer reads is no part of it
            saved = {k: v for k, v in saved.items() if k not in self.unread_params}
        if saved != mine:
            raise ValueError(f"state was saved with {self.name} parameters {saved}, this policy has {mine}")
        raw = state.get("intervals")
        if not isinstance(raw, Mapping) or set(raw) != set(self.names):
            raise ValueError("saved intervals do not name exactly this policy's tensors")
        intervals = {n: _int_param(f"interval of {n!r}", raw[n], 1) for n in self.names}
        self._check_intervals(intervals)
        last = _int_param("last_observed", state.get("last_observed"), 0)
        extra = self._parse_extra_state(state)
        self._intervals = intervals
        self.last_observed = last
        self._load_extra_state(extra)

    def _check_intervals(self, intervals: dict[str, int]) -> None:
        if intervals != self._intervals:
            raise ValueError(f"saved intervals differ from the fixed intervals of the {self.name!r} policy")

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _parse_extra_state(self, state: Mapping[str, Any]) -> Any:
        return None

    def _load_extra_state(self, extra: Any) -> None:
        return None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({len(self.names)} tensors{', ' if args else ''}{args})"


class EveryRound(IntervalPolicy):
    """FedAvg: every tensor is aggregated every round."""

    name = "every_round"

    @property
    def sync_period(self) -> int:
        return 1

    def params(self) -> dict[str, Any]:
        return {}


class FixedSchedule(IntervalPolicy):
    """The decomposition paper's fast/slow protocol: slow roles every 1/β rounds, the rest every round.

    Default slow roles are the atom coefficients ("atom coefficients communicated every 1/β rounds,
    atoms every round"); coefficients are due at rounds 1/β, 2/β, … (see the module docstring).
    """

    name = "fixed"
    beta: float
    period: int
    slow_roles: tuple[str, ...]

    def __init__(
        self, tensors: Sequence[TensorSpec], beta: float, slow_roles: Iterable[str] = DEFAULT_SLOW_ROLES
    ) -> None:
        super().__init__(tensors)
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not math.isfinite(beta) or not 0 < beta <= 1:
            raise ValueError(f"beta must be in (0, 1], got {beta!r}")
        inverse = 1 / float(beta)
        period = round(inverse)
        if period < 1 or abs(inverse - period) > 1e-9:
            raise ValueError(f"1/beta must be a whole number of rounds, got beta={beta!r} (1/beta={inverse:g})")
        roles = (slow_roles,) if isinstance(slow_roles, str) else tuple(slow_roles)
        bad = [r for r in roles if r not in ROLES]
        if bad:
            raise ValueError(f"unknown slow roles {bad}; roles are {', '.join(ROLES)}")
        self.beta = float(beta)
        self.period = period
        self.slow_roles = roles
        self._intervals = {t.name: period if t.role in roles else 1 for t in self.tensors}

    @property
    def sync_period(self) -> int:
        return math.lcm(*self._intervals.values()) if self._intervals else 1

    def params(self) -> dict[str, Any]:
        return {"beta": self.beta, "slow_roles": list(self.slow_roles)}


#: How long FedLAMA keeps a cohort: "sync_period" (the paper: resampled every φτ' rounds, whatever the
#: intervals) or "while_relaxed" (kept for φτ' rounds only while some tensor has the long interval;
#: resampled every τ' rounds while every tensor syncs every τ', e.g. during the warm-up).
HOLD_COHORT = ("sync_period", "while_relaxed")
#: How ``warmup_rounds`` reads at φ other than 2: "periods" (the official code's 6 τ'-rounds are 3
#: adjustment periods at its φ = 2: the same 3 periods, ``warmup_rounds · φ / 2`` rounds, at any φ) or
#: "rounds" (``warmup_rounds`` rounds at any φ, the official code's rule).
LAMA_WARMUPS = ("periods", "rounds")


def warmup_for(warmup_rounds: int, phi: int, rule: str) -> int:
    """The rounds FedLAMA relaxes nothing in: ``warmup_rounds`` read by ``rule`` (:data:`LAMA_WARMUPS`)."""
    if rule not in LAMA_WARMUPS:
        raise ValueError(f"lama_warmup must be one of {', '.join(LAMA_WARMUPS)}, got {rule!r}")
    return warmup_rounds if rule == "rounds" else (warmup_rounds * phi + 1) // 2


#: Which tensors FedLAMA never relaxes beyond the kernels-only rule: "none" (the paper and its code) or
#: "head_and_first" (every tensor of the head and of the first layer with a kernel stay at τ').
PROTECT = ("none", "head_and_first")


def protected_modules(tensors: Sequence[TensorSpec], protect: str) -> frozenset[str]:
    """The modules ``protect`` keeps at τ': the head's and the first kernel's (``conv1`` for ``conv1.atoms``).

    Under label skew the head and the first layer are the most discrepant tensors and among the
    smallest, so relaxing them saves few bytes and lets each client drift towards its own classes;
    Algorithm 2 still relaxes them whenever their d_l happens to sit below the crossing (e.g. once
    local models fit their data and every d_l collapses together).
    """
    if protect not in PROTECT:
        raise ValueError(f"protect must be one of {', '.join(PROTECT)}, got {protect!r}")
    if protect == "none":
        return frozenset()
    out = {_module(t.name) for t in tensors if t.role == "head"}
    first = next((t for t in tensors if is_relaxable(t) and t.role != "head"), None)
    if first is not None:
        out.add(_module(first.name))
    return frozenset(out)


def _module(name: str) -> str:
    return name.rpartition(".")[0]


class FedLAMA(IntervalPolicy):
    """Layer-wise adaptive intervals: tensors whose d_l is small travel every φτ' rounds, the rest every τ'.

    d_l is stored whenever a tensor is aggregated; at rounds that are multiples of φτ' (every tensor has
    just synced, so all d_l are fresh) and past ``warmup_rounds``, intervals are re-decided from scratch.
    ``hold_cohort`` (:data:`HOLD_COHORT`) says whether a cohort is kept for φτ' rounds even while
    nothing is relaxed, ``None`` where no cohort is kept (a new one every round), so nothing reads it;
    the defaults are the paper's literal algorithm.
    """

    name = "fedlama"

    def __init__(
        self,
        tensors: Sequence[TensorSpec],
        tau_base: int = 1,
        phi: int = 2,
        warmup_rounds: int = 0,
        hold_cohort: str | None = "sync_period",
        protect: str = "none",
    ) -> None:
        super().__init__(tensors)
        self.tau_base = _int_param("tau_base", tau_base, 1)
        self.phi = _int_param("phi", phi, 1)
        self.warmup_rounds = _int_param("warmup_rounds", warmup_rounds, 0)
        if hold_cohort is not None and hold_cohort not in HOLD_COHORT:
            raise ValueError(f"hold_cohort must be one of {', '.join(HOLD_COHORT)}, got {hold_cohort!r}")
        self.hold_cohort = hold_cohort
        if hold_cohort is None:  # states saved when per-round cohorts still recorded it restore alike
            self.unread_params = frozenset({"hold_cohort"})
        self.protect = protect
        kept = protected_modules(self.tensors, protect)
        self.relaxable: tuple[str, ...] = tuple(
            t.name for t in self.tensors if is_relaxable(t) and _module(t.name) not in kept
        )
        self._dims = {t.name: t.numel for t in self.tensors}
        self._d: dict[str, float] = {}
        self._intervals = dict.fromkeys(self.names, self.tau_base)

    @property
    def sync_period(self) -> int:
        # The two intervals τ' and φτ' both divide φτ': FedLAMA's full-sync (and cohort) period.
        return self.phi * self.tau_base

    @property
    def cohort_period(self) -> int:
        """φτ' under ``sync_period``; under ``while_relaxed`` the lcm of the intervals in force.

        Intervals change only at multiples of φτ', so a cohort drawn at a round that follows an
        adjustment is kept exactly as long as its relaxed tensors continue locally.
        """
        if self.hold_cohort in ("sync_period", None):
            return self.sync_period
        return math.lcm(*self._intervals.values()) if self._intervals else self.tau_base

    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"tau_base": self.tau_base, "phi": self.phi, "warmup_rounds": self.warmup_rounds}
        # states saved before these switches existed resume unchanged under the paper's values
        if self.hold_cohort not in ("sync_period", None):
            params["hold_cohort"] = self.hold_cohort
        if self.protect != "none":
            params["protect"] = self.protect
        return params

    @property
    def observed(self) -> dict[str, float]:
        """Last measured d_l per tensor (tensors never aggregated have none)."""
        return dict(self._d)

    def proposed(self) -> dict[str, int]:
        """What Algorithm 2 decides from the stored d_l; relaxable tensors with no d_l yet stay at τ'."""
        candidates = [n for n in self.relaxable if n in self._d]
        out = dict.fromkeys(self.names, self.tau_base)
        out.update(
            lama_adjust(
                {n: self._d[n] for n in candidates}, {n: self._dims[n] for n in candidates}, self.tau_base, self.phi
            )
        )
        return out

    def _observe(self, round: int, d: dict[str, float]) -> dict[str, int] | None:
        due = set(self.due(round))  # the intervals in force during this round
        self._d.update({n: v for n, v in d.items() if n in due})
        if round % self.sync_period or round <= self.warmup_rounds:
            return None
        new = self.proposed()
        if new == self._intervals:
            return None
        self._intervals = new
        return dict(new)

    def _check_intervals(self, intervals: dict[str, int]) -> None:
        fixed = set(self.names) - set(self.relaxable)
        allowed = {self.tau_base, self.phi * self.tau_base}
        bad = [n for n, tau in intervals.items() if tau not in allowed or (n in fixed and tau != self.tau_base)]
        if bad:
            raise ValueError(f"saved intervals impossible under {self!r}: {bad[:5]}")

    def _extra_state(self) -> dict[str, Any]:
        return {"discrepancy": dict(self._d)}

    def _parse_extra_state(self, state: Mapping[str, Any]) -> dict[str, float]:
        raw = state.get("discrepancy")
        if not isinstance(raw, Mapping) or not set(raw) <= set(self.names):
            raise ValueError("saved discrepancies must map this policy's tensor names to numbers")
        return {n: _check_d(n, raw[n]) for n in self.names if n in raw}

    def _load_extra_state(self, extra: Any) -> None:
        self._d = dict(extra)


POLICIES: dict[str, type[IntervalPolicy]] = {cls.name: cls for cls in (EveryRound, FixedSchedule, FedLAMA)}


def build_policy(name: str, tensors: Sequence[TensorSpec], **params: Any) -> IntervalPolicy:
    """The policy called ``name`` over ``tensors``; unknown names or parameters raise a ValueError that says why."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown interval policy {name!r}; choose one of {', '.join(POLICIES)}")
    signature = inspect.signature(cls.__init__)
    accepted = [p for p in signature.parameters.values() if p.name not in ("self", "tensors")]
    unexpected = sorted(set(params) - {p.name for p in accepted})
    if unexpected:
        takes = ", ".join(p.name for p in accepted) or "no parameters"
        raise ValueError(f"interval policy {name!r} takes {takes}; got unexpected {', '.join(unexpected)}")
    missing = [p.name for p in accepted if p.default is inspect.Parameter.empty and p.name not in params]
    if missing:
        raise ValueError(f"interval policy {name!r} needs {', '.join(missing)}")
    return cls(tensors, **params)
