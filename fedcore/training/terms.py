"""The optional terms a method adds to plain SGD, each off unless its method asks for it.

FedProx's proximal term and FedHM's Frobenius decay are penalties on the loss. The
strategies that keep per-client state — SCAFFOLD's control variate ``c_i``, FedDyn's
gradient state ``∇L_k``, FedDC's drift ``h_i`` — are :class:`LocalTerms`, read from the
strategy's client config: :meth:`LocalTerms.begin` checks the state a client holds and turns
it into a constant gradient correction plus a proximal weight, and :meth:`RoundTerms.finish`
returns the state after the round (and SCAFFOLD's ``Δc_i``, the one part that travels).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedcore import codec
from fedcore.layers import AtomConv2d, LowRankConv2d, LowRankLinear, factors_to_matrix

__all__ = [
    "MOVE_GROUPS",
    "STATE_GROUPS",
    "LocalTerms",
    "RoundTerms",
    "combine",
    "control_on",
    "factor_pairs",
    "frobenius_penalty",
    "proximal_penalty",
    "scale_move",
    "step_weight",
]

#: Per-client state groups, each one tensor per trainable parameter, kept by the client between rounds.
STATE_GROUPS = ("control", "gradient", "drift")

#: The groups whose step is linear in the client's move ``y − x`` (FedDyn's ``−α(y − x)``, FedDC's ``y − x``).
#: SCAFFOLD's ``c_i`` moves by the ``Δc_i`` it pushes, which the server folds as sent.
MOVE_GROUPS = frozenset({"gradient", "drift"})


def scale_move(
    before: Mapping[str, Mapping[str, Tensor]], after: Mapping[str, Mapping[str, Tensor]], scale: float
) -> dict[str, dict[str, Tensor]]:
    """The state ``after`` a round whose move the server folded times ``scale`` (a clipped update): each move
    group's step ``after − before`` times ``scale`` (``before`` is zero where the client held none yet)."""
    out = {g: dict(values) for g, values in after.items()}
    for g in MOVE_GROUPS:
        if g in out:
            old = before.get(g, {})
            out[g] = {n: old[n] + scale * (t - old[n]) if n in old else scale * t for n, t in out[g].items()}
    return out


def factor_pairs(model: nn.Module) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """Every low-rank factor pair ``(U, V)`` the Frobenius decay acts on, named by module.

    ``lowrank_u``/``lowrank_v`` of FedHM's layers and ``coefficients_u``/``coefficients_v`` of
    low-rank :class:`AtomConv2d` (the ``α`` matrix a γ < 1 tier trains as factors).
    """
    pairs: list[tuple[str, nn.Parameter, nn.Parameter]] = []
    for name, module in model.named_modules():
        if isinstance(module, LowRankConv2d | LowRankLinear):
            pairs.append((name, module.lowrank_u, module.lowrank_v))
        elif isinstance(module, AtomConv2d) and module.rank is not None:
            pairs.append((name, module.coefficients_u, module.coefficients_v))
    return pairs


def frobenius_penalty(model: nn.Module, lam: float) -> Callable[[], Tensor | None]:
    """FedHM's FD: ``(λ/2)·‖U V‖_F²`` per trainable pair; its gradient is ``λ·UVVᵀ`` and ``λ·UᵀUV``."""
    pairs = [(u, v) for _, u, v in factor_pairs(model) if u.requires_grad and v.requires_grad]

    def penalty() -> Tensor | None:
        if not pairs:
            return None
        return (lam / 2) * sum(factors_to_matrix(u, v).pow(2).sum() for u, v in pairs)  # type: ignore[return-value]

    return penalty


def proximal_penalty(
    params: Mapping[str, nn.Parameter], start: Mapping[str, Tensor], mu: float
) -> Callable[[], Tensor]:
    """FedProx: ``(μ/2)·‖w − w_start‖²`` over every trainable parameter."""

    def penalty() -> Tensor:
        return (mu / 2) * sum((p - start[n]).pow(2).sum() for n, p in params.items())  # type: ignore[return-value]

    return penalty


