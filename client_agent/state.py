"""What a client keeps between rounds, whatever the transport — and, for an agent, on disk.

The global tensors it last fetched (with versions, so a fetch moves only what changed),
the local values of tensors that were not synchronized yet (FedLAMA cohorts continue from
them), its personal atoms or the personal tensors of a personalization baseline (FedPer's head,
LG-FedAvg's body, Ditto's personal model, …), the training config and seed of its last round
(FedAvg+FT fine-tunes with them at evaluation) and its SCAFFOLD control variate. An agent also keeps the update
it trained but has not seen acknowledged (so a restart re-pushes it with the same
``update_id``) and the round whose model it still has to evaluate.

:meth:`ClientState.save` writes everything to one safetensors file (tensors) whose metadata
holds the rest as JSON, through a temporary file and an atomic rename: a kill at any moment
leaves either the previous state or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file
from torch import Tensor

__all__ = ["STATE_FILE", "ClientState", "PendingUpdate", "TakenUpdate"]

STATE_FILE = "state.safetensors"
_FORMAT = 1


def _reason(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class StateWriteError(ValueError):
    """The state directory refused a write (full, read-only): a condition of the device, said in one line."""


class StateError(ValueError):
    """A state file that cannot be read (corrupt, truncated, another program's): said in one line with the way out."""

    def __init__(self, path: Path, cause: BaseException) -> None:
        super().__init__(
            f"{path}: not a readable client state ({_reason(cause)}); restore it from a backup, or delete the state "
            "directory to enroll this device anew"
        )


_STRATEGY = "strategy."  # group prefix of the strategy state ("strategy.control", …)
_PENDING_STRATEGY = "pending_strategy."  # and of the pending update's, not yet kept
_TAKEN_STRATEGY = "taken_strategy."  # and of the update taken, until its round's outcome is known


@dataclass
class PendingUpdate:
    """A trained update not yet acknowledged: pushed again, with the same id, after a crash or a dropped link."""

    round: int
    update_id: str
    num_samples: int
    metrics: dict[str, float]
    tensors: dict[str, Tensor]
    control_delta: dict[str, Tensor] | None = None
    fp16: bool = False  # the federation's transport precision, as the task said
    #: the strategy state this update's training produced: held aside (``taken``) once the server takes the
    #: update, dropped if it refuses it: SCAFFOLD's c = mean c_i (FedDyn's h, FedDC's H likewise) holds only
    #: over updates folded
    strategy_state: dict[str, dict[str, Tensor]] = field(default_factory=dict)


@dataclass
class TakenUpdate:
    """An update the server took for ``round``, whose round's outcome is not known yet.

    The strategy state its training produced waits here: kept once the round closes (the server folded
    the update), dropped if the round was abandoned (it folded nothing), so ``c = mean c_i`` holds then too.
    """

    round: int
    strategy_state: dict[str, dict[str, Tensor]]


@dataclass
class ClientState:
    client_id: str
    tier: float
    global_tensors: dict[str, Tensor] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    unsynced: dict[str, Tensor] = field(default_factory=dict)
    local: dict[str, Tensor] = field(default_factory=dict)  # never aggregated (e.g. BN statistics kept local)
    personal_atoms: dict[str, Tensor] | None = None
    #: per-client strategy state by group ("control", "gradient", "drift"), one tensor per trainable parameter
    strategy_state: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    #: a personalization baseline's tensors that never travel (fedcore.training.personalization)
    personal_model: dict[str, Tensor] | None = None
    rounds_joined: int = 0
    pending: PendingUpdate | None = None
    taken: TakenUpdate | None = None
    evaluate_round: int | None = None  # pushed for this round: evaluate the model it produces
    last_round: int = 0  # the last round this client trained for
    last_config: dict[str, Any] | None = None  # TrainConfig.to_dict() of the last round trained
    last_seed: int | None = None  # and its seed

    def receive(self, fetched: dict[str, tuple[Tensor, int]]) -> None:
        """Take newer global tensors; a tensor the server synchronized since supersedes its unsynced local value
        (a client that missed the round that synchronized it must not continue from what it trained before)."""
        for name, (tensor, version) in fetched.items():
            self.global_tensors[name] = tensor
            self.versions[name] = version
            self.unsynced.pop(name, None)

    def starting_point(self, continue_unsynced: bool) -> dict[str, Tensor]:
        """Global values, overlaid with unsynced local values when the cohort continues, and always with
        the tensors the federation keeps local."""
        if not continue_unsynced:
            self.unsynced.clear()
        return {**self.global_tensors, **self.unsynced, **self.local}

    # ------------------------------------------------------------------ on disk

    def _groups(self) -> dict[str, dict[str, Tensor] | None]:
        p, t = self.pending, self.taken
        return {
            "global": self.global_tensors,
            "unsynced": self.unsynced,
            "local": self.local,
            "personal": self.personal_atoms,
            **{f"{_STRATEGY}{g}": values for g, values in self.strategy_state.items()},
            "personal_model": self.personal_model,
            "pending": p.tensors if p else None,
            "pending_delta": p.control_delta if p else None,
            **{f"{_PENDING_STRATEGY}{g}": values for g, values in (p.strategy_state if p else {}).items()},
            **{f"{_TAKEN_STRATEGY}{g}": values for g, values in (t.strategy_state if t else {}).items()},
        }

    def save(self, directory: str | Path, *, fsync: bool = True) -> Path:
        """Write the whole state to ``directory/state.safetensors`` atomically (and durably with ``fsync``)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, Tensor] = {}
        present = []
        for group, values in self._groups().items():
            if values is None:
                continue
            present.append(group)
            for name, t in values.items():
                tensors[f"{group}/{name}"] = t.detach().cpu().contiguous()
        p = self.pending
        meta: dict[str, Any] = {
            "format": _FORMAT,
            "client_id": self.client_id,
            "tier": self.tier,
            "versions": self.versions,
            "rounds_joined": self.rounds_joined,
            "groups": present,
            "evaluate_round": self.evaluate_round,
            "last_round": self.last_round,
            "last_config": self.last_config,
            "last_seed": self.last_seed,
            "pending": None
            if p is None
            else {
                "round": p.round,
                "update_id": p.update_id,
                "num_samples": p.num_samples,
                "metrics": p.metrics,
                "fp16": p.fp16,
            },
            "taken_round": None if self.taken is None else self.taken.round,
        }
        path = directory / STATE_FILE
        tmp = directory / f".{STATE_FILE}.tmp"
        metadata = {"fedatoms": json.dumps(meta)}
        try:
            if any(t.dtype == torch.bfloat16 for t in tensors.values()):  # numpy has no bfloat16
                save_file({k: t.clone() for k, t in tensors.items()}, str(tmp), metadata=metadata)
            else:  # the same file, written from numpy views: no copies, half the time of the torch path
                save_numpy({k: t.numpy() for k, t in tensors.items()}, str(tmp), metadata=metadata)
            if fsync:
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except (OSError, SafetensorError) as exc:  # a full disk, a read-only mount: the state before stays whole
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise StateWriteError(
                f"{directory}: cannot save this device's state ({_reason(exc)}); the state before is kept: free "
                "space or make the directory writable, then run the agent again"
            ) from exc
        return path

    @classmethod
    def load(cls, directory: str | Path) -> ClientState | None:
        """The state saved in ``directory``, or ``None`` when there is none yet."""
        path = Path(directory) / STATE_FILE
        if not path.exists():
            return None
        try:
            return cls._read(path)
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
            raise StateError(path, exc) from exc

    @classmethod
    def _read(cls, path: Path) -> ClientState:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("fedatoms")
            if raw is None:
                raise ValueError(f"{path} is not a fedatoms client state (no 'fedatoms' metadata)")
            meta = json.loads(raw)
            if meta.get("format") != _FORMAT:
                raise ValueError(f"{path}: unsupported state format {meta.get('format')!r}")
            groups: dict[str, dict[str, Tensor]] = {g: {} for g in meta["groups"]}
            for key in f.keys():
                group, _, name = key.partition("/")
                groups.setdefault(group, {})[name] = f.get_tensor(key)
        state = cls(
            client_id=meta["client_id"],
            tier=float(meta["tier"]),
            global_tensors=groups.get("global", {}),
            versions={k: int(v) for k, v in meta["versions"].items()},
            unsynced=groups.get("unsynced", {}),
            local=groups.get("local", {}),
            personal_atoms=groups.get("personal"),
            strategy_state={
                # "control": SCAFFOLD's c_i as states before issue 21 wrote it
                g.removeprefix(_STRATEGY): values
                for g, values in groups.items()
                if g.startswith(_STRATEGY) or g == "control"
            },
            personal_model=groups.get("personal_model"),
            rounds_joined=int(meta["rounds_joined"]),
            evaluate_round=meta.get("evaluate_round"),
            last_round=int(meta.get("last_round", 0)),
            last_config=meta.get("last_config"),
            last_seed=None if meta.get("last_seed") is None else int(meta["last_seed"]),
        )
        p = meta.get("pending")
        if p is not None:
            state.pending = PendingUpdate(
                round=int(p["round"]),
                update_id=str(p["update_id"]),
                num_samples=int(p["num_samples"]),
                metrics={k: float(v) for k, v in p["metrics"].items()},
                tensors=groups.get("pending", {}),
                control_delta=groups.get("pending_delta"),
                fp16=bool(p.get("fp16", False)),
                strategy_state={
                    g.removeprefix(_PENDING_STRATEGY): values
                    for g, values in groups.items()
                    if g.startswith(_PENDING_STRATEGY)
                },
            )
        if meta.get("taken_round") is not None:
            state.taken = TakenUpdate(
                round=int(meta["taken_round"]),
                strategy_state={
                    g.removeprefix(_TAKEN_STRATEGY): values
                    for g, values in groups.items()
                    if g.startswith(_TAKEN_STRATEGY)
                },
            )
        return state
