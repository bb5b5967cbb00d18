"""A federation restored from a backup goes back in time; its clients, which trained past the backup, go with it.

docs/deploy.md's Backup: restore the database, start the aggregator, clients need no backup. The clients then
held tensors of versions the restored federation had not reached, and a fetch sent a tensor only when the
server's version was newer: they got nothing, and trained and evaluated their own model from then on.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import torch
from grpc_helpers import global_tensors, register, shards, start_aggregator


def test_clients_of_a_federation_restored_from_a_backup_fetch_its_model(tmp_path: Path) -> None:
    live, restored = tmp_path / "live.db", tmp_path / "restored.db"
    svc = start_aggregator(f"sqlite:///{live}")
    clients = [register(svc.stub, 1.0, d) for d in shards(2, 60)]
    try:
        for c in clients:
            c.round_trip()  # round 1 closes
        with closing(sqlite3.connect(live)) as src, closing(sqlite3.connect(restored)) as dst:
            src.backup(dst)  # the operator's backup, taken while the aggregator runs (SQLite's backup API)
        for _ in range(2):  # rounds 2 and 3: the clients fetch what they train from
            for c in clients:
                c.round_trip()
        ahead = dict(clients[0].state.versions)
    finally:
        svc.stop()
    back = start_aggregator(f"sqlite:///{restored}")
    try:
        served = global_tensors(f"sqlite:///{restored}")
        assert all(ahead[n] > v for n, (_t, v) in served.items())  # every tensor: the clients are ahead
        for c in clients:
            c.stub = back.stub
            assert c.task().train.round == 2  # the restored federation's open round
            assert c.fetch() > 0
            assert c.state.versions == {n: v for n, (_t, v) in served.items()}
            for name, (tensor, _v) in served.items():
                assert torch.equal(c.state.global_tensors[name], tensor), name
    finally:
        back.stop()