def combine(*terms: Callable[[], Tensor | None] | None) -> Callable[[], Tensor | None] | None:
    """The sum of the active terms, or ``None`` when none is, so plain SGD builds no extra graph."""
    active = [t for t in terms if t is not None]
    if not active:
        return None

    def penalty() -> Tensor | None:
        total: Tensor | None = None
        for term in active:
            value = term()
            if value is not None:
                total = value if total is None else total + value
        return total

    return penalty


def control_on(
    name: str, control: Mapping[str, Tensor], params: Mapping[str, nn.Parameter], device: torch.device
) -> dict[str, Tensor]:
    """Validate per-parameter state (one finite tensor per trainable parameter) and move it to ``device``."""
    missing = set(params) - set(control)
    extra = set(control) - set(params)
    if missing or extra:
        raise ValueError(
            f"{name} must hold exactly the trainable parameters; "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}"
        )
    out = {}
    for key, p in params.items():
        if tuple(control[key].shape) != tuple(p.shape):
            raise ValueError(f"{name}[{key!r}] has shape {tuple(control[key].shape)}, expected {tuple(p.shape)}")
        if not bool(torch.isfinite(control[key]).all()):
            raise ValueError(f"{name}[{key!r}] holds non-finite values")
        out[key] = control[key].detach().to(device=device, dtype=p.dtype)
    return out


def step_weight(steps: int, lr: float, momentum: float) -> float:
    """How far ``steps`` SGD steps move a parameter per unit of constant gradient: SCAFFOLD's ``K·η``.

    Option II estimates a client's gradient as ``(x − y_i)/(K·η)``, which holds for plain SGD.
    With heavy-ball momentum ``β`` (restarted every round, as the local optimizer is) the
    gradient of step ``s`` of ``K`` moves the parameter by ``η·(1 − β^(K−s+1))/(1 − β)`` in all,
    so ``x − y_i = Σ_s w_s g_s`` with ``Σ_s w_s = η/(1 − β)·(K − β(1 − β^K)/(1 − β))``; dividing
    by that sum makes ``c_i⁺`` a weighted mean of the local gradients again. At ``β = 0`` it is
    ``K·η``; at the papers' ``β = 0.9`` and ``K = 20`` dividing by ``K·η`` instead overstates
    ``c_i⁺`` six-fold and SCAFFOLD diverges.
    """
    if momentum == 0.0:
        return steps * lr
    return lr / (1.0 - momentum) * (steps - momentum * (1.0 - momentum**steps) / (1.0 - momentum))


