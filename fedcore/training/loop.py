"""The minibatch SGD loop both phases of a client's round run, and what it stands on.

The device a config names, the client data moved there (tensors in memory) or streamed to it
(any map-style Dataset, through a DataLoader: a device with more images than memory trains),
seeded shuffling over it, and the seeding of torch's global RNG for dropout: the same inputs
and seed give bit-identical tensors (on CPU; on CUDA as far as the kernels are deterministic),
and the caller's global RNG is left as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from fedcore.training.atom_steps import AtomSteps
from fedcore.training.config import TrainConfig
from fedcore.training.nested import NestedCut, NestedPasses

__all__ = [
    "Batches",
    "Dataset",
    "EpochStats",
    "phase",
    "resolve_device",
    "seeded",
    "sgd",
    "smallest_batch",
    "training_only",
]

# Client data up to this size moves to the device once per call; larger data moves per batch.
_WHOLE_DATA_BYTES = 256 * 2**20


class Dataset(Protocol):
    """What training needs from a dataset: inputs ``x`` (N×C×H×W float) and labels ``y`` (N, int64) in
    memory, or (read by :class:`Batches` through a DataLoader) any map-style torch Dataset of
    ``(input, label)`` items."""

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


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's global RNG (dropout & co.) for the block, restoring the caller's state after."""
    devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        if device.type == "cpu":
            # only the CPU generator draws here, and it draws what torch.manual_seed would make it draw;
            # torch.manual_seed would also queue a seed, with a stack trace, for every accelerator type
            # torch knows, a cost paid once or twice in every client's round for nothing
            torch.default_generator.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        yield


class Batches:
    """Seeded shuffled minibatches of client data: tensors moved to the device once (when small), or any
    other dataset streamed through a DataLoader in the same seeded order (never all in memory)."""

    def __init__(self, data: Dataset | TorchDataset, device: torch.device) -> None:
        self.device = device
        self.n = len(data)  # type: ignore[arg-type]  # map-style datasets have a length
        if self.n == 0:
            raise ValueError("dataset is empty")
        x, y = getattr(data, "x", None), getattr(data, "y", None)
        self.stream: TorchDataset | None = None
        self.top_label = -1  # the largest label read so far (on the host), for :meth:`check_classes`
        if not (isinstance(x, Tensor) and isinstance(y, Tensor)):
            self.stream = data  # type: ignore[assignment]
            return
        if len(x) != len(y):
            raise ValueError(f"dataset has {len(x)} inputs but {len(y)} labels")
        y = self._checked(x, y)
        whole = x.element_size() * x.nelement() <= _WHOLE_DATA_BYTES
        self.x = x.to(device) if whole else x
        self.y = y.to(device) if whole else y

    def epoch(
        self, batch_size: int, generator: torch.Generator | None, min_batch: int = 1
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """One pass in ``generator``'s order (in order without one); a last minibatch smaller than
        ``min_batch`` is skipped (train-mode BatchNorm cannot normalize one sample)."""
        order = torch.randperm(self.n, generator=generator) if generator is not None else torch.arange(self.n)
        stop = self.n if self.n % batch_size == 0 or self.n % batch_size >= min_batch else self.n - self.n % batch_size
        if self.stream is not None:
            chunks = [order[s : min(s + batch_size, stop)].tolist() for s in range(0, stop, batch_size)]
            for xb, yb in DataLoader(self.stream, batch_sampler=chunks):
                yb = self._checked(xb, torch.as_tensor(yb))
                yield xb.to(self.device), yb.to(self.device)
            return
        order = order.to(self.x.device)
        for start in range(0, stop, batch_size):
            idx = order[start : min(start + batch_size, stop)]
            yield self.x[idx].to(self.device), self.y[idx].to(self.device)

    def _checked(self, x: Tensor, y: Tensor) -> Tensor:
        """Inputs the model can take and labels it can score, read where they are loaded (the host, no device
        sync): otherwise a conv fails on a dtype and cross-entropy on an index, or on CUDA with a device assert."""
        if not isinstance(x, Tensor) or not (x.is_floating_point() or x.dtype in (torch.int64, torch.int32)):
            kind = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"dataset inputs are {kind}, not floating-point tensors or integer ids: return images as float "
                "tensors (e.g. torchvision's ToTensor scales uint8 to [0, 1]) or as PIL images to have fedatoms "
                'convert them; token ids as int64 tensors, with input_dtype = "int64" for the model'
            )
        if y.dtype.is_floating_point or y.dtype == torch.bool or y.dim() != 1:
            raise ValueError(
                f"dataset labels are {y.dtype} of shape {tuple(y.shape)}: a label is one integer class index a sample"
            )
        y = y.long()
        if len(y):
            low, high = int(y.min()), int(y.max())
            if low < 0:
                raise ValueError(f"dataset label {low} is negative: labels are class indices 0, 1, …")
            self.top_label = max(self.top_label, high)
        return y

    def check_classes(self, num_classes: int) -> None:
        """Refuse, in words, a label the model's ``num_classes`` outputs cannot score (cross-entropy would fail
        on the index); called with the logits' width before the loss."""
        if self.top_label >= num_classes:
            raise ValueError(
                f"the data has label {self.top_label} but the model has {num_classes} classes (labels 0.."
                f"{num_classes - 1}): every device and the evaluation data need the federation's class numbering"
            )


