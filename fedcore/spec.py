"""ModelSpec: the contract between server and client about which tensors a tier holds.

A spec names the architecture, factorization and tier; from that alone both sides derive
the same ordered list of tensors (name, shape, dtype, role). It travels as JSON in the
``Register`` reply, is checked against every pushed tensor, and knows how to move a tier's
factors to the full-rank tensors the server aggregates (FedHM's shape alignment, eq. 1)
and back (truncated SVD with √Σ split, spectral initialization).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from typing import Any

import torch
from torch import Tensor, nn

from fedcore.activations import saved_bytes_per_sample
from fedcore.convert import (
    FACTORIZATIONS,
    FULL_RANK_ATTRIBUTE,
    Factorization,
    check_full_rank_share,
    factorizable_conv,
    factorize,
    full_rank_layers,
    head_name,
)
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
from fedcore.macs import count_macs
from fedcore.models import MODELS
from fedcore.reference import build_reference, canonical, is_zoo

__all__ = [
    "FACTOR_ROLES",
    "INPUT_DTYPES",
    "ROLES",
    "ModelSpec",
    "TensorSpec",
    "check_tiers_cut",
    "count_macs",
    "factored_matrix",
    "pair_v",
    "probe_input",
    "tensor_from_matrix",
    "tensor_roles",
]

log = logging.getLogger(__name__)

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
#: The dtypes a model's input may have (``ModelSpec.input_dtype``): floats (images, features) or token ids.
INPUT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "int64": torch.int64, "int32": torch.int32}
_SPEC_KEYS = frozenset(
    {
        "model",
        "num_classes",
        "factorization",
        "num_atoms",
        "rank_ratio",
        "model_args",
        "full_rank",
        "full_rank_share",
        "head",
        "input_shape",
        "input_dtype",
        "tensors",
    }
)


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


def tensor_roles(model: nn.Module, head: str | None = None) -> dict[str, str]:
    """Role of every ``state_dict`` entry, read from the layer type and parameter name.

    The head is ``head`` when given, else the model's last plain ``nn.Linear`` (the classifier).
    """
    head = head_name(model, head)
    roles: dict[str, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):  # a module reused: every path
        prefix = f"{module_name}." if module_name else ""
        for pname, _ in module.named_parameters(recurse=False):
            if head is not None and module_name == head:
                role = "head"
            elif isinstance(module, AtomConv2d | LowRankConv2d | LowRankLinear) and pname in ROLES:
                role = pname
            else:
                role = "body"
            roles[prefix + pname] = role
        for bname, _ in module.named_buffers(recurse=False):
            roles[prefix + bname] = "buffer"
    return roles


def _args_json(args: Mapping[str, Any]) -> str:
    if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
        raise ValueError(f"model_args must be a table of keyword arguments, got {args!r}")
    try:
        return json.dumps(dict(args), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"model_args must hold JSON values (numbers, strings, booleans, lists, tables): {exc}"
        ) from None


def _meta_module(spec: ModelSpec) -> nn.Module:
    """The model with shapes only, built on the meta device: no memory, no initialization cost. A builder that
    computes with tensor values (torchvision's RegNets take ``.tolist()`` of a tensor) cannot run there; it
    is built on the CPU instead, moved, and factorized there, and what it raises there is the model's error."""
    net = _meta_build(spec)
    if net is not None:
        return net
    with torch.random.fork_rng(devices=[]):  # deriving a spec must not disturb anyone's seed
        return spec._factorize(spec.build_plain().to("meta"))


def _meta_build(spec: ModelSpec) -> nn.Module | None:
    """``spec.build()`` on the meta device, or ``None`` where the builder reads values the meta device does
    not hold (:func:`_meta_only`); the caller's random stream is left as it was."""
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                return spec.build()
        except ValueError as exc:
            if not _meta_only(exc):
                raise
    return None


def _meta_only(exc: BaseException) -> bool:
    """Whether ``exc`` came from a builder reading a value the meta device does not hold."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, NotImplementedError | RuntimeError) and "meta" in str(cause):
            return True
        cause = cause.__cause__
    return False


def _values_outside_state(net: nn.Module) -> str | None:
    """Why ``net`` (built on the meta device) holds values that its state dict does not carry, or ``None``."""
    for module_name, module in net.named_modules():
        where = module_name or type(net).__name__
        skipped = sorted(module._non_persistent_buffers_set & {n for n, b in module._buffers.items() if b is not None})
        if skipped:
            return f"{where} has buffers {skipped} registered with persistent=False (computed where it is built)"
        kept = _MODULE_REGISTRIES | (_RNN_KEPT if isinstance(module, nn.RNNBase) else frozenset())
        held = sorted(n for n, v in vars(module).items() if n not in kept and _holds_tensor(v))
        if held:
            return f"{where} holds tensors in plain attributes {held} (neither parameters nor buffers)"
    return None


#: the registries nn.Module keeps its parameters, buffers and submodules in: the state dict covers them
_MODULE_REGISTRIES = frozenset({"_parameters", "_buffers", "_modules"})
#: an RNN's list of its own weights, which ``RNNBase.__setattr__`` keeps in step as :func:`_allocate` sets them
_RNN_KEPT = frozenset({"_flat_weights"})


def _holds_tensor(value: Any, depth: int = 4) -> bool:
    """Whether ``value`` is a tensor or holds one in a list, tuple, set or dict (``depth`` levels down)."""
    if isinstance(value, Tensor):
        return True
    if depth == 0:
        return False
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, list | tuple | set | frozenset):
        return False
    return any(_holds_tensor(v, depth - 1) for v in value)


#: each spec's way to :meth:`ModelSpec.build_loaded`: ``None`` for the meta build, else why it is built whole
_BUILD_RULE: dict[ModelSpec, str | None] = {}


def _whole_build_reason(spec: ModelSpec, net: nn.Module | None) -> str | None:
    """Why ``spec`` must be built whole (``net`` is its meta build, ``None`` where that failed), decided once
    per spec and logged when it is; ``None`` where the meta build serves."""
    if spec not in _BUILD_RULE:
        reason = "its builder computes with tensor values" if net is None else _values_outside_state(net)
        _BUILD_RULE[spec] = reason
        if reason is not None:
            log.info(
                "model %s is built whole on the CPU before its tensors are loaded, not on the meta device: %s",
                spec.describe(),
                reason,
            )
    return _BUILD_RULE[spec]


def _check_covers(spec: ModelSpec, state: Mapping[str, Tensor], net: nn.Module) -> None:
    """Refuse a state lacking any of ``net``'s parameters or persistent buffers: they would keep no value."""
    missing = [name for name in net.state_dict() if name not in state]
    if missing:
        raise ValueError(
            f"the tensors to load into {spec.describe()} lack {len(missing)} of its parameters and buffers "
            f"({', '.join(missing[:5])}{', …' if len(missing) > 5 else ''}): they would hold no value"
        )


def _allocate(net: nn.Module, device: torch.device) -> None:
    """Give each meta parameter and buffer of ``net`` an empty tensor on ``device``; a tensor held at two places
    (tied weights) gets one. ``Module.to_empty`` would untie them, and its first call on meta tensors imports
    sympy (half a second and 30 MB, more than a small tier's model)."""
    made: dict[int, tuple[Tensor, Tensor]] = {}  # id → (meta tensor, kept alive so no id is reused; its new one)
    for module in net.modules():
        for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(p) not in made:
                made[id(p)] = (p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad))
            setattr(module, name, made[id(p)][1])
        for name, b in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if id(b) not in made:
                made[id(b)] = (b, torch.empty(b.shape, dtype=b.dtype, device=device))
            setattr(module, name, made[id(b)][1])