def _alpha(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{key} must be a finite number ≥ 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LocalTerms:
    """The client-side terms of a strategy, as its ``client_config()`` names them (all off by default).

    ``scaffold``: SCAFFOLD's correction ``c − c_i`` on every gradient and option II's
    ``c_i⁺ = c_i − c + (x − y_i)/(K·η)`` (Karimireddy et al.), state ``control``.
    ``feddyn_alpha`` (α > 0): FedDyn's ``−⟨∇L_k, θ⟩ + α/2‖θ − x‖²`` and ``∇L_k ← ∇L_k − α(y_k − x)``
    (Acar et al., Alg. 1), state ``gradient``.
    ``feddc_alpha`` (α ≥ 0, with ``scaffold``): FedDC's ``α/2‖θ + h_i − x‖²`` and ``h_i ← h_i + (y_i − x)``
    (Gao et al., Alg. 1), state ``drift``.
    ``fp16_transport``: the update and control delta travel as float16; the state moves by what the
    server receives (``ỹ − x̃``, the rounded delta), which is what the server adds to its mean.
    """

    control: bool = False
    feddyn_alpha: float = 0.0
    feddc_alpha: float | None = None
    fp16_transport: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LocalTerms:
        """The terms a strategy's client config asks for; keys other strategies use are ignored here."""
        control = config.get("scaffold", False)
        if not isinstance(control, bool):
            raise ValueError(f"scaffold must be true or false, got {control!r}")
        dyn = _alpha("feddyn_alpha", config.get("feddyn_alpha", 0.0))
        dc = config.get("feddc_alpha")
        dc = None if dc is None else _alpha("feddc_alpha", dc)
        if dc is not None and not control:
            raise ValueError("feddc_alpha needs scaffold: FedDC corrects gradients with control variates")
        if dc is not None and dyn > 0:
            raise ValueError("feddyn_alpha and feddc_alpha exclude each other")
        fp16 = config.get("fp16_transport", False)
        if not isinstance(fp16, bool):
            raise ValueError(f"fp16_transport must be true or false, got {fp16!r}")
        return cls(control, dyn, dc, fp16)

    @property
    def groups(self) -> tuple[str, ...]:
        """The per-client state groups these terms keep (a subset of :data:`STATE_GROUPS`)."""
        return (
            *(("control",) if self.control else ()),
            *(("gradient",) if self.feddyn_alpha > 0 else ()),
            *(("drift",) if self.feddc_alpha is not None else ()),
        )

    def begin(
        self,
        params: Mapping[str, nn.Parameter],
        server_control: Mapping[str, Tensor] | None,
        state: Mapping[str, Mapping[str, Tensor]] | None,
        device: torch.device,
    ) -> RoundTerms | None:
        """Check the client's state (zeros where it has none yet) and plan the round; ``None`` when no term is on."""
        state = state or {}
        unknown = set(state) - set(self.groups)
        if unknown:
            raise ValueError(f"client state {sorted(unknown)} is not kept by these terms ({', '.join(self.groups)})")
        if self.control and server_control is None:
            raise ValueError("SCAFFOLD's correction needs the server's control c")
        if not self.control and server_control is not None:
            raise ValueError("server_control given but no term uses it")
        if not self.groups:
            return None
        held = {
            g: control_on(f"client state {g!r}", state[g], params, device)
            if g in state
            else {n: torch.zeros_like(p) for n, p in params.items()}
            for g in self.groups
        }
        c = control_on("server_control", server_control, params, device) if server_control is not None else None
        return RoundTerms(self, {n: p.detach().clone() for n, p in params.items()}, held, c)


@dataclass
class RoundTerms:
    """One round's terms: the start ``x``, the client's state, and what SGD adds (:attr:`correction`, :attr:`alpha`)."""

    terms: LocalTerms
    start: dict[str, Tensor]
    state: dict[str, dict[str, Tensor]]
    server_control: dict[str, Tensor] | None

    @property
    def alpha(self) -> float:
        """The proximal weight around ``x`` (FedDyn's and FedDC's α/2‖θ − x‖²)."""
        return self.terms.feddyn_alpha if self.terms.feddc_alpha is None else self.terms.feddc_alpha

    @property
    def correction(self) -> dict[str, Tensor] | None:
        """The constant part of the gradient: ``c − c_i`` (SCAFFOLD, FedDC), ``−∇L_k`` (FedDyn), ``α·h_i`` (FedDC)."""
        parts: list[dict[str, Tensor]] = []
        if self.server_control is not None:
            c, ci = self.server_control, self.state["control"]
            parts.append({n: c[n] - ci[n] for n in self.start})
        if "gradient" in self.state:
            parts.append({n: -g for n, g in self.state["gradient"].items()})
        if "drift" in self.state and self.alpha > 0:
            parts.append({n: self.alpha * h for n, h in self.state["drift"].items()})
        if not parts:
            return None
        total = parts[0]
        for part in parts[1:]:
            total = {n: total[n] + part[n] for n in total}
        return total

    def finish(
        self, params: Mapping[str, nn.Parameter], steps: int, lr: float, momentum: float
    ) -> tuple[dict[str, dict[str, Tensor]], dict[str, Tensor] | None]:
        """The client's state after the round, and SCAFFOLD's ``Δc_i = c_i⁺ − c_i`` (what the server needs)."""
        new: dict[str, dict[str, Tensor]] = {}
        delta = None
        wire = functools.partial(codec.as_delivered, fp16=self.terms.fp16_transport)  # what the server will receive
        moved = {n: wire(p.detach()) - self.start[n] for n, p in params.items()}  # y − x
        if self.server_control is not None:
            scale = step_weight(steps, lr, momentum)
            c, ci = self.server_control, self.state["control"]
            delta = {n: wire(ci[n] - c[n] - moved[n] / scale - ci[n]) for n in moved}
            new["control"] = {n: ci[n] + delta[n] for n in moved}
        if "gradient" in self.state:
            alpha = self.terms.feddyn_alpha
            new["gradient"] = {n: g - alpha * moved[n] for n, g in self.state["gradient"].items()}
        if "drift" in self.state:
            new["drift"] = {n: h + moved[n] for n, h in self.state["drift"].items()}
        return new, delta
