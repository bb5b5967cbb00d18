"""The federation's method, as one typed record shared by the simulator and the service.

Model, factorization, tiers, strategy, interval policy, cohort and the local training
hyper-parameters sent to clients: a simulation and a running aggregator read the same keys,
so a setting tried in simulation means the same thing in production.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from aggregator_service.database_url import DatabaseURL
from aggregator_service.environment import AGGREGATOR_SHARE, DASHBOARD_SHARE, Unread, unread
from aggregator_service.federation_name import FederationName
from aggregator_service.held_average import TIER_AVERAGES
from aggregator_service.intervals import HOLD_COHORT, POLICIES, PROTECT, SLOW_TENSORS, build_policy, warmup_for
from aggregator_service.listen import is_loopback, split_listen
from aggregator_service.refactorization import TIER_INITS
from aggregator_service.rounds import CohortSampler, Federation
from aggregator_service.strategies import FedProx, Setting, accepts, build_strategy, strategy_class
from aggregator_service.toml_settings import TomlSettings
from aggregator_service.update_bounds import UpdateBounds
from fedcore.data import benchmark_normalization
from fedcore.datasource import describe
from fedcore.model_input import Normalization
from fedcore.spec import ModelSpec, check_tiers_cut
from fedcore.tiers import TIERS
from fedcore.training import TrainConfig
from fedcore.training.nested import TIER_TRAININGS
from fedcore.training.personalization import SPLITS, personal_tensors

__all__ = [
    "DEMO_ENROLLMENT_SECRET",
    "AggregatorSettings",
    "FederationConfig",
    "StoreTarget",
    "inert_keys",
    "nested_rank_ratio_for",
    "parse_tiers",
    "recorded_normalization",
    "stored_spec",
    "unread_environment",
]

#: The default enrollment secret: for local demos only, never for a federation reachable by others.
DEMO_ENROLLMENT_SECRET = "fedatoms-demo"

#: The local training a federation asks of its clients unless configured otherwise. TrainConfig
#: declares these hyper-parameters, their checks and their defaults once; a federation departs
#: from them only in minibatches of 10, FedAvg's B = 10 (McMahan et al.).
FEDERATION_TRAINING = TrainConfig(batch_size=10)


#: Federation keys a strategy reads only if its ``__init__`` takes them: one set for a strategy that does not is
#: refused, not ignored (the clients would follow it while the server did not), with whose key it is.
_SETTABLE_KEYS = {
    "mu": "FedProx's",
    "global_lr": "SCAFFOLD's",
    "weighting": "how the server weighs updates",
    "temperature": "the tier-softmax weighting's",
    "keep_local_buffers": "what the server does with buffers",
    "bn_statistics": "how the server pools BatchNorm statistics",
}


@dataclass
class FederationConfig:
    """What a federation computes; every field is also a TOML key and a CLI flag."""

    #: A zoo name or an import reference "package.module:callable" returning an nn.Module.
    model: str = "digits-cnn"
    num_classes: int = 10
    factorization: str = "none"
    #: Atoms per k×k conv (m_a); unset: k², a complete basis (the papers' 9 for 3×3 convs).
    num_atoms: int | None = None
    #: Keyword arguments the model reference is called with ([federation.model_args]).
    model_args: dict[str, Any] = field(default_factory=dict)
    #: Module-name patterns (fnmatch) kept full rank at every tier; unset: the model's own, else its stem.
    full_rank: list[str] | None = None
    #: Unless full_rank or the model names them: the leading convs and linears whose weights hold together at
    #: most this share of the factorizable layers' keep full rank with the stem (narrow first layers); 0: the stem.
    full_rank_share: float = 1 / 16
    #: The classifier layer kept plain at every tier; unset: the last nn.Linear.
    head: str | None = None
    #: One input sample's shape, e.g. [3, 32, 32]; the zoo knows its own, a reference needs it.
    input_shape: list[int] | None = None
    #: The dtype the model takes: "float32" (images, features) or "int64"/"int32" (token ids for an nn.Embedding).
    input_dtype: str = "float32"
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
    #: a registry name (aggregator_service.strategies.STRATEGIES) or a user's "package.module:Class"
    strategy: str = "fedavg"
    #: keyword arguments of the strategy's class beyond the keys below, e.g. {"alpha": 0.01} for feddyn
    strategy_args: dict[str, Any] = field(default_factory=dict)
    mu: float = 0.01  # FedProx's μ
    global_lr: float = 1.0  # SCAFFOLD's η_g
    weighting: str = "samples"
    temperature: float = math.inf
    keep_local_buffers: bool = False
    #: BatchNorm statistics: "precise" (clients recompute them for their trained weights, the server pools
    #: the variance over their data) or "running" (PyTorch's running averages, averaged as they are)
    bn_statistics: str = FEDERATION_TRAINING.bn_statistics
    frobenius_decay: float = FEDERATION_TRAINING.frobenius_decay
    interval_policy: str = "every_round"
    beta: float = 0.2
    #: the fixed policy's slow tensors: "coefficients" (the paper's §4.2) or "all_but_atoms" (its §6.4: atoms
    #: every round, the whole model every 1/β rounds)
    slow_tensors: str = "coefficients"
    tau: int = 1
    phi: int = 2
    # FedLAMA: relax nothing before this round (the official code's first adjustment follows 6 τ' rounds;
    # 0 is the paper's Algorithm 1), and keep a cohort for φτ' rounds only while something is relaxed
    warmup_rounds: int = 6
    #: how warmup_rounds reads at other φ: "periods" (3 adjustment periods at any φ, as 6 rounds are at φ = 2)
    #: or "rounds" (warmup_rounds rounds at any φ, the official code)
    lama_warmup: str = "periods"
    hold_cohort: str = "while_relaxed"
    lama_protect: str = "head_and_first"
    personal_atoms: bool = False
    personal_epochs: int | None = FEDERATION_TRAINING.personal_epochs
    atom_lr: str = FEDERATION_TRAINING.atom_lr
    personalization: str = FEDERATION_TRAINING.personalization
    head_epochs: int = FEDERATION_TRAINING.head_epochs
    ditto_lambda: float = FEDERATION_TRAINING.ditto_lambda
    fp16: bool = False
    #: a tier's first factors: "energy" keeps the plain layer's output variance, "truncated" is FedHM's SVD cut
    tier_init: str = "energy"
    #: factorized entries averaged over the clients whose tier holds them ("held") or FedHM's eq. 1 ("aligned")
    tier_average: str = "held"
    #: mixed tiers: a larger tier trains the smallest tier's part of its model as that model ("nested"), or
    #: every tier its own model ("own", FedHM as printed)
    tier_training: str = "nested"
    seed: int = 0
    #: ``{mean = [..], std = [..]}`` per input channel for clients' images; unset: each client's own statistics.
    normalization: dict[str, list[float]] | None = None

    def __post_init__(self) -> None:
        self.tiers = parse_tiers(self.tiers)
        unknown = [t for t in self.tiers if t not in TIERS]
        if not self.tiers or unknown:
            raise ValueError(f"tiers must be among {', '.join(f'{t:g}' for t in TIERS)}, got {self.tiers}")
        if isinstance(self.temperature, str):
            self.temperature = float(self.temperature)
        if self.rounds < 1:
            raise ValueError("rounds must be ≥ 1")
        declared = self.model_args.get("num_classes") if isinstance(self.model_args, dict) else None
        if declared is not None and declared != self.num_classes:
            raise ValueError(
                f"model_args.num_classes = {declared!r} but num_classes = {self.num_classes}: the model's "
                "output and the federation's classes must agree, set both"
            )
        if self.personal_atoms and self.factorization not in ("atoms", "atoms-lowrank"):
            raise ValueError("--personal-atoms needs --factorization atoms or atoms-lowrank")
        low = [t for t in self.tiers if t < 1.0]
        if low and self.factorization not in ("lowrank", "atoms-lowrank"):
            raise ValueError(
                f"tiers below 1 need --factorization lowrank or atoms-lowrank; with {self.factorization!r} "
                "every tier would train the same full model"
            )
        if not isinstance(self.strategy_args, dict) or not all(isinstance(k, str) for k in self.strategy_args):
            raise ValueError(f"strategy_args must be a table of keyword arguments, got {self.strategy_args!r}")
        refusal = strategy_class(self.strategy).refuse(
            Setting(self.factorization, tuple(self.tiers), self.interval_policy, self.atom_lr)
        )
        if refusal is not None:
            raise ValueError(f"strategy {self.strategy!r} does not compose with this federation: {refusal}")
        self.strategy_params(num_clients_total=1)  # a key the strategy would ignore is refused here, at start
        if not math.isinf(self.temperature) and self.weighting != "tier-softmax":
            raise ValueError("--temperature only applies with --weighting tier-softmax")
        if self.slow_tensors not in SLOW_TENSORS:
            raise ValueError(f"slow_tensors must be one of {', '.join(SLOW_TENSORS)}, got {self.slow_tensors!r}")
        if self.lama_protect not in PROTECT:
            raise ValueError(f"lama_protect must be one of {', '.join(PROTECT)}, got {self.lama_protect!r}")
        if self.tier_init not in TIER_INITS:
            raise ValueError(f"tier_init must be one of {', '.join(TIER_INITS)}, got {self.tier_init!r}")
        if self.tier_average not in TIER_AVERAGES:
            raise ValueError(f"tier_average must be one of {', '.join(TIER_AVERAGES)}, got {self.tier_average!r}")
        if self.tier_training not in TIER_TRAININGS:
            raise ValueError(f"tier_training must be one of {', '.join(TIER_TRAININGS)}, got {self.tier_training!r}")
        warmup_for(self.warmup_rounds, self.phi, self.lama_warmup)  # an unknown rule fails now
        if self.interval_policy == "fedlama" and self.tau > 1 and self.cohort == "per_round":
            raise ValueError(
                f"tau = {self.tau} syncs every tensor only every {self.tau} rounds, and a new cohort each round "
                "(cohort = per_round) restarts from the global model: the rounds between syncs would train for "
                'nothing. Set cohort = "period" (FedLAMA\'s cohort, kept for the sync period) or tau = 1'
            )
        if self.hold_cohort not in HOLD_COHORT:
            raise ValueError(f"hold_cohort must be one of {', '.join(HOLD_COHORT)}, got {self.hold_cohort!r}")
        if self.interval_policy not in POLICIES:
            raise ValueError(f"unknown interval policy {self.interval_policy!r}; choose one of {', '.join(POLICIES)}")
        defaults = {f.name: f.default for f in fields(FederationConfig)}
        for key, why in inert_keys(self.interval_policy, self.tiers, self.cohort).items():
            if getattr(self, key) != defaults[key]:
                raise ValueError(f"{key} = {getattr(self, key)!r} would change nothing: {why}. Leave it unset")
        if self.interval_policy == "fixed" and self.factorization not in ("atoms", "atoms-lowrank"):
            raise ValueError(
                "the fixed policy delays atom coefficients: it needs --factorization atoms or atoms-lowrank"
            )
        for tier in self.tiers:  # model, classes, factorization, atoms and each tier's forward pass fail now
            self.spec.at_tier(tier).check_forward()
        check_tiers_cut(self.spec, self.tiers)  # a tier below 1 that cuts nothing would be the full model
        build_strategy(self.strategy, **self.strategy_params(num_clients_total=1))  # bad arguments fail now
        if self.normalization is not None and self.spec.integer_inputs:
            raise ValueError(
                f'normalization (mean/std per channel) applies to images; input_dtype = "{self.input_dtype}" inputs '
                "(token ids) are never normalized: leave normalization unset"
            )
        if self.normalization is not None:
            norm = Normalization.from_dict(self.normalization)
            channels = self.spec.input_shape[0]
            if len(norm.mean) != channels:
                raise ValueError(
                    f"normalization has {len(norm.mean)} channels but model {self.model!r} takes {channels}"
                )
            self.normalization = norm.to_dict()
        self._check_personalization()

    def record_benchmark_normalization(self, dataset: str) -> None:
        """Training and evaluation on a bundled benchmark see pixels its loader normalized: the federation records
        with what, so an exported model file carries it and ``fedatoms predict`` feeds raw images as training saw
        them. A different normalization would be ignored by that loader: it is refused."""
        own = recorded_normalization(dataset)
        if self.normalization is None:
            self.normalization = own
        elif Normalization.from_dict(self.normalization).to_dict() != own:
            raise ValueError(
                f"normalization {self.normalization} differs from {dataset}'s own, {own}, which its loader applies: "
                "leave normalization unset with a benchmark dataset"
            )

    def _check_personalization(self) -> None:
        """A personalization baseline composes with the method where the math allows; refused here otherwise."""
        self.train_config()  # the baseline's own hyper-parameters, checked where TrainConfig checks them
        method = self.personalization
        if method == "none":
            return
        if self.personal_atoms:
            raise ValueError(
                f"personal atoms are a personalization of their own: use personal_atoms or personalization "
                f"= {method!r}, not both"
            )
        personal_tensors(self.spec, method)  # a split needs a model with a head
        if method in SPLITS:
            strategy = build_strategy(self.strategy, **self.strategy_params(num_clients_total=1))
            state = sorted(set(strategy.client_config()) - {"prox_mu"})
            if state:
                raise ValueError(
                    f"personalization {method!r} keeps part of the model on each client, but strategy "
                    f"{self.strategy!r} carries client state over the whole model ({', '.join(state)}): "
                    "use it with fedavg, fedprox or a server-side strategy"
                )

    def to_dict(self) -> dict[str, Any]:
        """Every key, but the model keys left at their defaults (a zoo federation reads as it always did)."""
        d = asdict(self)
        if not d["strategy_args"]:
            del d["strategy_args"]  # records and stored configs of federations without any stay as they were
        d["temperature"] = "inf" if math.isinf(self.temperature) else self.temperature
        for key in _OPTIONAL_MODEL_KEYS:
            if not d[key]:
                del d[key]
        if d["input_dtype"] == "float32":
            del d["input_dtype"]  # stored configs of float models read as they always did
        return d

    @property
    def spec(self) -> ModelSpec:
        """The full-rank spec the server aggregates; tiers are ``spec.at_tier(γ)``."""
        return model_spec(self)

    def train_config(self, device: str = "auto") -> TrainConfig:
        """What clients train with: the training keys as set here, FedProx's ``mu`` only under FedProx (or a
        subclass, by name or reference), and with mixed tiers trained nested the smallest tier."""
        return replace(
            FEDERATION_TRAINING,
            **{name: getattr(self, name) for name in _TRAINING_KEYS},
            prox_mu=self.mu if issubclass(strategy_class(self.strategy), FedProx) else 0.0,
            nested_rank_ratio=self.nested_rank_ratio,
            device=device,
        )

    @property
    def nested_rank_ratio(self) -> float | None:
        """The smallest tier where mixed tiers train nested (``tier_training``), else ``None``."""
        return nested_rank_ratio_for(self.tiers, self.tier_training)

    def strategy_params(self, num_clients_total: int) -> dict[str, Any]:
        """The strategy's keyword arguments: the federation's own keys its ``__init__`` takes, then strategy_args."""
        offered: dict[str, Any] = {
            "weighting": self.weighting,
            "temperature": self.temperature,
            "keep_local_buffers": self.keep_local_buffers,
            "bn_statistics": self.bn_statistics,
            "num_clients_total": num_clients_total,
            "spec": self.spec,
            "mu": self.mu,
            "global_lr": self.global_lr,
            "fp16_transport": self.fp16,
        }
        clash = sorted(set(self.strategy_args) & set(offered))
        if clash:
            raise ValueError(f"strategy_args {clash} are set by the federation's own keys; set those instead")
        taken = accepts(strategy_class(self.strategy))
        # a key only some strategies take, set for one that does not, would be ignored without a word
        defaults = {f.name: f.default for f in fields(FederationConfig)}
        for key, whose in _SETTABLE_KEYS.items():
            if key not in taken and offered[key] != defaults[key]:
                shown = f"{offered[key]:g}" if isinstance(offered[key], float) else repr(offered[key])
                raise ValueError(
                    f"{key} = {shown} is not used by strategy {self.strategy!r}, whose __init__ takes no "
                    f"{key!r} ({whose}; leave it unset)"
                )
        return {**{k: v for k, v in offered.items() if k in taken}, **self.strategy_args}

    def policy_params(self) -> dict[str, Any]:
        if self.interval_policy == "fixed":
            return {"beta": self.beta, "slow_roles": SLOW_TENSORS[self.slow_tensors]}
        if self.interval_policy == "fedlama":
            return {
                "tau_base": self.tau,
                "phi": self.phi,
                "warmup_rounds": warmup_for(self.warmup_rounds, self.phi, self.lama_warmup),
                # a cohort kept for a period is FedLAMA's alone to time; a new one every round reads nothing of it
                "hold_cohort": self.hold_cohort if self.cohort == "period" else None,
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
            personal=personal_tensors(spec, self.personalization),
            tier_init=self.tier_init,
            tier_average=self.tier_average,
            nested_rank_ratio=self.nested_rank_ratio,
        )

    @property
    def personalized(self) -> bool:
        """Whether clients report a personalized accuracy (personal atoms or a baseline)."""
        return self.reports_personalized(self.to_dict())

    @staticmethod
    def reports_personalized(config: Mapping[str, Any]) -> bool:
        """:attr:`personalized` of a stored config (a federation row's JSON, older ones included)."""
        return bool(config.get("personal_atoms")) or config.get("personalization", "none") != "none"


#: Model keys a zoo federation leaves unset; to_dict leaves them out then, so stored configs still compare equal.
_OPTIONAL_MODEL_KEYS = ("model_args", "full_rank", "head", "input_shape")

#: FederationConfig's keys that are TrainConfig fields, passed to clients as they are.
_TRAINING_KEYS = tuple(f.name for f in fields(FederationConfig) if f.name in {g.name for g in fields(TrainConfig)})


def parse_tiers(tiers: Any) -> list[float]:
    """A tiers key as TOML, a flag (``"1,0.5"``) or ``--set tiers=0.125`` give it: a list of floats."""
    items = tiers.split(",") if isinstance(tiers, str) else [tiers] if isinstance(tiers, (int, float)) else tiers
    try:
        parsed = [float(t) for t in items if not isinstance(t, str) or t.strip()]
    except (TypeError, ValueError):
        raise ValueError(f"tiers must be numbers among {', '.join(f'{t:g}' for t in TIERS)}, got {tiers!r}") from None
    if not parsed:
        raise ValueError(f"tiers must name at least one of {', '.join(f'{t:g}' for t in TIERS)}, got {tiers!r}")
    return parsed


#: the keys only one interval policy reads
POLICY_KEYS: dict[str, tuple[str, ...]] = {
    "fixed": ("beta", "slow_tensors"),
    "fedlama": ("tau", "phi", "warmup_rounds", "lama_warmup", "hold_cohort", "lama_protect"),
}


def inert_keys(interval_policy: str, tiers: Sequence[float], cohort: str) -> dict[str, str]:
    """Method keys a federation with this policy and these tiers never reads → why. Set away from its default
    such a key would run without a word and change nothing, so a new config refuses it; a stored federation's
    value of one is no part of its method (:mod:`.coordinator.restore` ignores it)."""
    inert = {
        key: f"only the {policy} interval policy reads it, and interval_policy is {interval_policy!r}"
        for policy, keys in POLICY_KEYS.items()
        if policy != interval_policy
        for key in keys
    }
    if interval_policy == "fedlama" and cohort != "period":
        inert["hold_cohort"] = (
            f"it says how long FedLAMA keeps a cohort, and cohort is {cohort!r}: a new one every round"
        )
    if min(tiers) >= 1.0:
        inert["tier_init"] = "it cuts tiers below 1, and every tier is 1"
    if len(set(tiers)) == 1:
        single = f"it settles how mixed tiers train together, and every client is at tier {tiers[0]:g}"
        inert["tier_average"] = inert["tier_training"] = single
    return inert


def nested_rank_ratio_for(tiers: Sequence[float], tier_training: str) -> float | None:
    """The smallest of ``tiers`` where mixed tiers train nested (``tier_training = "nested"``), else ``None``:
    :attr:`FederationConfig.nested_rank_ratio`, and that of a stored config (:func:`stored_keys`)."""
    smallest = min(tiers)
    nested = tier_training == "nested" and smallest < 1.0 and max(tiers) > smallest
    return smallest if nested else None


def recorded_normalization(dataset: str) -> dict[str, list[float]]:
    """A bundled benchmark's normalization as a federation records it (``{"mean": [...], "std": [...]}``)."""
    mean, std = benchmark_normalization(dataset)
    return {"mean": list(mean), "std": list(std)}


def model_spec(config: Any) -> ModelSpec:
    """The full-rank spec of ``config``: a :class:`FederationConfig`, or any object with its model keys."""
    assert config.model is not None
    return ModelSpec(
        config.model,
        config.num_classes,
        config.factorization,
        config.num_atoms,
        model_args=config.model_args,
        full_rank=None if config.full_rank is None else tuple(config.full_rank),
        head=config.head,
        input_shape=None if config.input_shape is None else tuple(config.input_shape),
        full_rank_share=float(config.full_rank_share),
        input_dtype=str(getattr(config, "input_dtype", "float32")),
    )


#: method keys added after federations were stored, with the behaviour a federation stored without
#: one ran with: it keeps that behaviour across an upgrade instead of being refused or changed
KEYS_SINCE: dict[str, Any] = {
    "tier_init": "truncated",
    "tier_average": "aligned",
    "lama_warmup": "rounds",
    "tier_training": "own",
    "full_rank_share": 0.0,
    "slow_tensors": "coefficients",
}


def stored_keys(stored: Mapping[str, Any]) -> SimpleNamespace:
    """Every key of a federation config as the store keeps it, without re-checking them: a key it predates
    at the behaviour it ran with (:data:`KEYS_SINCE`), any other missing one at its default. A finished
    federation so stays exportable where its strategy's code is absent, or a newer release would refuse a
    key it once accepted."""
    keys = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(FederationConfig)}  # type: ignore[misc]
    keys.update(KEYS_SINCE)
    keys.update({k: v for k, v in stored.items() if k in keys})
    return SimpleNamespace(**keys)


