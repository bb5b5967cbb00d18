"""Many virtual clients in one process, for simulation.

Each virtual client has its own :class:`ClientState`, data shard and local test split and
runs exactly the client code of a real agent (:func:`client_agent.update.run_task`); only
the transport differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aggregator_service.rounds import client_key
from client_agent.state import ClientState
from fedcore.data import ArrayDataset, local_test_splits, partition

__all__ = ["VirtualClient", "make_virtual_clients"]


@dataclass
class VirtualClient:
    state: ClientState
    train: ArrayDataset
    test: ArrayDataset

    @property
    def client_id(self) -> str:
        return self.state.client_id


def make_virtual_clients(
    train: ArrayDataset,
    test: ArrayDataset,
    num_clients: int,
    tiers: Sequence[float],
    *,
    scheme: str,
    classes_per_client: int,
    dirichlet_alpha: float,
    seed: int,
) -> list[VirtualClient]:
    """Partition the data and give client ``i`` the tier ``tiers[i % len(tiers)]`` (round-robin)."""
    parts = partition(
        train.labels_numpy(),
        num_clients,
        scheme,
        classes_per_client=classes_per_client,
        alpha=dirichlet_alpha,
        seed=seed,
    )
    tests = local_test_splits(train.labels_numpy(), test.labels_numpy(), parts, seed=seed)
    return [
        VirtualClient(
            ClientState(client_id=client_key(i), tier=float(tiers[i % len(tiers)])),
            train.subset(np.asarray(idx)),
            test.subset(np.asarray(tidx)),
        )
        for i, (idx, tidx) in enumerate(zip(parts, tests, strict=True))
    ]
