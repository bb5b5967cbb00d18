"""fedatoms: federated learning with filter atoms, FedHM low-rank tiers and FedLAMA intervals.

The public Python API is :func:`load_model`: the model a federation trained, back as a plain
PyTorch module. Everything else is reached through the ``fedatoms`` command.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["load_model"]


def load_model(
    path: str | Path,
    *,
    factorized: bool = False,
    allowed_models: Sequence[str] | None = None,
) -> nn.Module:
    """The model in a file ``fedatoms aggregator export`` wrote, ready for inference (eval mode).

    By default the module is the model as its own code defines it, every atom layer's filters
    reconstructed (``W = α × D``), so it runs anywhere PyTorch does; ``factorized=True`` gives
    the module the server aggregated (atoms and coefficients), or, from ``export --tier``, the small
    module a device of that tier runs (its low-rank factors). Building the model imports its
    reference: allowed are the zoo and ``allowed_models`` (module prefixes or references;
    default ``torchvision.models``, as on clients). Nothing is unpickled.
    """
    from client_agent.allowed_models import DEFAULT_ALLOWED_MODELS, check_reference
    from fedcore.model_file import read_model_file

    file = read_model_file(path)
    allowed = DEFAULT_ALLOWED_MODELS if allowed_models is None else tuple(allowed_models)
    check_reference(file.spec.model, allowed)  # before anything imports it
    return file.factorized_model() if factorized else file.plain_model()
