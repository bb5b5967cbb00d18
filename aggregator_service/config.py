"""The federation's method, as one typed record shared by the simulator and the service.

Model, factorization, tiers, strategy, interval policy, cohort and the local training
hyper-parameters sent to clients: a simulation and a running aggregator read the same keys,
so a setting tried in simulation means the same thing in production.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from aggregator_service.aggregation import build_strategy
from aggregator_service.intervals import build_policy
from aggregator_service.rounds import CohortSampler, Federation
from fedcore.spec import ModelSpec
from fedcore.tiers import TIERS
from fedcore.training import TrainConfig

__all__ = ["FederationConfig"]


@dataclass
class FederationConfig:
    """What a federation computes; every field is also a TOML key and a CLI flag."""

    model: str = "digits-cnn"
    num_classes: int = 10
    factorization: str = "none"
    num_atoms: int = 9
    tiers: list[float] = field(default_factory=lambda: [1.0])
    fraction: float = 0.5
    min_clients: int = 1
    cohort: str = "period"
    rounds: int = 20
    local_epochs: int = 1
    batch_size: int = 10
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    strategy: str = "fedavg"
    mu: float = 0.01
    global_lr: float = 1.0
    weighting: str = "samples"
    temperature: float = math.inf
    keep_local_buffers: bool = False
    frobenius_decay: float = 0.0
    interval_policy: str = "every_round"
    beta: float = 0.2
    tau: int = 1
    phi: int = 2
    warmup_rounds: int = 0
    personal_atoms: bool = False
    personal_epochs: int | None = None
    fp16: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.tiers, str):
            self.tiers = [float(t) for t in self.tiers.split(",") if t.strip()]
        self.tiers = [float(t) for t in self.tiers]
        unknown = [t for t in self.tiers if t not in TIERS]
        if not self.tiers or unknown:
            raise ValueError(f"tiers must be among {', '.join(f'{t:g}' for t in TIERS)}, got {self.tiers}")
        if isinstance(self.temperature, str):
            self.temperature = float(self.temperature)
        if self.rounds < 1:
            raise ValueError("rounds must be ≥ 1")
        if self.personal_atoms and self.factorization not in ("atoms", "atoms-lowrank"):
            raise ValueError("--personal-atoms needs --factorization atoms or atoms-lowrank")
        low = [t for t in self.tiers if t < 1.0]
        if low and self.factorization not in ("lowrank", "atoms-lowrank"):
            raise ValueError(
                f"tiers below 1 need --factorization lowrank or atoms-lowrank; with {self.factorization!r} "
                "every tier would train the same full model"
            )
        if low and self.strategy == "scaffold":
            raise ValueError("SCAFFOLD's control variates live in full-rank space: use tiers = [1] with scaffold")
        if not math.isinf(self.temperature) and self.weighting != "tier-softmax":
            raise ValueError("--temperature only applies with --weighting tier-softmax")
        if self.interval_policy == "fixed" and self.factorization not in ("atoms", "atoms-lowrank"):
            raise ValueError(
                "the fixed policy delays atom coefficients: it needs --factorization atoms or atoms-lowrank"
            )
        self.spec  # noqa: B018  # validates model, classes, factorization and atoms now, not mid-run

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["temperature"] = "inf" if math.isinf(self.temperature) else self.temperature
        return d

    @property
    def spec(self) -> ModelSpec:
        """The full-rank spec the server aggregates; tiers are ``spec.at_tier(γ)``."""
        assert self.model is not None
        return ModelSpec(self.model, self.num_classes, self.factorization, self.num_atoms)

    def train_config(self, device: str = "auto") -> TrainConfig:
        return TrainConfig(
            local_epochs=self.local_epochs,
            batch_size=self.batch_size,
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            prox_mu=self.mu if self.strategy == "fedprox" else 0.0,
            frobenius_decay=self.frobenius_decay,
            personal_epochs=self.personal_epochs,
            device=device,
        )

    def strategy_params(self, num_clients_total: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "weighting": self.weighting,
            "temperature": self.temperature,
            "keep_local_buffers": self.keep_local_buffers,
        }
        if self.strategy == "fedprox":
            params["mu"] = self.mu
        if self.strategy == "scaffold":
            params.update(global_lr=self.global_lr, num_clients_total=num_clients_total, spec=self.spec)
        return params

    def policy_params(self) -> dict[str, Any]:
        if self.interval_policy == "fixed":
            return {"beta": self.beta}
        if self.interval_policy == "fedlama":
            return {"tau_base": self.tau, "phi": self.phi, "warmup_rounds": self.warmup_rounds}
        return {}

    def build_federation(self, num_clients_total: int) -> Federation:
        spec = self.spec
        return Federation(
            spec,
            build_strategy(self.strategy, **self.strategy_params(num_clients_total)),
            build_policy(self.interval_policy, spec.tensors, **self.policy_params()),
            CohortSampler(self.fraction, self.min_clients, self.cohort, self.seed),
            tiers=self.tiers,
            init_seed=self.seed,
            fp16=self.fp16,
        )