def stored_spec(stored: Mapping[str, Any]) -> ModelSpec:
    """The model spec of a federation config as the store keeps it (:func:`stored_keys`)."""
    return model_spec(stored_keys(stored))


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
    database_url: DatabaseURL = "sqlite:///fedatoms.db"
    federation_name: FederationName = "default"
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
    #: Longest a GetTask long poll (``wait_seconds``) is held while its answer would be Wait; 0: never held.
    long_poll_seconds: float = Field(default=30.0, ge=0.0)
    #: Most GetTask calls held at once; each holds a server thread of its own, beyond the workers that
    #: serve every other call, and a call past this bound is answered at once.
    long_poll_waiters: int = Field(default=64, ge=1)
    #: PushUpdate calls received at once; more wait in line (at most half the server's workers), and one
    #: beyond that is answered UNAVAILABLE (clients retry). A push is received into a file in ``spool_dir``
    #: (memory: one 1 MiB chunk), so several slow uploads cost disk, not memory; several, not one: a device
    #: on a slow link holds its slot for the whole upload, and must not stall everyone else's.
    max_concurrent_pushes: int = Field(default=8, ge=1)
    #: Received pushes decoded, validated and stored at once (each holds about its update's bytes in
    #: memory meanwhile); the rest wait. Bounds the aggregator's memory whatever the cohort size.
    max_pushes_in_memory: int = Field(default=2, ge=1)
    #: Directory that received pushes are spooled to (files unlinked at once: nothing stays after a crash);
    #: unset: the system's temporary directory. Put it on disk: a tmpfs spool is memory again.
    spool_dir: Path | None = None
    #: Register calls served at once; as many more wait in line, and one beyond that is answered UNAVAILABLE
    #: (clients retry). Registration is rare, and a flood of them (wrong secrets included) must not take the
    #: threads that serve enrolled clients' heartbeats, task polls and pushes.
    max_concurrent_registrations: int = Field(default=2, ge=1)
    #: A caller (peer host) whose authentication failed more than a few times lately (wrong enrollment
    #: secret, unknown or revoked token) has each further refusal held this long before it is sent, so a
    #: flood of guesses waits instead of taking the CPU enrolled clients need; 0: refusals answered at once.
    refusal_delay_seconds: float = Field(default=1.0, ge=0.0, le=60.0)
    #: Most refusals held at once (each on a server thread of its own, beyond the workers); past it, answered at once.
    refusal_waiters: int = Field(default=128, ge=0)
    #: Largest PushUpdate payload accepted; unset: 2 × the full model's float32 bytes.
    max_push_bytes: int | None = Field(default=None, gt=0)
    #: Spool bytes kept of push streams that broke off, so each client's retry sends only the rest (the oldest
    #: dropped first; each resumable for ``kept_push_seconds``); unset: what ``max_concurrent_pushes`` pushes
    #: may spool at once; 0: nothing kept, a broken push is sent again whole.
    kept_push_bytes: int | None = Field(default=None, ge=0)
    #: How long a broken push stays resumable; past it, its spool file is let go of (within a second, even on
    #: an idle server). Long enough for a device on a bad link to come back; a day at most.
    kept_push_seconds: float = Field(default=3600.0, gt=0.0, le=86_400.0)
    #: Largest sample count a client may declare at Register; a push may claim no more than its client
    #: declared (or this, for a client that declared none), so no client weighs more than it said it would.
    max_client_samples: int = Field(default=10_000_000, gt=0)
    #: Largest magnitude of any value of an update aligned to full rank (U·Vᵀ for a low-rank tier); beyond: refused.
    max_update_value: float = Field(default=1e9, gt=0.0)
    #: Largest L2 distance ‖new − start‖₂ one update may move its client's model by (start: its tier's cut of the
    #: global model as the wire delivered it); unset: no norm bound (docs/trust.md).
    max_update_norm: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    #: What an update over max_update_norm gets: "reject" (INVALID_ARGUMENT at push) or "clip" (scaled to the bound).
    update_norm_mode: Literal["reject", "clip"] = "reject"
    #: How `aggregator serve` writes its log: "logfmt" (key=value lines) or "json" (one JSON object a line).
    log_format: Literal["logfmt", "json"] = "logfmt"
    #: Per-client and per-tensor history (transfers, evaluations, tensor metrics) kept for the rounds numbered
    #: within this many of the last closed one; older rounds keep their bytes, accuracies and evaluation
    #: counts, not their per-tensor intervals. Unset: everything is kept.
    history_rounds: int | None = Field(default=None, ge=1)
    #: Server-side test set evaluated after every round, named as a client's ``--data``: a bundled dataset
    #: ("digits"), an ImageFolder directory or an import reference; the test split of it is evaluated.
    #: Unset: no server evaluation.
    eval_data: str | None = None
    eval_data_dir: str | None = None
    federation: FederationConfig = Field(default_factory=FederationConfig)
    #: The ``[dashboard]`` table of a shared TOML file: `fedatoms dashboard serve` reads it, the aggregator does not.
    dashboard: dict[str, Any] | None = None

    @field_validator("federation", mode="before")
    @classmethod
    def _parse_structured_text(cls, value: Any) -> Any:
        """List and table keys given as text (``FEDATOMS_FEDERATION__TIERS='[1, 0.5]'`` or ``'1,0.5'``): pydantic
        passes an environment variable of a dataclass's field through as the string it is."""
        if not isinstance(value, Mapping):
            return value
        parsed = dict(value)
        for f in fields(FederationConfig):
            text, kind = parsed.get(f.name), str(f.type)
            if not isinstance(text, str) or not kind.startswith(("list", "dict")):
                continue
            try:
                parsed[f.name] = json.loads(text)
            except json.JSONDecodeError:
                if kind.startswith("list"):  # comma-separated, as the CLI flags take them
                    parsed[f.name] = [t.strip() for t in text.split(",") if t.strip()]
                else:
                    raise ValueError(f"{f.name}: {text!r} is not a JSON object") from None
        return parsed

    @field_validator("eval_data")
    @classmethod
    def _check_eval_data(cls, value: str | None) -> str | None:
        if value is not None:
            describe(value, "eval_data")  # a typo fails at start, not after the first round
        return value

    @field_validator("spool_dir")
    @classmethod
    def _check_spool_dir(cls, value: Path | None) -> Path | None:
        if value is not None and not (value.is_dir() and os.access(value, os.W_OK | os.X_OK)):
            why = "does not exist" if not value.exists() else "is not a directory this user can write"
            raise ValueError(f"spool_dir {str(value)!r} {why}: pushes are received into files there")
        return value

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        split_listen(value)
        return value

    @field_validator("enrollment_secret")
    @classmethod
    def _check_enrollment_secret(cls, value: str) -> str:
        if not value.strip():  # an env file's `FEDATOMS_ENROLLMENT_SECRET=` left empty: anyone could enroll
            raise ValueError("it is empty, and any device could enroll with it: set one (e.g. `openssl rand -hex 16`)")
        return value

    @model_validator(mode="after")
    def _record_eval_normalization(self) -> AggregatorSettings:
        if self.eval_data is not None and describe(self.eval_data, "eval_data") == "bundled":
            self.federation = copy.copy(self.federation)  # the caller's configuration stays as the caller made it
            self.federation.record_benchmark_normalization(self.eval_data)  # the server evaluates what clients see
        return self

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
    def update_bounds(self) -> UpdateBounds:
        return UpdateBounds(self.max_update_value, self.max_update_norm, self.update_norm_mode)

    @property
    def push_limit(self) -> int:
        """Bytes one PushUpdate may carry (``max_push_bytes`` or its default)."""
        if self.max_push_bytes is not None:
            return self.max_push_bytes
        return 2 * sum(t.numel * 4 for t in self.federation.spec.tensors)

    @property
    def kept_push_limit(self) -> int:
        """Spool bytes kept of broken pushes (``kept_push_bytes`` or its default)."""
        if self.kept_push_bytes is not None:
            return self.kept_push_bytes
        return self.max_concurrent_pushes * self.push_limit


class StoreTarget(TomlSettings):
    """Which federation in which database, from the same flags, variables and file as the aggregator's: all an
    operator's command on the store (export, revoke, rebind) reads, so a file written for serving elsewhere
    (another listen address, spool or certificate paths, a strategy plugin) works here unchanged."""

    model_config = SettingsConfigDict(env_prefix="FEDATOMS_", env_nested_delimiter="__", extra="ignore")

    database_url: DatabaseURL = AggregatorSettings.model_fields["database_url"].default
    federation_name: FederationName = AggregatorSettings.model_fields["federation_name"].default


def unread_environment() -> list[Unread]:
    """The aggregator's ``FEDATOMS_*`` variables that nothing reads (:mod:`aggregator_service.environment`):
    the aggregator's share is the prefix less the dashboard's."""
    return unread(AGGREGATOR_SHARE, AggregatorSettings, other_shares=(DASHBOARD_SHARE,))
