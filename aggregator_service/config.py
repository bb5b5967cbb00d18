"""The federation's method, as one typed record shared by the simulator and the service.

Model, factorization, tiers, strategy, interval policy, cohort and the local training
hyper-parameters sent to clients: a simulation and a running aggregator read the same keys,
so a setting tried in simulation means the same thing in production.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from aggregator_service.intervals import HOLD_COHORT, PROTECT, build_policy
from aggregator_service.listen import is_loopback, split_listen
from aggregator_service.rounds import CohortSampler, Federation
from aggregator_service.strategies import build_strategy
from aggregator_service.toml_settings import TomlSettings
from fedcore.spec import ModelSpec
from fedcore.tiers import TIERS
from fedcore.training import TrainConfig

__all__ = ["DEMO_ENROLLMENT_SECRET", "AggregatorSettings", "FederationConfig"]

#: The default enrollment secret: for local demos only, never for a federation reachable by others.
DEMO_ENROLLMENT_SECRET = "fedatoms-demo"

#: The local training a federation asks of its clients unless configured otherwise. TrainConfig
#: declares these hyper-parameters, their checks and their defaults once; a federation departs
#: from them only in minibatches of 10, FedAvg's B = 10 (McMahan et al.).
FEDERATION_TRAINING = TrainConfig(batch_size=10)


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
    # resample every round: with intervals above 1, unsynced tensors then restart from the global value
    # ("period" keeps the cohort for the sync period and continues them locally, FedLAMA's literal rule)
    cohort: str = "per_round"
    rounds: int = 20
    local_epochs: int = FEDERATION_TRAINING.local_epochs
    batch_size: int = FEDERATION_TRAINING.batch_size
    lr: float = FEDERATION_TRAINING.lr
    momentum: float = FEDERATION_TRAINING.momentum
    weight_decay: float = FEDERATION_TRAINING.weight_decay
    strategy: str = "fedavg"
    mu: float = 0.01
    global_lr: float = 1.0
    weighting: str = "samples"
    temperature: float = math.inf
    keep_local_buffers: bool = False
    frobenius_decay: float = FEDERATION_TRAINING.frobenius_decay
    interval_policy: str = "every_round"
    beta: float = 0.2
    tau: int = 1
    phi: int = 2
    # FedLAMA: relax nothing before this round (the official code's first adjustment follows 6 τ' rounds;
    # 0 is the paper's Algorithm 1), and keep a cohort for φτ' rounds only while something is relaxed
    warmup_rounds: int = 6
    hold_cohort: str = "while_relaxed"
    lama_protect: str = "head_and_first"
    personal_atoms: bool = False
    personal_epochs: int | None = FEDERATION_TRAINING.personal_epochs
    atom_lr: str = FEDERATION_TRAINING.atom_lr
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
        if self.strategy == "scaffold" and self.factorization.startswith("atoms") and self.atom_lr == "scaled":
            raise ValueError(
                "SCAFFOLD's control variates assume one learning rate for every parameter, and atom_lr = scaled "
                "gives atoms and coefficients their own: use atom_lr = shared with scaffold and atoms"
            )
        if not math.isinf(self.temperature) and self.weighting != "tier-softmax":
            raise ValueError("--temperature only applies with --weighting tier-softmax")
        if self.lama_protect not in PROTECT:
            raise ValueError(f"lama_protect must be one of {', '.join(PROTECT)}, got {self.lama_protect!r}")
        if self.hold_cohort not in HOLD_COHORT:
            raise ValueError(f"hold_cohort must be one of {', '.join(HOLD_COHORT)}, got {self.hold_cohort!r}")
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
        """What clients train with: the training keys as set here, FedProx's ``mu`` only under fedprox."""
        return replace(
            FEDERATION_TRAINING,
            **{name: getattr(self, name) for name in _TRAINING_KEYS},
            prox_mu=self.mu if self.strategy == "fedprox" else 0.0,
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
            return {
                "tau_base": self.tau,
                "phi": self.phi,
                "warmup_rounds": self.warmup_rounds,
                "hold_cohort": self.hold_cohort,
                "protect": self.lama_protect,
            }
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


#: FederationConfig's keys that are TrainConfig fields, passed to clients as they are.
_TRAINING_KEYS = tuple(f.name for f in fields(FederationConfig) if f.name in {g.name for g in fields(TrainConfig)})


# --------------------------------------------------------------------------- the aggregator service


class AggregatorSettings(TomlSettings):
    """How one aggregator process runs: where it listens, its database, security, round timing and the method.

    Sources, strongest first: explicit keyword arguments (CLI flags), ``FEDATOMS_*`` environment variables
    (nested with ``__``, e.g. ``FEDATOMS_FEDERATION__ROUNDS=50``), the TOML file given to :meth:`from_toml`
    (service keys at the top level, the method in a ``[federation]`` table), then the defaults, which run a
    demo federation on ``127.0.0.1:50051`` with ``sqlite:///fedatoms.db`` and nothing to configure.
    """

    model_config = SettingsConfigDict(env_prefix="FEDATOMS_", env_nested_delimiter="__", extra="forbid")

    listen: str = "127.0.0.1:50051"
    database_url: str = "sqlite:///fedatoms.db"
    federation_name: str = "default"
    #: Shared secret clients present to Register. The default is for local demos only: set your own.
    enrollment_secret: str = DEMO_ENROLLMENT_SECRET
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: CA bundle that signs client certificates; when set, clients must present one (mutual TLS).
    tls_client_ca: Path | None = None
    #: Serve without TLS on a non-loopback address. Unset: allowed only on loopback addresses.
    allow_insecure: bool | None = None
    #: Fraction of the cohort that must have reported for a round to close at its deadline.
    quorum: float = Field(default=0.5, gt=0.0, le=1.0)
    deadline_seconds: float = Field(default=300.0, gt=0.0)
    #: A client counts as online while its last call is fresher than this.
    heartbeat_timeout_seconds: float = Field(default=60.0, gt=0.0)
    #: The retry-after a waiting client is told; unset: min(5 s, heartbeat_timeout / 4). Simulations
    #: on one machine set it low so rounds follow each other without idle polling gaps.
    poll_interval_seconds: float | None = Field(default=None, gt=0.0)
    #: Largest PushUpdate payload accepted; unset: 2 × the full model's float32 bytes.
    max_push_bytes: int | None = Field(default=None, gt=0)
    #: Largest sample count a client may declare at Register; a push may claim no more than its client
    #: declared (or this, for a client that declared none), so no client weighs more than it said it would.
    max_client_samples: int = Field(default=10_000_000, gt=0)
    #: Server-side test set evaluated after every round (e.g. "digits"); unset: no server evaluation.
    eval_dataset: str | None = None
    eval_data_dir: str | None = None
    federation: FederationConfig = Field(default_factory=FederationConfig)
    #: The ``[dashboard]`` table of a shared TOML file: `fedatoms dashboard serve` reads it, the aggregator does not.
    dashboard: dict[str, Any] | None = None

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        split_listen(value)
        return value

    @model_validator(mode="after")
    def _check_security(self) -> AggregatorSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both (TLS) or neither (insecure)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key as well")
        if self.tls_cert is None and not is_loopback(self.listen) and self.allow_insecure is not True:
            raise ValueError(
                f"refusing to serve without TLS on {self.listen}, which is not a loopback address: bearer tokens "
                "would travel in clear text. Set tls_cert and tls_key (FEDATOMS_TLS_CERT / FEDATOMS_TLS_KEY), "
                "listen on 127.0.0.1, or set allow_insecure = true for a trusted network"
            )
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def push_limit(self) -> int:
        """Bytes one PushUpdate may carry (``max_push_bytes`` or its default)."""
        if self.max_push_bytes is not None:
            return self.max_push_bytes
        return 2 * sum(t.numel * 4 for t in self.federation.spec.tensors)