@cache
def _derive(spec: ModelSpec) -> tuple:
    """The tensors and parameter count: read off the module, no forward pass."""
    net = _meta_module(spec)
    roles = tensor_roles(net, spec.head)
    tensors = []
    for name, t in net.state_dict().items():
        role = roles[name]
        full_name = None
        if role in FACTOR_ROLES:
            full_name = f"{name.rpartition('.')[0]}.{FACTOR_ROLES[role]}"
        tensors.append(TensorSpec(name, tuple(t.shape), _dtype_name(t.dtype), role, full_name))
    params = sum(p.numel() for p in net.parameters())
    if spec.factorization == "atoms" and not any(t.role == "atoms" for t in tensors):
        raise ValueError(
            f"factorization 'atoms' finds no conv of model {spec.model!r} to decompose (atoms need an nn.Conv2d "
            "with a square kernel > 1, groups = 1 and zero padding): the federation would be plain FedAvg; "
            "use factorization 'none'"
        )
    if not any(t.role in FACTOR_ROLES or t.role in ("atoms", "coefficients") for t in tensors):
        _refuse_nothing_to_factorize(spec, net)  # tier 1 of lowrank holds no factors: any layer at a lower one?
    return tuple(tensors), params


_LOW_RANK_KINDS = ("lowrank", "atoms-lowrank")


