"""The local update every client runs: clients and the in-process simulator call the same code.

One call of :func:`local_update` is one client's round: E epochs of minibatch SGD from the
received model, with the optional terms of the methods fedatoms composes — FedProx's
proximal term, SCAFFOLD's control-variate correction (option II), FedHM's Frobenius decay on
low-rank factor pairs — and, for personalized FL, a separate phase that trains the client's
own filter atoms under the frozen global coefficients (filter-decomposition §3.3).

Everything a call draws at random (shuffling, dropout) comes from ``seed`` inside a forked
RNG, so the same inputs and seed give bit-identical tensors (on CPU; on CUDA as far as the
kernels are deterministic) and the caller's global RNG is left as it was.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedcore.layers import AtomConv2d, LowRankConv2d, LowRankLinear, factors_to_matrix

__all__ = [
    "Dataset",
    "EvalResult",
    "LocalResult",
    "TrainConfig",
    "atom_names",
    "evaluate",
    "factor_pairs",
    "local_update",
    "personalized_model",
    "resolve_device",
    "train_personal_atoms",
]

# Client data up to this size moves to the device once per call; larger data moves per batch.
_WHOLE_DATA_BYTES = 256 * 2**20
# Decorrelates the personal phase's shuffling from the global phase's (same client seed).
_PERSONAL_SEED_OFFSET = 0x9E3779B97F4A7C15


class Dataset(Protocol):
    """What training needs from a dataset: inputs ``x`` (N×C×H×W float) and labels ``y`` (N, int64)."""

    @property
    def x(self) -> Tensor: ...

    @property
    def y(self) -> Tensor: ...

    def __len__(self) -> int: ...


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` → CUDA when available, else CPU; anything else is parsed, and CUDA must exist."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}; use 'auto', 'cpu' or 'cuda[:N]'") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
    return resolved


# --------------------------------------------------------------------------- configuration


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}")


def _check_float(name: str, value: Any, *, positive: bool = False, below_one: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be ≥ 0, got {value!r}")
    if below_one and value >= 1:
        raise ValueError(f"{name} must be < 1, got {value!r}")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one local update; travels to clients as JSON (:meth:`to_dict`)."""

    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    prox_mu: float = 0.0
    frobenius_decay: float = 0.0
    personal_epochs: int | None = None
    device: str = "auto"

    def __post_init__(self) -> None:
        _check_int("local_epochs", self.local_epochs, 1)
        _check_int("batch_size", self.batch_size, 1)
        _check_float("lr", self.lr, positive=True)
        _check_float("momentum", self.momentum, below_one=True)
        _check_float("weight_decay", self.weight_decay)
        _check_float("prox_mu", self.prox_mu)
        _check_float("frobenius_decay", self.frobenius_decay)
        if self.personal_epochs is not None:
            _check_int("personal_epochs", self.personal_epochs, 1)
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a non-empty string, got {self.device!r}")

    @property
    def effective_personal_epochs(self) -> int:
        return self.local_epochs if self.personal_epochs is None else self.personal_epochs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys are errors so a typo cannot pass silently."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown TrainConfig fields: {', '.join(sorted(unknown))}")
        return cls(**dict(data))


# --------------------------------------------------------------------------- results


@dataclass
class LocalResult:
    """A client's round: the full trained ``state_dict`` (CPU) plus what the optional methods produce."""

    tensors: dict[str, Tensor]
    num_samples: int
    metrics: dict[str, float]
    control: dict[str, Tensor] | None = None
    control_delta: dict[str, Tensor] | None = None
    personal_atoms: dict[str, Tensor] | None = None


@dataclass
class EvalResult:
    accuracy: float
    loss: float
    num_samples: int


# --------------------------------------------------------------------------- helpers


