"""Factorized layers: filter atoms × coefficients (DCF) and FedHM low-rank factors.

Every parameter is named after the role the aggregator reads from it (``atoms``,
``coefficients``, ``coefficients_u``/``coefficients_v``, ``lowrank_u``/``lowrank_v``),
so a layer's ``state_dict`` keys are the tensor names that travel on the wire.

The pure functions at the bottom are what the server uses to move between a tier's
factors and the full-rank tensors it aggregates; the layers call the same functions,
so client and server cannot disagree on a reshape.
"""

from __future__ import annotations

import math
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedcore.spectral import thin_svd

__all__ = [
    "AtomConv2d",
    "LowRankConv2d",
    "LowRankLinear",
    "atoms_from_filters",
    "coefficients_to_matrix",
    "conv_weight_to_matrix",
    "factors_to_matrix",
    "matrix_to_coefficients",
    "matrix_to_conv_weight",
    "matrix_to_factors",
    "orthonormal_atoms",
    "rank_for",
    "reconstruct_filter",
]


IntOrPair = int | tuple[int, ...]


def _pair(v: IntOrPair) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[-1]))


def _square_kernel(kernel_size: IntOrPair) -> int:
    kh, kw = _pair(kernel_size)
    if kh != kw:
        raise ValueError(f"only square kernels are factorized, got {kh}x{kw}")
    return kh


def _check_convertible(conv: nn.Conv2d) -> None:
    if conv.groups != 1:
        raise ValueError("grouped convolutions cannot be factorized")
    if conv.padding_mode != "zeros":
        raise ValueError(f"padding_mode {conv.padding_mode!r} is not supported; only zero padding is exact")
    if isinstance(conv.padding, str):
        raise ValueError(f"string padding {conv.padding!r} is not supported; give explicit integer padding")


def rank_for(rank_ratio: float, out_features: int) -> int:
    """FedHM's rank rule ``r = max(1, round(γ·c_out))`` (specs/fedhm.md §1.3)."""
    if not 0.0 < rank_ratio <= 1.0:
        raise ValueError(f"rank_ratio must be in (0, 1], got {rank_ratio}")
    return max(1, round(rank_ratio * out_features))


# --------------------------------------------------------------------------- pure functions


def reconstruct_filter(coefficients: Tensor, atoms: Tensor) -> Tensor:
    """``W = α × D``: coefficients ``(o, i, m)`` and atoms ``(m, k, k)`` → filters ``(o, i, k, k)``."""
    return torch.einsum("oiq,qxy->oixy", coefficients, atoms)


def factors_to_matrix(u: Tensor, v: Tensor) -> Tensor:
    """``U Vᵀ`` with ``u (a, r)`` and ``v (r, b)`` (v is stored already transposed)."""
    return u @ v