def _refuse_nothing_to_factorize(spec: ModelSpec, net: nn.Module) -> None:
    """``lowrank`` and ``atoms-lowrank`` on a model (still plain: nothing was replaced) none of whose layers they
    would factorize at any tier: named with why each was passed over, since the federation would be plain FedAvg
    under a factorization's name (and its tiers below 1 would train the full model)."""
    if spec.factorization not in _LOW_RANK_KINDS:
        return
    head = head_name(net, spec.head)
    keep = full_rank_layers(net, spec.full_rank, spec.full_rank_share, head)
    if spec.full_rank is not None:
        kept = f"kept full rank by full_rank {list(spec.full_rank)}"
    elif getattr(net, FULL_RANK_ATTRIBUTE, None) is not None:
        kept = f"kept full rank by the model's {FULL_RANK_ATTRIBUTE}"
    else:
        kept = f"kept full rank as the stem or by full_rank_share {spec.full_rank_share:g}"
    looked = []
    for name, m in net.named_modules():
        if name == head:
            looked.append(f"{name} (the head, kept whole)")
        elif factorizable_conv(m) or type(m) is nn.Linear:
            if name not in keep:
                return  # a layer the tiers below 1 factorize
            looked.append(f"{name} ({kept})")
        elif isinstance(m, nn.modules.conv._ConvNd):
            looked.append(
                f"{name} (a {type(m).__name__}: only an nn.Conv2d with a square kernel > 1, groups = 1 "
                "and zero padding is factorized)"
            )
    layers = "; ".join(looked[:8]) + ("; …" if len(looked) > 8 else "") if looked else "no conv or linear"
    raise ValueError(
        f"factorization {spec.factorization!r} finds nothing of model {spec.model!r} to factorize at any tier "
        f"(it factors nn.Conv2d and body nn.Linear layers; recurrent, embedding, attention and norm layers stay "
        f"whole): it looked at {layers}. The federation would be plain FedAvg and every tier the full model; "
        "use factorization 'none'"
    )


def check_tiers_cut(spec: ModelSpec, tiers: Sequence[float]) -> None:
    """A federation's factorization must factorize something (:func:`_derive`), and its tiers below 1 must cut
    some tensor: where every layer's factors at rank γ·c_out would be no smaller than the
    layer, each such tier silently trains the full model (and its bytes are FedAvg's)."""
    full = [(t.name, t.shape) for t in spec.tensors]  # a factorization with nothing to factorize is refused here
    low = sorted({t for t in tiers if t < 1.0}, reverse=True)
    if not low or spec.factorization not in _LOW_RANK_KINDS:
        return
    if all([(t.name, t.shape) for t in spec.at_tier(tier).tensors] == full for tier in low):
        raise ValueError(
            f"tiers {', '.join(f'{t:g}' for t in low)} cut no tensor of model {spec.model!r} under factorization "
            f"{spec.factorization!r}: its factorizable layers' factors at those ranks would be no smaller than the "
            "layers, so every tier would train the full model; use tiers = [1] (and factorization 'none' if "
            "nothing else is factorized)"
        )


@cache
def _forward_facts(spec: ModelSpec) -> int:
    """The forward pass's facts: it gives ``num_classes`` logits (raises otherwise) and its MACs per sample.

    Apart from :func:`_derive` because the first forward pass on the meta device costs a process about a
    second (PyTorch imports its compiler for the meta kernels of elementwise ops), which a process that
    reads only the shapes (the dashboard, an export, a prediction) should not pay.
    """
    net = _meta_module(spec)
    _check_outputs(spec, net)
    return count_macs(net, spec.input_shape, spec.torch_input_dtype)  # type: ignore[arg-type]  # __post_init__ set input_shape


@cache
def _activation_facts(spec: ModelSpec) -> tuple[int, int]:
    """``(bytes per sample, bytes per batch)`` a training step of the tier's model saves for backward
    (:func:`fedcore.activations.saved_bytes_per_sample`), on the meta device like the MACs."""
    net = _meta_module(spec)
    _check_outputs(spec, net)  # a model that cannot take its input fails here with the shape tried
    return saved_bytes_per_sample(net, spec.input_shape, spec.torch_input_dtype)  # type: ignore[arg-type]  # as above


