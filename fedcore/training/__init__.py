"""The local update every client runs: clients and the in-process simulator call the same code.

One call of :func:`local_update` is one client's round: E epochs of minibatch SGD from the
received model, with the optional terms of the methods fedatoms composes — FedProx's
proximal term, SCAFFOLD's control-variate correction (option II), FedHM's Frobenius decay on
low-rank factor pairs — and, for personalized FL, a separate phase that trains the client's
own filter atoms under the frozen global coefficients (filter-decomposition §3.3).

Everything a call draws at random (shuffling, dropout) comes from ``seed`` inside a forked
RNG, so the same inputs and seed give bit-identical tensors (on CPU; on CUDA as far as the
kernels are deterministic) and the caller's global RNG is left as it was.

Modules, one idea each: :mod:`~fedcore.training.config` (what is asked and returned),
:mod:`~fedcore.training.loop` (device, batches, seeding, the SGD loop),
:mod:`~fedcore.training.terms` (FedProx, SCAFFOLD, Frobenius decay),
:mod:`~fedcore.training.personal` (personal atoms), :mod:`~fedcore.training.update`
(:func:`local_update`) and :mod:`~fedcore.training.evaluate`.
"""

from fedcore.training.config import EvalResult, LocalResult, TrainConfig
from fedcore.training.evaluate import evaluate
from fedcore.training.loop import Dataset, resolve_device
from fedcore.training.personal import atom_names, personalized_model, train_personal_atoms
from fedcore.training.terms import factor_pairs
from fedcore.training.update import local_update

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