def smallest_batch(model: nn.Module) -> int:
    """The smallest minibatch ``model`` trains on: 2 with BatchNorm anywhere (train-mode BatchNorm cannot
    normalize one sample whose maps are 1×1), else 1."""
    return 2 if any(isinstance(m, _BatchNorm) for m in model.modules()) else 1


@dataclass
class EpochStats:
    loss: float
    accuracy: float
    steps: int


def sgd(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    batches: Batches,
    config: TrainConfig,
    epochs: int,
    seed: int,
    penalty: Callable[[], Tensor | None] | None = None,
    correction: Mapping[str, Tensor] | None = None,
    on_epoch: Callable[[int, int], None] | None = None,
    nested: NestedCut | None = None,
) -> EpochStats:
    """Minibatch SGD on ``params`` with a fresh optimizer (momentum restarts every round).

    In a model with BatchNorm a last minibatch of one sample is skipped: train-mode BatchNorm
    cannot normalize it.

    ``penalty`` adds a regularizer to the loss; ``correction`` is added to each gradient after
    backward (SCAFFOLD's ``c − c_i``). With ``nested`` each step adds the loss of the model cut to the
    smallest tier (:mod:`fedcore.training.nested`). Returns the last epoch's mean loss and accuracy
    (the whole model's).
    """
    smallest = smallest_batch(model)
    steps_of = AtomSteps(model, params, config.lr, config.atom_lr)
    passes = None if nested is None else NestedPasses(nested, params)
    if passes is not None and passes.empty:
        passes = None
    optimizer = torch.optim.SGD(
        steps_of.param_groups, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    generator = torch.Generator().manual_seed(seed)
    steps = 0
    loss_sum = torch.zeros((), device=batches.device)
    correct = torch.zeros((), device=batches.device, dtype=torch.long)
    seen = 0
    for epoch in range(epochs):
        last = epoch == epochs - 1
        for xb, yb in batches.epoch(config.batch_size, generator, smallest):
            optimizer.zero_grad(set_to_none=True)
            if passes is None:
                logits = model(xb)
                batches.check_classes(logits.shape[-1])
                loss = F.cross_entropy(logits, yb)
                total = loss
            else:
                logits, loss, cut_loss = passes.losses(model, params, xb, yb, batches.check_classes)
                total = loss + cut_loss
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
            steps_of.rescale(optimizer)
            optimizer.step()
            steps += 1
            if last:
                seen += len(yb)
                loss_sum += loss.detach() * len(yb)
                correct += (logits.detach().argmax(dim=1) == yb).sum()
        if on_epoch is not None:
            on_epoch(epoch + 1, epochs)
    if seen == 0:
        raise ValueError(f"no minibatch of at least {smallest} samples in {batches.n} (the model has BatchNorm)")
    return EpochStats(float(loss_sum) / seen, float(correct) / seen, steps)


@contextmanager
def training_only(model: nn.Module, names: Collection[str]) -> Iterator[dict[str, nn.Parameter]]:
    """Within the block only the parameters ``names`` require gradients (the rest are frozen, no graph
    is built for them); yields those parameters and restores every flag after."""
    named = dict(model.named_parameters())
    unknown = set(names) - set(named)
    if unknown:
        raise ValueError(f"not parameters of the model: {sorted(unknown)[:5]}")
    flags = {n: p.requires_grad for n, p in named.items()}
    try:
        for n, p in named.items():
            p.requires_grad_(n in names and flags[n])
        yield {n: named[n] for n in names if flags[n]}
    finally:
        for n, p in named.items():
            p.requires_grad_(flags[n])


def phase(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    batches: Batches,
    config: TrainConfig,
    epochs: int,
    seed: int,
    penalty: Callable[[], Tensor | None] | None = None,
) -> EpochStats:
    """One training phase of a client's round: ``epochs`` of :func:`sgd` on ``params`` in train mode,
    seeded by ``seed`` (shuffling and dropout alike), the model's mode restored after."""
    if not params:
        raise ValueError("this phase has no trainable parameters")
    was_training = model.training
    model.train()
    try:
        with seeded(seed, batches.device):
            return sgd(model, params, batches, config, epochs, seed, penalty)
    finally:
        model.train(was_training)