def probe_input(spec: ModelSpec, batch: int, device: str | torch.device = "meta") -> Tensor:
    """A batch of ``batch`` zero samples as the model takes them: ``input_shape`` in ``input_dtype`` (token
    id 0 for an integer model), what every probe of the model (outputs, MACs, saved bytes) feeds it."""
    return torch.zeros(batch, *spec.input_shape, dtype=spec.torch_input_dtype, device=device)  # type: ignore[misc]  # __post_init__ set input_shape


def _check_outputs(spec: ModelSpec, net: nn.Module) -> None:
    """A forward pass of ``input_shape`` (in ``input_dtype``) must give ``num_classes`` logits, in training mode
    as in evaluation mode (some models return auxiliary outputs only while training), or training would fail
    mid-round."""
    for mode in ("eval", "train"):
        net.train(mode == "train")
        try:
            with torch.no_grad():  # two samples: train-mode BatchNorm cannot normalize one
                out = net(probe_input(spec, 2))
        except Exception as exc:  # any failure of a user's forward is reported with the shape tried
            hint = (
                ' (token ids for an nn.Embedding: input_dtype = "int64" in a federation file\'s [federation], '
                "--input-dtype int64 for simulate)"
                if spec.input_dtype == "float32" and _wants_integers(exc)
                else ""
            )
            raise ValueError(
                f"model {spec.model!r} cannot take inputs of shape {list(spec.input_shape)} ({spec.input_dtype}) "  # type: ignore[arg-type]  # as above
                f"in {mode} mode: {exc}{hint}"
            ) from exc
        if not isinstance(out, Tensor):
            raise ValueError(
                f"model {spec.model!r} returns {type(out).__name__} in {mode} mode, not a tensor of class scores: "
                "fedatoms trains on the logits alone (torchvision's GoogLeNet and Inception: aux_logits=False "
                "in the model's arguments)"
            )
        if tuple(out.shape) != (2, spec.num_classes):
            raise ValueError(
                f"model {spec.model!r} gives outputs of shape {list(out.shape[1:])} per sample, not "
                f"{spec.num_classes} class scores: pass num_classes in the model's arguments (model_args: "
                "[federation.model_args] of a federation file, --model-args of simulate)"
            )
    net.eval()


