"""ModelSpec: the contract between server and client about which tensors a tier holds.

A spec names the architecture, factorization and tier; from that alone both sides derive
the same ordered list of tensors (name, shape, dtype, role). It travels as JSON in the
``Register`` reply, is checked against every pushed tensor, and knows how to move a tier's
factors to the full-rank tensors the server aggregates (FedHM's shape alignment, eq. 1)
and back (truncated SVD with √Σ split, spectral initialization).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from functools import cache

import torch
from torch import Tensor, nn

from fedcore.factorize import load_from_plain
from fedcore.layers import (
    AtomConv2d,
    LowRankConv2d,
    LowRankLinear,
    coefficients_to_matrix,
    conv_weight_to_matrix,
    factors_to_matrix,
    matrix_to_coefficients,
    matrix_to_conv_weight,
    matrix_to_factors,
)
from fedcore.models import FACTORIZATIONS, Factorization, build_model, model_info

__all__ = [
    "FACTOR_ROLES",
    "ROLES",
    "ModelSpec",
    "TensorSpec",
    "count_macs",
    "factored_matrix",
    "tensor_roles",
]

ROLES = (
    "atoms",
    "coefficients",
    "coefficients_u",
    "coefficients_v",
    "lowrank_u",
    "lowrank_v",
    "head",
    "body",
    "buffer",
)
# A factor pair (…_u, …_v) rebuilds one full-rank tensor on the server.
FACTOR_ROLES = {
    "coefficients_u": "coefficients",
    "coefficients_v": "coefficients",
    "lowrank_u": "weight",
    "lowrank_v": "weight",
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a client of some tier holds; ``full_name`` is the full-rank tensor a factor rebuilds."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    full_name: str | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_roles(model: nn.Module) -> dict[str, str]:
    """Role of every ``state_dict`` entry, read from the layer type and parameter name."""
    roles: dict[str, str] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for pname, _ in module.named_parameters(recurse=False):
            if module_name == "head" or module_name.endswith(".head"):
                role = "head"
            elif isinstance(module, AtomConv2d | LowRankConv2d | LowRankLinear) and pname in ROLES:
                role = pname
            else:
                role = "body"
            roles[prefix + pname] = role
        for bname, _ in module.named_buffers(recurse=False):
            roles[prefix + bname] = "buffer"
    return roles


def _hook_macs(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor, total: list[int]) -> None:
    x = inputs[0]
    if isinstance(module, AtomConv2d | LowRankConv2d):
        total[0] += module.macs_per_sample(x.shape[-2], x.shape[-1])
    elif isinstance(module, LowRankLinear):
        total[0] += module.macs_per_sample()
    elif isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        per_out = (module.in_channels // module.groups) * kh * kw
        total[0] += per_out * output[0].numel()
    elif isinstance(module, nn.Linear):
        total[0] += module.in_features * module.out_features


def count_macs(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Multiply-accumulates of one sample's forward pass through convs and linears."""
    total = [0]
    leaf_types = (AtomConv2d, LowRankConv2d, LowRankLinear, nn.Conv2d, nn.Linear)
    handles = [
        m.register_forward_hook(lambda mod, i, o: _hook_macs(mod, i, o, total))
        for m in model.modules()
        if isinstance(m, leaf_types)
    ]
    try:
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        with torch.no_grad():
            model(torch.zeros(1, *input_shape, device=device))
        model.train(was_training)
    finally:
        for h in handles:
            h.remove()
    return total[0]


@cache
def _derive(model: str, num_classes: int, factorization: str, num_atoms: int, rank_ratio: float) -> tuple:
    torch_state = torch.random.get_rng_state()
    try:
        with torch.device("meta"):  # shapes only: no memory, no initialization cost
            net = build_model(model, num_classes, factorization, num_atoms, rank_ratio)
    finally:
        torch.random.set_rng_state(torch_state)  # deriving a spec must not disturb anyone's seed
    roles = tensor_roles(net)
    tensors = []
    for name, t in net.state_dict().items():
        role = roles[name]
        full_name = None
        if role in FACTOR_ROLES:
            full_name = f"{name.rpartition('.')[0]}.{FACTOR_ROLES[role]}"
        tensors.append(TensorSpec(name, tuple(t.shape), _dtype_name(t.dtype), role, full_name))
    params = sum(p.numel() for p in net.parameters())
    macs = count_macs(net, model_info(model).input_shape)
    return tuple(tensors), params, macs