def matrix_to_factors(matrix: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Truncated SVD at ``rank`` with ``√Σ`` split into both factors (FedHM's spectral init).

    Returns ``u (a, rank)`` and ``v (rank, b)`` with ``u @ v`` the best rank-``rank``
    approximation of ``matrix`` (Eckart–Young). Computed in float64 for stability and cast
    back to the input dtype.
    """
    if matrix.dim() != 2:
        raise ValueError(f"expected a matrix, got shape {tuple(matrix.shape)}")
    if not 1 <= rank <= min(matrix.shape):
        raise ValueError(f"rank {rank} outside [1, {min(matrix.shape)}] for shape {tuple(matrix.shape)}")
    u_, s, vh = thin_svd(matrix)
    root = s[:rank].sqrt()
    u = u_[:, :rank] * root
    v = root[:, None] * vh[:rank]
    return u.to(matrix.dtype), v.to(matrix.dtype)


def conv_weight_to_matrix(weight: Tensor) -> Tensor:
    """Unroll a conv weight ``(o, i, k, k)`` to FedHM's ``(o·k, i·k)`` matrix (rows (o, kh), cols (i, kw))."""
    o, i, kh, kw = weight.shape
    return weight.permute(0, 2, 1, 3).reshape(o * kh, i * kw)


def matrix_to_conv_weight(matrix: Tensor, out_channels: int, in_channels: int, kernel_size: int) -> Tensor:
    """Inverse of :func:`conv_weight_to_matrix`."""
    k = kernel_size
    return matrix.reshape(out_channels, k, in_channels, k).permute(0, 2, 1, 3).contiguous()


def coefficients_to_matrix(coefficients: Tensor) -> Tensor:
    """View coefficients ``(o, i, m)`` as the ``(o, i·m)`` matrix that low-rank tiers factorize."""
    o, i, m = coefficients.shape
    return coefficients.reshape(o, i * m)


def matrix_to_coefficients(matrix: Tensor, in_channels: int, num_atoms: int) -> Tensor:
    return matrix.reshape(matrix.shape[0], in_channels, num_atoms)


def orthonormal_atoms(num_atoms: int, kernel_size: int, generator: torch.Generator | None = None) -> Tensor:
    """Atoms that are orthonormal in ``R^{k²}`` when ``num_atoms ≤ k²``; unit-norm Gaussian beyond that."""
    k2 = kernel_size * kernel_size
    g = torch.randn(max(num_atoms, k2), k2, generator=generator, dtype=torch.float64)
    if num_atoms <= k2:
        q, _ = torch.linalg.qr(g[:k2].T)  # (k2, k2) orthonormal columns
        atoms = q[:, :num_atoms].T
    else:
        atoms = g[:num_atoms] / g[:num_atoms].norm(dim=1, keepdim=True)
    return atoms.reshape(num_atoms, kernel_size, kernel_size).to(torch.get_default_dtype())


def atoms_from_filters(weight: Tensor, num_atoms: int) -> tuple[Tensor, Tensor]:
    """Fit ``(coefficients, atoms)`` to conv filters by SVD of the stacked ``k×k`` filters.

    Atoms are the top right singular vectors of the ``(o·i, k²)`` stack and coefficients the
    projections onto them, so the fit is exact when ``num_atoms ≥ k²``. Atoms beyond ``k²``
    cannot add directions; they get zero coefficients and random unit-norm values.
    """
    o, i, k, _ = weight.shape
    k2 = k * k
    stack = weight.detach().to(torch.float64).reshape(o * i, k2)
    # right singular vectors from the k²×k² Gram matrix: a full basis even when o·i < k², and no
    # (o·i)² left factor for wide layers
    eigenvalues, eigenvectors = torch.linalg.eigh(stack.T @ stack)
    vh = eigenvectors[:, eigenvalues.argsort(descending=True)].T  # (k2, k2), rows by decreasing energy
    used = min(num_atoms, k2)
    atoms = torch.zeros(num_atoms, k2, dtype=torch.float64)
    atoms[:used] = vh[:used]
    if num_atoms > k2:
        extra = torch.randn(num_atoms - k2, k2, dtype=torch.float64)
        atoms[k2:] = extra / extra.norm(dim=1, keepdim=True)
    coefficients = torch.zeros(o * i, num_atoms, dtype=torch.float64)
    coefficients[:, :used] = stack @ vh[:used].T
    return (
        coefficients.reshape(o, i, num_atoms).to(weight.dtype),
        atoms.reshape(num_atoms, k, k).to(weight.dtype),
    )


def _init_factor_pair(u: Tensor, v: Tensor, target_variance: float) -> None:
    """Gaussian factors whose product ``u @ v`` has entries of ``target_variance``.

    Entries of ``u v`` have variance ``r·σ_u²·σ_v²``; the variance is split evenly.
    """
    rank = u.shape[1]
    std = (target_variance / rank) ** 0.25
    with torch.no_grad():
        u.normal_(0.0, std)
        v.normal_(0.0, std)


# --------------------------------------------------------------------------- layers


class AtomConv2d(nn.Module):
    """A conv whose filters are ``α × D``: per-layer atoms ``(m, k, k)`` and coefficients ``(o, i, m)``.

    With ``rank`` set, the coefficient matrix ``(o, i·m)`` is held as ``coefficients_u (o, r)``
    and ``coefficients_v (r, i·m)`` (FedHM on the coefficients), and the forward pass takes the
    cheaper of reconstruct-then-conv and the factored form: a k×k conv to ``r`` channels with
    filters ``V × D`` then a 1×1 conv by ``U`` (the same function as atom conv → 1×1 (i·m→r) →
    1×1 (r→o), which stays available as ``path="atoms"``).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrPair,
        num_atoms: int = 9,
        stride: IntOrPair = 1,
        padding: IntOrPair = 0,
        dilation: IntOrPair = 1,
        bias: bool = True,
        rank: int | None = None,
    ) -> None:
        super().__init__()
        k = _square_kernel(kernel_size)
        if num_atoms < 1:
            raise ValueError(f"num_atoms must be ≥ 1, got {num_atoms}")
        if rank is not None and not 1 <= rank <= min(out_channels, in_channels * num_atoms):
            raise ValueError(
                f"rank {rank} outside [1, {min(out_channels, in_channels * num_atoms)}] "
                f"for {out_channels}×{in_channels * num_atoms} coefficients"
            )
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = k
        self.num_atoms = num_atoms
        self.stride = _pair(stride)
        self.padding = _pair(padding)
        self.dilation = _pair(dilation)
        self.rank = rank
        self.atoms = nn.Parameter(torch.empty(num_atoms, k, k))
        if rank is None:
            self.coefficients = nn.Parameter(torch.empty(out_channels, in_channels, num_atoms))
        else:
            self.coefficients_u = nn.Parameter(torch.empty(out_channels, rank))
            self.coefficients_v = nn.Parameter(torch.empty(rank, in_channels * num_atoms))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.atoms.is_meta:
            return  # a meta module (a spec read for its shapes) has no values to draw
        with torch.no_grad():
            self.atoms.copy_(orthonormal_atoms(self.num_atoms, self.kernel_size))
            # Var(α) = 2/(c_in·m_a) with orthonormal atoms gives Var(W) ≈ 2/(c_in·k²): Kaiming.
            std = math.sqrt(2.0 / (self.in_channels * self.num_atoms))
            if self.rank is None:
                self.coefficients.normal_(0.0, std)
            else:
                _init_factor_pair(self.coefficients_u, self.coefficients_v, std**2)
            if self.bias is not None:
                bound = 1.0 / math.sqrt(self.in_channels * self.kernel_size**2)
                self.bias.uniform_(-bound, bound)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, num_atoms: int = 9, rank: int | None = None) -> AtomConv2d:
        """Fit atoms and coefficients to a conv's filters: exact when ``num_atoms ≥ k²``.

        With ``rank``, the coefficient matrix is then held as its best rank-``rank`` factors.
        """
        _check_convertible(conv)
        layer = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            num_atoms=num_atoms,
            stride=conv.stride,
            padding=conv.padding,  # type: ignore[arg-type]  # never the string form here
            dilation=conv.dilation,
            bias=conv.bias is not None,
            rank=rank,
        )
        layer = layer.to(device=conv.weight.device, dtype=conv.weight.dtype)  # before copying: exact in float64
        coefficients, atoms = atoms_from_filters(conv.weight, num_atoms)
        with torch.no_grad():
            layer.atoms.copy_(atoms)
            if rank is None:
                layer.coefficients.copy_(coefficients)
            else:
                u, v = matrix_to_factors(coefficients_to_matrix(coefficients), rank)
                layer.coefficients_u.copy_(u)
                layer.coefficients_v.copy_(v)
            if conv.bias is not None and layer.bias is not None:
                layer.bias.copy_(conv.bias)
        return layer

    def coefficient_tensor(self) -> Tensor:
        """The full ``(o, i, m)`` coefficients, rebuilt from the factors for low-rank tiers."""
        if self.rank is None:
            return self.coefficients
        return matrix_to_coefficients(
            factors_to_matrix(self.coefficients_u, self.coefficients_v), self.in_channels, self.num_atoms
        )

    @property
    def weight(self) -> Tensor:
        return reconstruct_filter(self.coefficient_tensor(), self.atoms)

    def _output_hw(self, h: int, w: int) -> tuple[int, int]:
        k = self.kernel_size
        return tuple(  # type: ignore[return-value]
            (size + 2 * p - d * (k - 1) - 1) // s + 1
            for size, p, d, s in zip((h, w), self.padding, self.dilation, self.stride, strict=True)
        )

    def _path_macs(self, h: int, w: int) -> dict[str, int]:
        ho, wo = self._output_hw(h, w)
        o, i, m, k = self.out_channels, self.in_channels, self.num_atoms, self.kernel_size
        macs = {"dense": o * i * k * k * ho * wo}
        if self.rank is None:
            macs["atoms"] = (i * m * k * k + o * i * m) * ho * wo
        else:
            r = self.rank
            macs["atoms"] = (i * m * k * k + r * (i * m + o)) * ho * wo
            macs["factored"] = (r * i * k * k + r * o) * ho * wo
        return macs

    def _path(self, h: int, w: int) -> str:
        """The cheaper in MACs of reconstruct-then-conv and the factored path (low-rank tiers only).

        The literal two-layer form (``"atoms"``) computes the same function as ``"factored"``
        but its 9×-wide grouped-conv activation makes it several times slower in practice
        (benchmarks/layers.py), so it runs only when asked for.
        """
        if self.rank is None:
            return "dense"
        macs = self._path_macs(h, w)
        return "factored" if macs["factored"] < macs["dense"] else "dense"

    def macs_per_sample(self, h: int, w: int, path: str | None = None) -> int:
        """Multiply-accumulates of one sample through ``path`` (default: the one :meth:`forward` takes)."""
        macs = self._path_macs(h, w)
        chosen = path or self._path(h, w)
        if chosen not in macs:
            raise ValueError(f"unknown path {chosen!r} for this layer; use one of {', '.join(macs)}")
        return macs[chosen]

    def forward(self, x: Tensor, path: str | None = None) -> Tensor:
        chosen = path or self._path(x.shape[-2], x.shape[-1])
        if chosen == "dense":
            return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation)
        if chosen == "atoms":
            return self._two_layer(x)
        if chosen == "factored" and self.rank is not None:
            return self._factored(x)
        raise ValueError(f"unknown path {chosen!r}; use 'dense', 'atoms' or (low-rank tiers) 'factored'")

    def _factored(self, x: Tensor) -> Tensor:
        """``W = U·(V × D)``: a k×k conv to ``r`` channels with filters ``V × D``, then a 1×1 conv by ``U``."""
        assert self.rank is not None
        v = matrix_to_coefficients(self.coefficients_v, self.in_channels, self.num_atoms)
        z = F.conv2d(x, reconstruct_filter(v, self.atoms), None, self.stride, self.padding, self.dilation)
        return F.conv2d(z, self.coefficients_u[:, :, None, None], self.bias)

    def _two_layer(self, x: Tensor) -> Tensor:
        """DCF's literal form: atoms on every input channel, then 1×1 coefficient convs."""
        i = x.shape[1]
        m, k = self.num_atoms, self.kernel_size
        # grouped conv = the same m atoms applied to each input channel independently
        atom_weight = self.atoms.reshape(m, 1, k, k).repeat(i, 1, 1, 1)
        z = F.conv2d(x, atom_weight, None, self.stride, self.padding, self.dilation, groups=i)
        if self.rank is None:
            coeff = coefficients_to_matrix(self.coefficients)
            return F.conv2d(z, coeff[:, :, None, None], self.bias)
        z = F.conv2d(z, self.coefficients_v[:, :, None, None])
        return F.conv2d(z, self.coefficients_u[:, :, None, None], self.bias)

    def extra_repr(self) -> str:
        s = (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"num_atoms={self.num_atoms}, stride={self.stride}, padding={self.padding}"
        )
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.rank is not None:
            s += f", rank={self.rank}"
        return s + f", bias={self.bias is not None}"


class LowRankConv2d(nn.Module):
    """FedHM's factorized conv: a ``1×k`` conv (``lowrank_v``) then a ``k×1`` conv (``lowrank_u``).

    ``lowrank_u (o·k, r)`` and ``lowrank_v (r, i·k)`` are the factors of the unrolled weight
    (:func:`conv_weight_to_matrix`), so ``weight`` is the exact filter this layer computes with.
    No bias, BN or nonlinearity sits between the two convs; that would break ``W = U Vᵀ``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrPair,
        rank: int,
        stride: IntOrPair = 1,
        padding: IntOrPair = 0,
        dilation: IntOrPair = 1,
        bias: bool = False,
    ) -> None:
        super().__init__()
        k = _square_kernel(kernel_size)
        if not 1 <= rank <= min(out_channels * k, in_channels * k):
            raise ValueError(f"rank {rank} outside [1, {min(out_channels, in_channels) * k}]")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = k
        self.rank = rank
        self.stride = _pair(stride)
        self.padding = _pair(padding)
        self.dilation = _pair(dilation)
        self.lowrank_u = nn.Parameter(torch.empty(out_channels * k, rank))
        self.lowrank_v = nn.Parameter(torch.empty(rank, in_channels * k))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Kaiming (fan_out) variance for the product U V, split evenly; no SVD, so building a
        # tier model is cheap (the server's spectral initialization overwrites it anyway).
        if self.lowrank_u.is_meta:
            return  # a meta module (a spec read for its shapes) has no values to draw
        target = 2.0 / (self.out_channels * self.kernel_size**2)
        _init_factor_pair(self.lowrank_u, self.lowrank_v, target)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    @classmethod
    def from_full(cls, conv: nn.Conv2d, rank: int) -> LowRankConv2d:
        _check_convertible(conv)
        layer = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            rank,
            stride=conv.stride,
            padding=conv.padding,  # type: ignore[arg-type]  # never the string form here
            dilation=conv.dilation,
            bias=conv.bias is not None,
        )
        return _load_factors(layer, conv_weight_to_matrix(conv.weight), conv.bias)

    @property
    def weight(self) -> Tensor:
        return matrix_to_conv_weight(
            factors_to_matrix(self.lowrank_u, self.lowrank_v), self.out_channels, self.in_channels, self.kernel_size
        )

    def macs_per_sample(self, h: int, w: int) -> int:
        k, (sh, sw), (ph, pw), (dh, dw) = self.kernel_size, self.stride, self.padding, self.dilation
        wo = (w + 2 * pw - dw * (k - 1) - 1) // sw + 1
        ho = (h + 2 * ph - dh * (k - 1) - 1) // sh + 1
        # the 1×k conv strides along W only, so it runs at full input height
        return h * wo * self.in_channels * self.rank * k + ho * wo * self.rank * self.out_channels * k

    def forward(self, x: Tensor) -> Tensor:
        k, r = self.kernel_size, self.rank
        first = self.lowrank_v.reshape(r, self.in_channels, 1, k)
        second = self.lowrank_u.reshape(self.out_channels, k, r, 1).permute(0, 2, 1, 3)
        x = F.conv2d(x, first, None, (1, self.stride[1]), (0, self.padding[1]), (1, self.dilation[1]))
        return F.conv2d(x, second, self.bias, (self.stride[0], 1), (self.padding[0], 0), (self.dilation[0], 1))

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, rank={self.rank}, "
            f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, bias={self.bias is not None}"
        )


class LowRankLinear(nn.Module):
    """``y = x (U Vᵀ)ᵀ + b`` with ``lowrank_u (out, r)`` and ``lowrank_v (r, in)``."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True) -> None:
        super().__init__()
        if not 1 <= rank <= min(in_features, out_features):
            raise ValueError(f"rank {rank} outside [1, {min(in_features, out_features)}]")
        self.in_features = in_features
        self.out_features = out_features
        self.rank = rank
        self.lowrank_u = nn.Parameter(torch.empty(out_features, rank))
        self.lowrank_v = nn.Parameter(torch.empty(rank, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default weight variance 1/(3·in), carried by the product U V
        if self.lowrank_u.is_meta:
            return  # a meta module (a spec read for its shapes) has no values to draw
        _init_factor_pair(self.lowrank_u, self.lowrank_v, 1.0 / (3.0 * self.in_features))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            with torch.no_grad():
                self.bias.uniform_(-bound, bound)

    @classmethod
    def from_full(cls, linear: nn.Linear, rank: int) -> LowRankLinear:
        layer = cls(linear.in_features, linear.out_features, rank, bias=linear.bias is not None)
        return _load_factors(layer, linear.weight, linear.bias)

    @property
    def weight(self) -> Tensor:
        return factors_to_matrix(self.lowrank_u, self.lowrank_v)

    def macs_per_sample(self) -> int:
        return self.rank * (self.in_features + self.out_features)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(F.linear(x, self.lowrank_v), self.lowrank_u, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rank={self.rank}, bias={self.bias is not None}"


_Factored = TypeVar("_Factored", LowRankConv2d, LowRankLinear)


def _load_factors(layer: _Factored, matrix: Tensor, bias: Tensor | None) -> _Factored:
    """Spectral initialization of a FedHM layer from a full-rank matrix, on the source's device and dtype."""
    layer = layer.to(device=matrix.device, dtype=matrix.dtype)  # before copying, so float64 stays exact
    u, v = matrix_to_factors(matrix, layer.rank)
    with torch.no_grad():
        layer.lowrank_u.copy_(u)
        layer.lowrank_v.copy_(v)
        if bias is not None and layer.bias is not None:
            layer.bias.copy_(bias)
    return layer