def _wants_integers(exc: BaseException) -> bool:
    """Whether a forward pass failed for want of integer inputs (an ``nn.Embedding`` given floats)."""
    text = str(exc)
    return "Long" in text and ("indices" in text or "Int" in text)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture + factorization + tier; everything else is derived, identically everywhere.

    ``model`` is a zoo name or an import reference ``"package.module:callable"`` called with
    ``model_args``; ``full_rank`` (module-name patterns) and ``head`` override the walker's
    rules (:mod:`fedcore.convert`), and ``full_rank_share`` is its rule for the leading layers kept
    full rank (0, the stem only, is what a spec written without the key meant); ``input_shape`` is
    one sample's ``(C, H, W)`` (the zoo knows its own; a reference needs it) and ``input_dtype`` the
    dtype the model takes (:data:`INPUT_DTYPES`: ``float32`` for images and features, ``int64`` or ``int32``
    for token ids an ``nn.Embedding`` looks up).
    """

    model: str
    num_classes: int
    factorization: str = "none"
    num_atoms: int | None = None  # m_a of every k×k conv; None: k² (fedcore.convert.Factorization)
    rank_ratio: float = 1.0
    model_args: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    full_rank: tuple[str, ...] | None = None
    head: str | None = None
    input_shape: tuple[int, ...] | None = None
    full_rank_share: float = 0.0
    input_dtype: str = "float32"
    _args: str = field(default="{}", init=False, repr=False)

    def __post_init__(self) -> None:
        canonical(self.model)  # a zoo name or a well-formed reference; nothing is imported here
        Factorization(self.factorization, self.num_atoms, self.rank_ratio)
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be ≥ 2, got {self.num_classes}")
        object.__setattr__(self, "_args", _args_json(self.model_args))
        object.__setattr__(self, "model_args", json.loads(self._args))
        if self.full_rank is not None:
            if isinstance(self.full_rank, str) or not all(isinstance(p, str) for p in self.full_rank):
                raise ValueError(f"full_rank must be a list of module-name patterns, got {self.full_rank!r}")
            object.__setattr__(self, "full_rank", tuple(self.full_rank))
        check_full_rank_share(self.full_rank_share)
        zoo_shape = MODELS[self.model].input_shape if is_zoo(self.model) else None
        shape = self.input_shape if self.input_shape is not None else zoo_shape
        if shape is None:
            raise ValueError(
                f"model {self.model!r} needs the shape of one input sample (channels, height, width): "
                "input_shape = [3, 32, 32] in a federation file's [federation], --input-shape 3,32,32 for simulate"
            )
        shape = tuple(int(d) for d in shape)
        if len(shape) < 1 or any(d < 1 for d in shape):
            raise ValueError(f"input_shape must be positive sizes like [3, 32, 32], got {list(shape)}")
        if zoo_shape is not None and shape != zoo_shape:
            raise ValueError(f"zoo model {self.model!r} takes inputs {list(zoo_shape)}, not {list(shape)}")
        object.__setattr__(self, "input_shape", shape)
        if self.input_dtype not in INPUT_DTYPES:
            raise ValueError(f"input_dtype must be one of {', '.join(INPUT_DTYPES)}, got {self.input_dtype!r}")
        if zoo_shape is not None and self.input_dtype != "float32":
            raise ValueError(f"zoo model {self.model!r} takes float32 inputs (images), not {self.input_dtype}")

    @property
    def torch_input_dtype(self) -> torch.dtype:
        """``input_dtype`` as a torch dtype."""
        return INPUT_DTYPES[self.input_dtype]

    @property
    def integer_inputs(self) -> bool:
        """Whether the model takes integer inputs (token ids), not floating-point ones."""
        return not self.torch_input_dtype.is_floating_point

    # -- derived facts
    def _derived(self) -> tuple:
        return _derive(self)

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return self._derived()[0]

    @property
    def num_parameters(self) -> int:
        return self._derived()[1]

    @property
    def macs(self) -> int:
        """Forward multiply-accumulates per sample (:func:`fedcore.macs.count_macs` of the tier's module)."""
        return _forward_facts(self)

    @property
    def activation_bytes(self) -> tuple[int, int]:
        """``(bytes per sample, bytes per batch)`` of the tensors a training step saves for backward, the
        parameters left out (:mod:`fedcore.activations`); a batch of ``b`` keeps ``b × per sample + per batch``."""
        return _activation_facts(self)

    def check_forward(self) -> None:
        """Raise ``ValueError`` unless the model takes ``input_shape`` and gives ``num_classes`` logits: where a
        federation accepts its model, so a wrong one fails there and not mid-round."""
        _forward_facts(self)

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.tensors)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def owners(self) -> dict[str, str]:
        """Tensor name → the full-rank tensor it belongs to (a factor pair: what it rebuilds); bytes count there."""
        return {t.name: t.full_name or t.name for t in self.tensors}

    @property
    def pair_ranks(self) -> dict[str, int]:
        """Full-rank name → this tier's rank, for each tensor this tier trains as a factor pair."""
        return {t.full_name: t.shape[1] for t in self.tensors if t.full_name is not None and t.role.endswith("_u")}

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

    def unfactorized(self) -> ModelSpec:
        """The same model with factorization ``none``: the tensors plain FedAvg would move."""
        return replace(self, factorization="none", rank_ratio=1.0)

    def build_plain(self) -> nn.Module:
        """The model as its code defines it, before any factorization (PyTorch's default initialization)."""
        if is_zoo(self.model):
            info = MODELS[self.model]
            if "num_classes" in self.model_args:
                raise ValueError(f"zoo model {self.model!r} takes num_classes from the federation, not model_args")
            return info.builder(self.num_classes, **self.model_args)
        return build_reference(self.model, self.model_args)

    def _factorize(self, plain: nn.Module) -> nn.Module:
        f = Factorization(self.factorization, self.num_atoms, self.rank_ratio)
        return factorize(plain, f, self.full_rank, self.head, self.full_rank_share)

    def build(self) -> nn.Module:
        return self._factorize(self.build_plain())

    def build_loaded(self, state: Mapping[str, Tensor], device: str | torch.device = "cpu") -> nn.Module:
        """The model holding ``state``, on ``device``: :meth:`build` then ``load_state_dict(state)``, computing the
        same function, without that build's cost where the state overwrites everything it would draw.

        The model is built on the meta device (shapes only: no plain model, no initialization, no factor
        drawn), its empty tensors are then allocated on ``device`` and ``state`` copied in, so a device pays
        for its tier's model alone. ``state`` must hold every parameter and persistent buffer (``ValueError``
        otherwise, never a model computing with uninitialized memory). A model that holds values its state
        does not carry keeps :meth:`build`'s way, on the CPU: a buffer registered with ``persistent=False`` (a
        positional table or anchors computed in ``__init__``), a tensor held in a plain attribute (or a list or
        dict of them), or a builder that computes with tensor values and so cannot run on the meta device
        (:func:`_meta_module`). That rule is decided and logged once per spec; only the meta module is built anew.
        """
        decided_whole = _BUILD_RULE.get(self) is not None
        net = None if decided_whole else _meta_build(self)
        if net is not None and _whole_build_reason(self, net) is None:
            _check_covers(self, state, net)
            _allocate(net, torch.device(device))
            net.load_state_dict(state)
            return net
        _whole_build_reason(self, net)  # logs the rule the first time
        model = self.build()
        _check_covers(self, state, model)
        model.load_state_dict(state)
        return model.to(device)

    def initial_model(self, seed: int) -> nn.Module:
        """Round 0's model: the plain model drawn from ``seed``, then factorized to this spec.

        Every factorization of the same seed therefore starts from the same effective filters
        (:mod:`fedcore.factorize`); the caller's random stream is left as it was.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            plain = self.build_plain()
            if self.factorization == "none":
                return plain
            return load_from_plain(self._factorize(copy.deepcopy(plain)), plain)

    # -- JSON
    def to_dict(self) -> dict:
        """The spec as JSON data; keys at their defaults are left out (a zoo spec reads as it always did)."""
        data: dict[str, Any] = {
            "model": self.model,
            "num_classes": self.num_classes,
            "factorization": self.factorization,
            "num_atoms": self.num_atoms,
            "rank_ratio": self.rank_ratio,
        }
        if self.model_args:
            data["model_args"] = self.model_args
        if self.full_rank is not None:
            data["full_rank"] = list(self.full_rank)
        if self.full_rank_share:
            data["full_rank_share"] = self.full_rank_share
        if self.head is not None:
            data["head"] = self.head
        if not is_zoo(self.model):
            data["input_shape"] = list(self.input_shape or ())
        if self.input_dtype != "float32":
            data["input_dtype"] = self.input_dtype
        data["tensors"] = [{**asdict(t), "shape": list(t.shape)} for t in self.tensors]
        return data

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
        unknown = set(data) - _SPEC_KEYS
        if unknown:
            raise ValueError(f"unknown ModelSpec fields: {', '.join(sorted(unknown))}")
        if data.get("factorization", "none") not in FACTORIZATIONS:
            raise ValueError(f"unknown factorization {data.get('factorization')!r}")
        full_rank = data.get("full_rank")
        spec = cls(
            str(data["model"]),
            int(data["num_classes"]),
            str(data.get("factorization", "none")),
            None if data.get("num_atoms") is None else int(data["num_atoms"]),
            float(data.get("rank_ratio", 1.0)),
            model_args=data.get("model_args", {}),
            full_rank=None if full_rank is None else _patterns(full_rank),
            head=data.get("head"),
            input_shape=None if data.get("input_shape") is None else tuple(data["input_shape"]),
            full_rank_share=float(data.get("full_rank_share", 0.0)),
            input_dtype=str(data.get("input_dtype", "float32")),
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
            v_name = pair_v(u_name)
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
                out[pair_v(t.name)] = v
        return {t.name: out[t.name] for t in self.tensors}


def _patterns(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(p, str) for p in value):
        raise ValueError(f"full_rank must be a list of module-name patterns, got {value!r}")
    return tuple(value)


def pair_v(u_name: str) -> str:
    """The name of the ``V`` factor that pairs with the ``U`` factor ``u_name`` (``x_u`` → ``x_v``)."""
    return u_name[: -len("_u")] + "_v"


def factored_matrix(full: Tensor) -> Tensor:
    """The matrix a full-rank tensor is factorized as: unrolled conv weight, ``(o, i·m)`` coefficients, or itself."""
    if full.dim() == 4:
        return conv_weight_to_matrix(full)
    if full.dim() == 3:
        return coefficients_to_matrix(full)
    return full


def _from_matrix(matrix: Tensor, full: TensorSpec) -> Tensor:
    return tensor_from_matrix(matrix, full.shape)


def tensor_from_matrix(matrix: Tensor, shape: Sequence[int]) -> Tensor:
    """The inverse of :func:`factored_matrix` for a full-rank tensor of ``shape``."""
    if len(shape) == 4:
        o, i, k, _ = shape
        return matrix_to_conv_weight(matrix, o, i, k)
    if len(shape) == 3:
        _, i, m = shape
        return matrix_to_coefficients(matrix, i, m)
    return matrix
