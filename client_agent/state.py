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
leaves either the previous state or the new one, never a mix. The file is written here, tensor
by tensor, to the one temporary name the next save writes over: safetensors' ``save_file`` writes
through a temporary file of its own, randomly named, which a kill left behind for good (a device
with frequent power cuts filled its flash with them); the next save removes those.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import Tensor

__all__ = ["STATE_FILE", "ClientState", "PendingUpdate", "TakenUpdate", "sync_directory"]

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


def sync_directory(directory: Path) -> None:
    """fsync ``directory`` after a rename into it: the file's bytes were synced, but until its directory is, a
    power cut can bring the old name back (or none). A file system that cannot sync a directory is let be."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


#: safetensors' names for torch's dtypes
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-sized views numpy can hold


def _write_safetensors(f: Any, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """The safetensors format (a little-endian u64 header length, a JSON header padded to 8 bytes, then the
    tensors' bytes), written tensor by tensor from views: no copy of the state in memory, and no file but ``f``
    (safetensors' ``save_file`` writes a temporary file of its own that a kill leaves behind, and its ``save``
    returns the whole file as one more copy in memory). Largest elements first (safetensors orders by dtype), so
    every tensor stays aligned."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: a client state cannot hold {t.dtype} tensors")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for name in order:
        t = tensors[name]
        words = t.reshape(-1).view(_WORDS[t.element_size()]).numpy()  # the tensor's bytes, not a copy
        if sys.byteorder != "little":  # the format is little-endian: swap one tensor at a time
            words = words.byteswap()
        f.write(words.data.cast("B"))


#: safetensors' own temporary files (Rust's tempfile: ".tmp" and 6 letters or digits), left by a save killed
#: while it wrote through ``save_file``, before states were written here
_LEFTOVER = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def _discard_leftovers(directory: Path) -> None:
    """Remove the temporary files that saves killed before this version left, each 14 MB at tier 1/8 and never
    reused: only files of that name whose safetensors header holds a fedatoms state, which no other program
    writes."""
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if _LEFTOVER.fullmatch(entry.name) and entry.is_file(follow_symlinks=False) and _is_state(entry.path):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _is_state(path: str) -> bool:
    """Whether ``path`` starts as a fedatoms client state (its header, whatever followed it)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 100_000_000:
                return False
            header = json.loads(f.read(n))
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        return isinstance(meta, dict) and "fedatoms" in meta
    except (OSError, ValueError):
        return False


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
        _discard_leftovers(directory)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                _write_safetensors(f, tensors, {"fedatoms": json.dumps(meta)})
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:  # a full disk, a read-only mount: the state before stays whole
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise StateWriteError(
                f"{directory}: cannot save this device's state ({_reason(exc)}); the state before is kept: free "
                "space or make the directory writable, then run the agent again"
            ) from exc
        if fsync:
            try:
                sync_directory(directory)
            except OSError as exc:
                raise StateWriteError(
                    f"{directory}: the state was written but its directory could not be synced ({_reason(exc)}); a "
                    "power cut may bring the state before back: check the storage, then run the agent again"
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
