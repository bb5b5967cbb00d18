"""A federation's model as one safetensors file a user can load without the aggregator.

The tensors are the global model's (the full-rank γ = 1 spec the server aggregates), or a tier's
(``export --tier``: the low-rank model a client of that tier runs), plus, for each atom layer, its
reconstructed filters ``<module>.weight = α × D`` (and at a tier each low-rank layer's ``U V``). The metadata says
how to rebuild the module: the spec as JSON (model reference, its arguments, factorization,
full-rank patterns, head, input shape) and, when the federation gives one, the input
normalization. Safetensors holds only arrays and strings, so reading a file runs no code but
the model reference's, which the reader checks first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from fedcore.layers import reconstruct_filter
from fedcore.spec import ModelSpec

__all__ = ["FORMAT", "ModelFile", "read_model_file", "write_model_file"]

FORMAT = "fedatoms.model/1"


class ModelFile:
    """What a model file holds: the spec, the tensors, and the metadata it was written with."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
        self.spec = spec
        self.tensors = tensors
        self.metadata = metadata

    @property
    def normalization(self) -> dict[str, list[float]] | None:
        text = self.metadata.get("normalization")
        return None if not text else json.loads(text)

    @property
    def classes(self) -> list[str] | None:
        text = self.metadata.get("classes")
        return None if not text else json.loads(text)

    def factorized_model(self) -> nn.Module:
        """The module as the file's spec builds it (atom layers as ``α`` and ``D``; a tier's file: the small
        module that tier's devices run), in eval mode."""
        return self.spec.build_loaded({n: self.tensors[n] for n in self.spec.names}).eval()

    def plain_model(self) -> nn.Module:
        """The module as its code defines it, every atom layer's filters ``W = α × D`` reconstructed."""
        model = self.spec.build_plain()
        state = model.state_dict()
        missing = [n for n in state if n not in self.tensors]
        if missing:
            raise ValueError(f"the model file lacks tensors {missing[:5]} of {self.spec.model!r}")
        model.load_state_dict({n: self.tensors[n] for n in state})
        return model.eval()


def write_model_file(
    path: str | Path,
    spec: ModelSpec,
    tensors: Mapping[str, Tensor],
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``spec``'s ``tensors``, the plain module's weights they stand for, and the rebuild recipe.

    At γ = 1 these are the full-rank global tensors; at a tier γ < 1, that tier's factors (the model
    a client of the tier runs), each pair's product then standing for a low-rank layer's plain weight.
    """
    from safetensors.torch import save

    missing = set(spec.names) - set(tensors)
    if missing:
        raise ValueError(f"tensors {sorted(missing)[:5]} of {spec.describe()} are missing")
    out = {n: tensors[n].detach().cpu().contiguous() for n in spec.names}
    full = spec.to_full(out)  # γ = 1: the same tensors
    for t in spec.full().tensors:
        if t.role == "atoms":
            module = t.module
            out[f"{module}.weight"] = reconstruct_filter(full[f"{module}.coefficients"], full[t.name]).contiguous()
        elif t.role != "coefficients" and t.name not in out:
            out[t.name] = full[t.name].contiguous()
    recipe = {k: v for k, v in spec.to_dict().items() if k != "tensors"}
    meta = {"format": FORMAT, "spec": json.dumps(recipe, sort_keys=True)}
    for key, value in (metadata or {}).items():
        if value is not None:
            meta[key] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(save(out, metadata=meta))  # written as any file is: safetensors' save_file makes it 0600
    return path


def read_model_file(path: str | Path) -> ModelFile:
    """Read a file :func:`write_model_file` wrote; builds nothing (the caller checks the reference first)."""
    from safetensors import SafetensorError, safe_open

    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such model file")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path} is not a safetensors file ({exc})") from None
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not a fedatoms model file (format {metadata.get('format')!r}, not {FORMAT!r})")
    spec = ModelSpec.from_dict(json.loads(metadata["spec"]))
    return ModelFile(spec, tensors, metadata)
