"""Any plain CNN, factorized in place: the walker that turns a built ``nn.Module`` into a tier's model.

The walker visits the module tree and replaces, at the same path (so ``state_dict`` names and
order are unchanged apart from the new parameter names):

- every factorizable ``nn.Conv2d`` (square kernel > 1, ``groups == 1``, zero padding, integer
  padding) by an :class:`AtomConv2d`, a :class:`LowRankConv2d`, or an :class:`AtomConv2d` with
  low-rank coefficients, as :class:`Factorization` decides;
- every ``nn.Linear`` but the head by a :class:`LowRankLinear` at tiers γ < 1.

Depthwise and 1×1 convs, BatchNorm, attention, embeddings and the head stay plain tensors the
server averages. Which convs and linears keep full rank at low tiers is a rule, not a table:
FedHM keeps the first layers full rank, because they are narrow (their rank at a low tier is a
few channels) and the later layers hold most of the numbers. So by default the first factorizable
conv (the stem) does, and with ``full_rank_share`` the leading layers that together hold at most
that share of the factorizable weights do too; a model class may name its own layers in a
``fedatoms_full_rank`` attribute (module-name patterns, :mod:`fnmatch`), and the federation's
``full_rank`` patterns override both. A layer whose factors would not be smaller than itself
(FedHM's ``r = γ·c_out`` on a layer that widens) keeps full rank at that tier too.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn

from fedcore.layers import AtomConv2d, LowRankConv2d, LowRankLinear, rank_for

__all__ = [
    "FACTORIZATIONS",
    "FULL_RANK_ATTRIBUTE",
    "Factorization",
    "check_full_rank_share",
    "factorizable_conv",
    "factorize",
    "full_rank_layers",
    "head_name",
]

FACTORIZATIONS = ("none", "atoms", "lowrank", "atoms-lowrank")
#: A model class's own full-rank patterns (e.g. the zoo ResNet-18: FedHM Table 5's prefix).
FULL_RANK_ATTRIBUTE = "fedatoms_full_rank"


@dataclass(frozen=True)
class Factorization:
    """How every conv and body linear of a model is parameterized for one tier.

    - ``none``: plain layers.
    - ``atoms``: every ``k×k`` conv (``k > 1``) is an :class:`AtomConv2d`; 1×1 convs stay plain
      because a 1×1 atom is a scalar and adds nothing.
    - ``lowrank``: FedHM; for ``rank_ratio < 1`` every conv and body linear outside the
      full-rank layers becomes :class:`LowRankConv2d` / :class:`LowRankLinear`.
    - ``atoms-lowrank``: atoms everywhere, and outside the full-rank layers the coefficients are
      low-rank at ``rank_ratio``; body linears are low-rank as in ``lowrank``.

    ``num_atoms`` is ``m_a``, the atoms of every ``k×k`` conv; ``None`` gives each conv ``k²``, a
    complete basis, so its atoms and coefficients hold exactly the plain filters: the papers' 9 for a
    3×3 conv, and no rank-9 limit on a 5×5 one (docs/methods.md, "Why a conv gets as many atoms as its
    kernel has entries").

    The head and 1×1 convs are never factorized (FedHM's counts need exactly that).
    """

    kind: str = "none"
    num_atoms: int | None = None
    rank_ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in FACTORIZATIONS:
            raise ValueError(f"unknown factorization {self.kind!r}; choose one of {', '.join(FACTORIZATIONS)}")
        rank_for(self.rank_ratio, 1)  # validates the ratio
        if self.num_atoms is not None and self.num_atoms < 1:
            raise ValueError(f"num_atoms must be ≥ 1, got {self.num_atoms}")

    @property
    def low_rank(self) -> bool:
        return self.kind in ("lowrank", "atoms-lowrank") and self.rank_ratio < 1.0

    def atoms_for(self, kernel_size: int) -> int:
        """``m_a`` of a ``kernel_size`` conv: ``num_atoms``, or ``k²`` when it is ``None``."""
        return kernel_size * kernel_size if self.num_atoms is None else self.num_atoms

    def conv(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] = 0,
        bias: bool = True,
        keep_full_rank: bool = False,
        dilation: int | tuple[int, ...] = 1,
    ) -> nn.Module:
        """The layer this factorization makes of a ``kernel_size`` conv (a plain one when nothing applies)."""
        reduce = self.low_rank and not keep_full_rank
        if self.kind in ("atoms", "atoms-lowrank") and kernel_size > 1:
            num_atoms = self.atoms_for(kernel_size)
            rank = None
            if reduce:
                rank = min(rank_for(self.rank_ratio, out_channels), in_channels * num_atoms)
                if not _smaller(rank, out_channels, in_channels * num_atoms):
                    rank = None
            return AtomConv2d(
                in_channels,
                out_channels,
                kernel_size,
                num_atoms=num_atoms,
                stride=stride,
                padding=padding,
                dilation=dilation,
                bias=bias,
                rank=rank,
            )
        rank = min(rank_for(self.rank_ratio, out_channels), in_channels * kernel_size)
        k = kernel_size
        if self.kind == "lowrank" and reduce and k > 1 and _smaller(rank, out_channels * k, in_channels * k):
            return LowRankConv2d(
                in_channels,
                out_channels,
                kernel_size,
                rank,
                stride=stride,
                padding=padding,
                dilation=dilation,
                bias=bias,
            )
        # fmt: off
        return nn.Conv2d(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation, bias=bias  # type: ignore[arg-type]  # Conv2d takes any tuple
        )
        # fmt: on

    def linear(self, in_features: int, out_features: int, keep_full_rank: bool = False, bias: bool = True) -> nn.Module:
        rank = min(rank_for(self.rank_ratio, out_features), in_features)
        if self.low_rank and not keep_full_rank and _smaller(rank, out_features, in_features):
            return LowRankLinear(in_features, out_features, rank, bias=bias)
        return nn.Linear(in_features, out_features, bias=bias)


def _smaller(rank: int, rows: int, cols: int) -> bool:
    """Whether rank-``rank`` factors of a ``rows × cols`` matrix hold fewer numbers than the matrix.

    FedHM's ``r = γ·c_out`` can exceed that for a layer that widens (a 576 → 1024 linear at
    γ = ½ would grow by 40 %); such a layer stays full rank at that tier.
    """
    return rank * (rows + cols) < rows * cols


def factorizable_conv(module: nn.Module) -> bool:
    """A conv whose filters can be atoms × coefficients or FedHM factors exactly."""
    if type(module) is not nn.Conv2d:
        return False
    kh, kw = module.kernel_size
    return (
        kh == kw
        and kh > 1
        and module.groups == 1
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


def head_name(model: nn.Module, configured: str | None = None) -> str | None:
    """The classifier: ``configured`` when given (it must be an ``nn.Linear``), else the last ``nn.Linear``."""
    linears = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    if configured is not None:
        module = dict(model.named_modules()).get(configured)
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"head {configured!r} is not an nn.Linear of the model; its linears are {linears or 'none'}"
            )
        return configured
    return linears[-1] if linears else None


def check_full_rank_share(share: float) -> None:
    if not 0.0 <= share < 1.0:
        raise ValueError(f"full_rank_share must be in [0, 1), got {share}")


def full_rank_layers(
    model: nn.Module,
    patterns: Sequence[str] | None = None,
    share: float = 0.0,
    head: str | None = None,
) -> frozenset[str]:
    """Names of the convs and linears that keep full rank at every tier (FedHM's first layers).

    ``patterns`` (fnmatch, against module names) override the model class's own
    ``fedatoms_full_rank``, which overrides the default: the first factorizable conv, and the
    leading factorizable layers (in the order the model defines them, the head aside) whose
    weights hold together at most ``share`` of all theirs.
    """
    candidates = [  # a module reused at two paths answers to either
        name for name, m in model.named_modules(remove_duplicate=False) if factorizable_conv(m) or type(m) is nn.Linear
    ]
    if patterns is None:
        patterns = getattr(model, FULL_RANK_ATTRIBUTE, None)
    if patterns is None:
        check_full_rank_share(share)
        first = next((name for name, m in model.named_modules() if factorizable_conv(m)), None)
        return frozenset(() if first is None else {first}) | _leading_layers(model, share, head)
    if isinstance(patterns, str):
        raise ValueError(f"full-rank patterns are a list of module-name patterns, got the string {patterns!r}")
    chosen = frozenset(name for name in candidates if any(fnmatchcase(name, p) for p in patterns))
    unmatched = [p for p in patterns if not any(fnmatchcase(name, p) for name in candidates)]
    if unmatched:
        raise ValueError(
            f"full-rank patterns {unmatched} match no conv or linear of the model; "
            f"its factorizable layers start {candidates[:6]}"
        )
    return chosen


def factorize(
    model: nn.Module,
    factorization: Factorization,
    full_rank: Sequence[str] | None = None,
    head: str | None = None,
    full_rank_share: float = 0.0,
) -> nn.Module:
    """Replace ``model``'s convs and body linears in place by ``factorization``'s layers; returns ``model``.

    New layers are freshly initialized on the device the model's parameters are on; on the meta
    device they are made there and draw nothing. Values come later, from
    :func:`fedcore.factorize.load_from_plain` or from the server's tensors.
    """
    if factorization.kind == "none":
        return model
    head = head_name(model, head)
    keep = full_rank_layers(model, full_rank, full_rank_share, head)
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if name != head and (factorizable_conv(m) or (type(m) is nn.Linear and factorization.low_rank))
    ]
    replacements = []
    for name, old in targets:
        new = _replacement(old, factorization, keep_full_rank=name in keep)
        if new is not None:
            replacements.append((name, old, new))
    _refuse_untying(model, [name for name, _, _ in replacements], factorization)
    for name, old, new in replacements:
        for pname, p in new.named_parameters():  # a frozen layer stays frozen in its factors
            p.requires_grad_(old.bias.requires_grad if pname == "bias" else old.weight.requires_grad)
        device = next(old.parameters()).device
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, new.to(device=device, dtype=old.weight.dtype))
    return model


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter ``model`` holds at more than one path (tied weights, a reused module)."""
    paths: dict[int, list[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for pname, p in module.named_parameters(recurse=False):
            paths.setdefault(id(p), []).append(prefix + pname)
    return [names for names in paths.values() if len(names) > 1]


def _refuse_untying(model: nn.Module, replaced: Sequence[str], factorization: Factorization) -> None:
    """A layer about to get factors of its own must not share a parameter with another path: its new factors
    would untie it, and the exported plain model would keep one of the diverged copies (the last loaded)."""
    replaced_set = set(replaced)
    for names in tied_parameters(model):
        modules = {n.rpartition(".")[0] for n in names}
        if modules & replaced_set:
            layers = ", ".join(sorted(modules))
            whole = (
                f"keep them whole with full_rank = {sorted(modules)}, or " if factorization.kind == "lowrank" else ""
            )
            raise ValueError(
                f"{' and '.join(names)} are one tied parameter, and factorization {factorization.kind!r} would give "
                f"layers {layers} factors of their own, untying them: {whole}use factorization 'none'"
            )


def _replacement(old: nn.Module, f: Factorization, keep_full_rank: bool) -> nn.Module | None:
    device = old.weight.device
    # A meta layer's replacement is made on the meta device: its layers skip drawing values there (the
    # factorized layers' reset_parameters), where one made on the CPU and moved would draw them for nothing.
    with torch.device("meta") if device.type == "meta" else nullcontext():
        return _new_layer(old, f, keep_full_rank, device)  # type: ignore[arg-type]  # a parameter's device


def _new_layer(old: nn.Module, f: Factorization, keep_full_rank: bool, device: torch.device) -> nn.Module | None:
    if isinstance(old, nn.Linear):
        if keep_full_rank:
            return None
        return f.linear(old.in_features, old.out_features, bias=old.bias is not None).to(device)  # type: ignore[arg-type]  # a parameter's device
    assert isinstance(old, nn.Conv2d)
    new = f.conv(
        old.in_channels,
        old.out_channels,
        old.kernel_size[0],
        stride=old.stride,
        padding=old.padding,  # type: ignore[arg-type]  # factorizable_conv refused the string form
        bias=old.bias is not None,
        keep_full_rank=keep_full_rank,
        dilation=old.dilation,
    )
    if type(new) is nn.Conv2d:
        return None  # nothing to factorize at this tier: keep the original layer (and its values)
    return new.to(device)  # type: ignore[arg-type]  # a parameter's device


def _leading_layers(model: nn.Module, share: float, head: str | None) -> frozenset[str]:
    """The longest prefix of the factorizable layers whose weights hold at most ``share`` of all of theirs.

    Narrow first layers get a rank of a few channels at a low tier while saving few bytes: FedHM's
    reason for keeping its first layers full rank, as a rule any model's layer sizes decide.
    """
    head = head_name(model) if head is None else head
    sizes = [
        (name, m.weight.numel())
        for name, m in model.named_modules()
        if name != head and (factorizable_conv(m) or type(m) is nn.Linear)
    ]
    total = sum(n for _, n in sizes)
    kept: set[str] = set()
    held = 0
    for name, n in sizes:
        held += n
        if held > share * total:
            break
        kept.add(name)
    return frozenset(kept)