def _cpu(t: Tensor) -> Tensor:
    """A detached CPU copy that shares no storage with the model (the model may train on)."""
    return t.detach().to("cpu", copy=True).contiguous()


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's global RNG (dropout & co.) for the block, restoring the caller's state after."""
    devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        if device.type == "cpu":
            # only the CPU generator draws here; torch.manual_seed would also queue a seed for every
            # accelerator type torch knows, each with a stack trace: 0.1-0.4 ms a call, once or twice per client round
            torch.default_generator.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        yield


class _Batches:
    """Client data on the device (once, when small) and seeded shuffled minibatches over it."""

    def __init__(self, data: Dataset, device: torch.device) -> None:
        x, y = data.x, data.y
        if len(x) != len(y):
            raise ValueError(f"dataset has {len(x)} inputs but {len(y)} labels")
        if len(x) == 0:
            raise ValueError("dataset is empty")
        y = y.long()
        whole = x.element_size() * x.nelement() <= _WHOLE_DATA_BYTES
        self.x = x.to(device) if whole else x
        self.y = y.to(device) if whole else y
        self.device = device
        self.n = len(x)

    def epoch(self, batch_size: int, generator: torch.Generator | None) -> Iterator[tuple[Tensor, Tensor]]:
        order = torch.randperm(self.n, generator=generator) if generator is not None else torch.arange(self.n)
        order = order.to(self.x.device)
        for start in range(0, self.n, batch_size):
            idx = order[start : start + batch_size]
            yield self.x[idx].to(self.device), self.y[idx].to(self.device)


@dataclass
class _EpochStats:
    loss: float
    accuracy: float
    steps: int


def _sgd(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    batches: _Batches,
    config: TrainConfig,
    epochs: int,
    seed: int,
    penalty: Callable[[], Tensor | None] | None = None,
    correction: Mapping[str, Tensor] | None = None,
    on_epoch: Callable[[int, int], None] | None = None,
) -> _EpochStats:
    """Minibatch SGD on ``params`` with a fresh optimizer (momentum restarts every round).

    ``penalty`` adds a regularizer to the loss; ``correction`` is added to each gradient after
    backward (SCAFFOLD's ``c − c_i``). Returns the last epoch's mean loss and accuracy.
    """
    optimizer = torch.optim.SGD(
        list(params.values()), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    generator = torch.Generator().manual_seed(seed)
    steps = 0
    loss_sum = torch.zeros((), device=batches.device)
    correct = torch.zeros((), device=batches.device, dtype=torch.long)
    for epoch in range(epochs):
        last = epoch == epochs - 1
        for xb, yb in batches.epoch(config.batch_size, generator):
            optimizer.zero_grad(set_to_none=True)
            logits = model(xb)
            loss = F.cross_entropy(logits, yb)
            total = loss
            if penalty is not None:
                extra = penalty()
                if extra is not None:
                    total = total + extra
            total.backward()
            if correction is not None:
                for name, p in params.items():
                    if p.grad is None:
                        p.grad = correction[name].clone()
                    else:
                        p.grad.add_(correction[name])
            optimizer.step()
            steps += 1
            if last:
                loss_sum += loss.detach() * len(yb)
                correct += (logits.detach().argmax(dim=1) == yb).sum()
        if on_epoch is not None:
            on_epoch(epoch + 1, epochs)
    return _EpochStats(float(loss_sum) / batches.n, float(correct) / batches.n, steps)


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


def _frobenius_penalty(model: nn.Module, lam: float) -> Callable[[], Tensor | None]:
    """FedHM's FD: ``(λ/2)·‖U V‖_F²`` per trainable pair; its gradient is ``λ·UVVᵀ`` and ``λ·UᵀUV``."""
    pairs = [(u, v) for _, u, v in factor_pairs(model) if u.requires_grad and v.requires_grad]

    def penalty() -> Tensor | None:
        if not pairs:
            return None
        return (lam / 2) * sum(factors_to_matrix(u, v).pow(2).sum() for u, v in pairs)  # type: ignore[return-value]

    return penalty


def _proximal_penalty(
    params: Mapping[str, nn.Parameter], start: Mapping[str, Tensor], mu: float
) -> Callable[[], Tensor]:
    """FedProx: ``(μ/2)·‖w − w_start‖²`` over every trainable parameter."""

    def penalty() -> Tensor:
        return (mu / 2) * sum((p - start[n]).pow(2).sum() for n, p in params.items())  # type: ignore[return-value]

    return penalty


def _combine(*terms: Callable[[], Tensor | None] | None) -> Callable[[], Tensor | None] | None:
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


def _control_on(
    name: str, control: Mapping[str, Tensor], params: Mapping[str, nn.Parameter], device: torch.device
) -> dict[str, Tensor]:
    """Validate a SCAFFOLD control (one tensor per trainable parameter) and move it to ``device``."""
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
        out[key] = control[key].detach().to(device=device, dtype=p.dtype)
    return out


def atom_names(model: nn.Module) -> list[str]:
    """``state_dict`` names of every :class:`AtomConv2d`'s atoms, e.g. ``conv2.atoms``."""
    return [f"{name}.atoms" if name else "atoms" for name, m in model.named_modules() if isinstance(m, AtomConv2d)]


def _check_personal_atoms(model: nn.Module, personal_atoms: Mapping[str, Tensor]) -> None:
    names = atom_names(model)
    if not names:
        raise ValueError(
            "personal atoms need a model with AtomConv2d layers (factorization 'atoms' or 'atoms-lowrank')"
        )
    if set(personal_atoms) != set(names):
        raise ValueError(
            f"personal_atoms must name exactly the model's atom tensors {sorted(names)}, got {sorted(personal_atoms)}"
        )
    state = model.state_dict()
    for name in names:
        if tuple(personal_atoms[name].shape) != tuple(state[name].shape):
            raise ValueError(
                f"personal atoms {name!r} have shape {tuple(personal_atoms[name].shape)}, "
                f"expected {tuple(state[name].shape)}"
            )


def personalized_model(model: nn.Module, personal_atoms: Mapping[str, Tensor]) -> nn.Module:
    """A deep copy whose filters are the global coefficients × the client's atoms (§3.3's evaluation model)."""
    _check_personal_atoms(model, personal_atoms)
    personal = copy.deepcopy(model)
    params = dict(personal.named_parameters())
    with torch.no_grad():
        for name, atoms in personal_atoms.items():
            params[name].copy_(atoms)
    return personal


# --------------------------------------------------------------------------- the local update


def train_personal_atoms(
    model: nn.Module,
    data: Dataset,
    config: TrainConfig,
    personal_atoms: Mapping[str, Tensor],
    *,
    seed: int,
) -> tuple[nn.Module, dict[str, float]]:
    """Train the client's atoms ``D_l`` with everything else frozen at the received values.

    Returns the trained personalized copy (on the config's device; the received model is
    untouched) and its metrics. Plain SGD with the config's lr/momentum/weight decay for
    ``personal_epochs``; the FedProx, SCAFFOLD and Frobenius terms belong to the global update.
    """
    _check_personal_atoms(model, personal_atoms)
    device = resolve_device(config.device)
    return _train_personal(model, _Batches(data, device), config, personal_atoms, seed, device)


def _train_personal(
    model: nn.Module,
    batches: _Batches,
    config: TrainConfig,
    personal_atoms: Mapping[str, Tensor],
    seed: int,
    device: torch.device,
) -> tuple[nn.Module, dict[str, float]]:
    personal = personalized_model(model, personal_atoms).to(device)
    for p in personal.parameters():
        p.requires_grad_(False)
    named = dict(personal.named_parameters())
    params = {name: named[name] for name in atom_names(personal)}
    for p in params.values():
        p.requires_grad_(True)
    personal.train()
    pseed = (seed + _PERSONAL_SEED_OFFSET) % 2**64
    with _seeded(pseed, device):
        stats = _sgd(personal, params, batches, config, config.effective_personal_epochs, pseed)
    metrics = {
        "personal_train_loss": stats.loss,
        "personal_train_accuracy": stats.accuracy,
        "personal_steps": float(stats.steps),
    }
    return personal, metrics


def local_update(
    model: nn.Module,
    data: Dataset,
    config: TrainConfig,
    *,
    seed: int,
    server_control: Mapping[str, Tensor] | None = None,
    client_control: Mapping[str, Tensor] | None = None,
    personal_atoms: Mapping[str, Tensor] | None = None,
    on_epoch: Callable[[int, int], None] | None = None,
) -> LocalResult:
    """One client's round of local training; ``model`` is trained in place on the resolved device.

    With ``server_control`` SCAFFOLD (option II) corrects every gradient by ``c − c_i`` and
    returns ``c_i⁺ = c_i − c + (w_start − w_end)/(K·lr)``. With ``personal_atoms`` the client's
    atoms are first trained on a frozen copy of the received model (see
    :func:`train_personal_atoms`); the global update that follows is unaffected by it.
    """
    began = time.perf_counter()
    device = resolve_device(config.device)
    if personal_atoms is not None:
        _check_personal_atoms(model, personal_atoms)
    model.to(device)
    was_training = model.training
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("model has no trainable parameters")

    batches = _Batches(data, device)
    correction: dict[str, Tensor] | None = None
    c_server: dict[str, Tensor] = {}
    c_client: dict[str, Tensor] = {}
    if server_control is not None:
        c_server = _control_on("server_control", server_control, params, device)
        if client_control is None:
            c_client = {n: torch.zeros_like(p) for n, p in params.items()}
        else:
            c_client = _control_on("client_control", client_control, params, device)
        correction = {n: c_server[n] - c_client[n] for n in params}
    elif client_control is not None:
        raise ValueError("client_control without server_control: SCAFFOLD needs the server's control too")

    metrics: dict[str, float] = {}
    new_personal: dict[str, Tensor] | None = None
    if personal_atoms is not None:
        personal, metrics = _train_personal(model, batches, config, personal_atoms, seed, device)
        state = personal.state_dict()
        new_personal = {name: _cpu(state[name]) for name in atom_names(personal)}
        del personal

    start = {n: p.detach().clone() for n, p in params.items()} if (config.prox_mu > 0 or correction is not None) else {}
    penalty = _combine(
        _proximal_penalty(params, start, config.prox_mu) if config.prox_mu > 0 else None,
        _frobenius_penalty(model, config.frobenius_decay) if config.frobenius_decay > 0 else None,
    )
    model.train()
    try:
        with _seeded(seed, device):
            stats = _sgd(model, params, batches, config, config.local_epochs, seed, penalty, correction, on_epoch)
    finally:
        model.train(was_training)

    control = control_delta = None
    if correction is not None:
        scale = stats.steps * config.lr
        control, control_delta = {}, {}
        for n, p in params.items():
            new = c_client[n] - c_server[n] + (start[n] - p.detach()) / scale
            control[n] = _cpu(new)
            control_delta[n] = _cpu(new - c_client[n])

    metrics.update(
        train_loss=stats.loss,
        train_accuracy=stats.accuracy,
        steps=float(stats.steps),
        seconds=time.perf_counter() - began,
    )
    return LocalResult(
        tensors={k: _cpu(v) for k, v in model.state_dict().items()},
        num_samples=batches.n,
        metrics=metrics,
        control=control,
        control_delta=control_delta,
        personal_atoms=new_personal,
    )


def evaluate(model: nn.Module, data: Dataset, *, batch_size: int = 256, device: str = "auto") -> EvalResult:
    """Accuracy and mean cross-entropy in eval mode; the model's train/eval mode is restored after."""
    if len(data) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    _check_int("batch_size", batch_size, 1)
    dev = resolve_device(device)
    batches = _Batches(data, dev)
    model.to(dev)
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=dev, dtype=torch.float64)
    correct = torch.zeros((), device=dev, dtype=torch.long)
    try:
        with torch.no_grad():
            for xb, yb in batches.epoch(batch_size, None):
                logits = model(xb)
                loss_sum += F.cross_entropy(logits, yb, reduction="sum").double()
                correct += (logits.argmax(dim=1) == yb).sum()
    finally:
        model.train(was_training)
    return EvalResult(accuracy=float(correct) / batches.n, loss=float(loss_sum) / batches.n, num_samples=batches.n)
