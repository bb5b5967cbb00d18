"""What the coordinator answers the servicer: who a client is, its task, a push's outcome."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from fedcore.training import TrainConfig

__all__ = ["ClientInfo", "Done", "PushResult", "Registration", "Train", "Wait"]


@dataclass(frozen=True)
class ClientInfo:
    id: str
    tier: float
    name: str
    key: str  # the round engine's name for the client (:func:`fedcore.keys.client_key`)


class Registration(NamedTuple):
    client_id: str
    token: str
    tier: float
    spec_json: str


@dataclass(frozen=True)
class Wait:
    retry_after: float
    reason: str


@dataclass(frozen=True)
class Train:
    round: int
    due: tuple[str, ...]
    train_config: TrainConfig
    strategy_config: dict[str, Any]
    continue_unsynced: bool
    seed: int
    deadline: datetime
    personal_atoms: bool
    local: tuple[str, ...] = ()  # tier tensors that never leave the client


@dataclass(frozen=True)
class Done:
    reason: str
    final_round: int


class PushResult(NamedTuple):
    accepted: bool
    duplicate: bool
    round: int
    message: str
    #: what the fold scales the update's move by (``update_norm_mode = "clip"``); 0: not known any more
    move_scale: float = 1.0