@dataclass(frozen=True)
class ModelSpec:
    """Architecture + factorization + tier; everything else is derived, identically everywhere."""

    model: str
    num_classes: int
    factorization: str = "none"
    num_atoms: int = 9
    rank_ratio: float = 1.0

    def __post_init__(self) -> None:
        model_info(self.model)
        Factorization(self.factorization, self.num_atoms, self.rank_ratio)
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be ≥ 2, got {self.num_classes}")

    # -- derived facts
    def _derived(self) -> tuple:
        return _derive(self.model, self.num_classes, self.factorization, self.num_atoms, float(self.rank_ratio))

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return self._derived()[0]

    @property
    def num_parameters(self) -> int:
        return self._derived()[1]

    @property
    def macs(self) -> int:
        """Forward multiply-accumulates per sample."""
        return self._derived()[2]

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return model_info(self.model).input_shape

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.tensors)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def owners(self) -> dict[str, str]:
        """Tensor name → the full-rank tensor it belongs to (a factor pair: what it rebuilds); bytes count there."""
        return {t.name: t.full_name or t.name for t in self.tensors}

    def tensor(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"tensor {name!r} is not part of {self.describe()}")

    def describe(self) -> str:
        return f"{self.model}/{self.factorization}/γ={self.rank_ratio:g}"

    def at_tier(self, rank_ratio: float) -> ModelSpec:
        return replace(self, rank_ratio=rank_ratio)

    def full(self) -> ModelSpec:
        """The γ = 1 spec whose tensors the server keeps and aggregates."""
        return self.at_tier(1.0)

    def build(self) -> nn.Module:
        return build_model(self.model, self.num_classes, self.factorization, self.num_atoms, self.rank_ratio)

    def initial_model(self, seed: int) -> nn.Module:
        """Round 0's model: the plain model drawn from ``seed``, then factorized to this spec.

        Every factorization of the same seed therefore starts from the same effective filters
        (:mod:`fedcore.factorize`); the caller's random stream is left as it was.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            plain = build_model(self.model, self.num_classes, "none")
            if self.factorization == "none":
                return plain
            return load_from_plain(self.build(), plain)

    # -- JSON
    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "num_classes": self.num_classes,
            "factorization": self.factorization,
            "num_atoms": self.num_atoms,
            "rank_ratio": self.rank_ratio,
            "tensors": [{**asdict(t), "shape": list(t.shape)} for t in self.tensors],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping) -> ModelSpec:
        try:
            return cls._from_dict(data)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed ModelSpec: {exc}") from exc

    @classmethod
    def _from_dict(cls, data: Mapping) -> ModelSpec:
        unknown = set(data) - {"model", "num_classes", "factorization", "num_atoms", "rank_ratio", "tensors"}
        if unknown:
            raise ValueError(f"unknown ModelSpec fields: {', '.join(sorted(unknown))}")
        if data.get("factorization", "none") not in FACTORIZATIONS:
            raise ValueError(f"unknown factorization {data.get('factorization')!r}")
        spec = cls(
            str(data["model"]),
            int(data["num_classes"]),
            str(data.get("factorization", "none")),
            int(data.get("num_atoms", 9)),
            float(data.get("rank_ratio", 1.0)),
        )
        if "tensors" in data:
            sent = [TensorSpec(**{**t, "shape": tuple(t["shape"])}) for t in data["tensors"]]
            if sent != list(spec.tensors):
                raise ValueError(
                    f"ModelSpec tensors for {spec.describe()} differ from this fedcore's; "
                    "server and client run different versions"
                )
        return spec

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        return cls.from_dict(json.loads(text))

    # -- moving between a tier and full rank
    def to_full(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Align this tier's tensors to the full-rank names and shapes (FedHM eq. 1).

        Accepts a subset (the tensors due this round); a factor pair must come whole.
        """
        unknown = set(tensors) - set(self.names)
        if unknown:
            raise KeyError(f"tensors {sorted(unknown)} are not part of {self.describe()}")
        full = self.full()
        out: dict[str, Tensor] = {}
        for t in self.tensors:
            if t.name not in tensors:
                continue
            if t.full_name is None:
                out[t.name] = tensors[t.name]
                continue
            u_name = t.name[: -len("_v")] + "_u" if t.role.endswith("_v") else t.name
            v_name = u_name[: -len("_u")] + "_v"
            if u_name not in tensors or v_name not in tensors:
                missing = v_name if u_name in tensors else u_name
                raise KeyError(f"tensor {missing!r} must travel with its factor pair for {t.full_name!r}")
            if t.role.endswith("_u"):
                matrix = factors_to_matrix(tensors[u_name], tensors[v_name])
                out[t.full_name] = _from_matrix(matrix, full.tensor(t.full_name))
        return out

    def from_full(self, full_tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Factorize full-rank tensors into this tier's (truncated SVD, √Σ split)."""
        out: dict[str, Tensor] = {}
        for t in self.tensors:
            if t.full_name is None:
                out[t.name] = full_tensors[t.name]
            elif t.role.endswith("_u"):
                rank = t.shape[1]
                u, v = matrix_to_factors(factored_matrix(full_tensors[t.full_name]), rank)
                out[t.name] = u
                out[t.name[: -len("_u")] + "_v"] = v
        return {t.name: out[t.name] for t in self.tensors}


def factored_matrix(full: Tensor) -> Tensor:
    """The matrix a full-rank tensor is factorized as: unrolled conv weight, ``(o, i·m)`` coefficients, or itself."""
    if full.dim() == 4:
        return conv_weight_to_matrix(full)
    if full.dim() == 3:
        return coefficients_to_matrix(full)
    return full


def _from_matrix(matrix: Tensor, full: TensorSpec) -> Tensor:
    if len(full.shape) == 4:
        o, i, k, _ = full.shape
        return matrix_to_conv_weight(matrix, o, i, k)
    if len(full.shape) == 3:
        _, i, m = full.shape
        return matrix_to_coefficients(matrix, i, m)
    return matrix
