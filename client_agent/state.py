"""What a client keeps between rounds, whatever the transport.

The global tensors it last fetched (with versions, so a fetch moves only what changed),
the local values of tensors that were not synchronized yet (FedLAMA cohorts continue from
them), its personal atoms and its SCAFFOLD control variate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

__all__ = ["ClientState"]


@dataclass
class ClientState:
    client_id: str
    tier: float
    global_tensors: dict[str, Tensor] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    unsynced: dict[str, Tensor] = field(default_factory=dict)
    local: dict[str, Tensor] = field(default_factory=dict)  # never aggregated (e.g. BN statistics kept local)
    personal_atoms: dict[str, Tensor] | None = None
    control: dict[str, Tensor] | None = None
    rounds_joined: int = 0

    def receive(self, fetched: dict[str, tuple[Tensor, int]]) -> None:
        for name, (tensor, version) in fetched.items():
            self.global_tensors[name] = tensor
            self.versions[name] = version

    def starting_point(self, continue_unsynced: bool) -> dict[str, Tensor]:
        """Global values, overlaid with unsynced local values when the cohort continues, and always with
        the tensors the federation keeps local."""
        if not continue_unsynced:
            self.unsynced.clear()
        return {**self.global_tensors, **self.unsynced, **self.local}
