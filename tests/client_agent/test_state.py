"""A client's state survives a save and a load exactly, pending update included; a save is atomic."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from client_agent.state import STATE_FILE, ClientState, PendingUpdate, TakenUpdate


def test_state_round_trips_with_a_pending_update_and_a_taken_one(tmp_path: Path) -> None:
    state = ClientState(
        "c1",
        0.25,
        global_tensors={"a": torch.arange(6.0).reshape(2, 3)},
        versions={"a": 4},
        unsynced={"b": torch.ones(2)},
        local={"bn.running_mean": torch.zeros(3)},
        personal_atoms={"conv1.atoms": torch.randn(9, 3, 3)},
        strategy_state={"control": {"a": torch.full((2, 3), 0.5)}, "drift": {"a": torch.full((2, 3), -1.5)}},
        rounds_joined=3,
        evaluate_round=None,
        last_round=4,
    )
    state.pending = PendingUpdate(
        5,
        "u-5",
        40,
        {"train_loss": 0.7},
        {"a": torch.ones(2, 3)},
        {"a": torch.zeros(2, 3)},
        True,
        strategy_state={"control": {"a": torch.full((2, 3), 0.25)}},  # kept only once the push is taken
    )
    state.taken = TakenUpdate(4, {"drift": {"a": torch.full((2, 3), 2.5)}})  # kept once round 4 is seen closed
    state.save(tmp_path)
    back = ClientState.load(tmp_path)
    assert back is not None
    assert (back.client_id, back.tier, back.versions, back.rounds_joined, back.last_round) == (
        "c1",
        0.25,
        {"a": 4},
        3,
        4,
    )
    for mine, theirs in [
        (state.global_tensors, back.global_tensors),
        (state.unsynced, back.unsynced),
        (state.local, back.local),
        (state.personal_atoms, back.personal_atoms),
        (state.strategy_state["control"], back.strategy_state.get("control")),
        (state.strategy_state["drift"], back.strategy_state.get("drift")),
        (state.pending.tensors, back.pending.tensors if back.pending else None),
    ]:
        assert theirs is not None and mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    p = back.pending
    assert p is not None and (p.round, p.update_id, p.num_samples, p.metrics, p.fp16) == (
        5,
        "u-5",
        40,
        {"train_loss": 0.7},
        True,
    )
    assert p.control_delta is not None and torch.equal(p.control_delta["a"], torch.zeros(2, 3))
    assert set(back.strategy_state) == {"control", "drift"}  # the pending update's is not among them
    assert torch.equal(back.strategy_state["drift"]["a"], torch.full((2, 3), -1.5))  # nor the taken one's
    t = back.taken
    assert t is not None and t.round == 4 and set(t.strategy_state) == {"drift"}
    assert torch.equal(t.strategy_state["drift"]["a"], torch.full((2, 3), 2.5))
    assert set(p.strategy_state) == {"control"} and torch.equal(
        p.strategy_state["control"]["a"], torch.full((2, 3), 0.25)
    )


def test_no_state_yet_and_a_foreign_file_is_refused(tmp_path: Path) -> None:
    assert ClientState.load(tmp_path) is None
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / STATE_FILE))
    with pytest.raises(ValueError, match="not a fedatoms client state"):
        ClientState.load(tmp_path)


def test_a_save_replaces_the_file_whole(tmp_path: Path) -> None:
    """Written beside and renamed over: no temporary file stays, and a reload sees only the new state."""
    ClientState("c1", 1.0, personal_atoms={"x": torch.zeros(2)}).save(tmp_path)
    ClientState("c1", 1.0).save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]
    back = ClientState.load(tmp_path)
    assert back is not None and back.personal_atoms is None


def test_a_state_written_before_strategy_groups_keeps_its_scaffold_control(tmp_path: Path) -> None:
    """States saved before issue 21 hold SCAFFOLD's c_i as group "control": it loads as strategy state."""
    import json

    from safetensors.torch import save_file

    meta = {"format": 1, "client_id": "c1", "tier": 1.0, "versions": {}, "rounds_joined": 2, "groups": ["control"]}
    save_file(
        {"control/a": torch.full((2,), 0.25)}, str(tmp_path / STATE_FILE), metadata={"fedatoms": json.dumps(meta)}
    )
    back = ClientState.load(tmp_path)
    assert back is not None and set(back.strategy_state) == {"control"}
    assert torch.equal(back.strategy_state["control"]["a"], torch.full((2,), 0.25))


def test_a_tensor_synchronized_since_supersedes_its_unsynced_value() -> None:
    """A FedLAMA cohort member that missed the round synchronizing ``a`` continues from the synchronized
    value, not from what it trained before; ``b``, still unsynchronized, continues from its local value."""
    state = ClientState("c1", 1.0, global_tensors={"a": torch.zeros(2), "b": torch.zeros(2)}, versions={"a": 1, "b": 1})
    state.unsynced = {"a": torch.full((2,), 7.0), "b": torch.full((2,), 9.0)}
    state.receive({"a": (torch.ones(2), 2)})
    start = state.starting_point(continue_unsynced=True)
    assert torch.equal(start["a"], torch.ones(2)) and torch.equal(start["b"], torch.full((2,), 9.0))


def test_a_state_the_directory_refuses_to_take_keeps_the_state_before(tmp_path) -> None:
    """A full disk or a read-only mount: safetensors' SafetensorError or OSError reached the agent's caller as a
    traceback. Here the temporary file's name is taken by a directory, which no user can write over."""
    import pytest

    from client_agent.state import ClientState, StateWriteError

    before = ClientState("c-1", 1.0, global_tensors={"w": torch.ones(3)})
    before.save(tmp_path)
    (tmp_path / ".state.safetensors.tmp").mkdir()
    after = ClientState("c-1", 1.0, global_tensors={"w": torch.zeros(3)})
    with pytest.raises(StateWriteError, match=r"cannot save this device's state .* the state before is kept"):
        after.save(tmp_path)
    assert torch.equal(ClientState.load(tmp_path).global_tensors["w"], torch.ones(3))


# ------------------------------------------------------------------ kills, leftovers, durability

_SAVER = """
import sys, torch
from client_agent.state import ClientState, PendingUpdate
v = 0
while True:
    v = v % 2 + 1
    s = ClientState("c", 0.125, global_tensors={f"t{i}": torch.full((1200, 1000), float(v)) for i in range(2)})
    s.versions = {f"t{i}": v for i in range(2)}
    s.pending = PendingUpdate(v, f"id{v}", 10, {"loss": 1.0}, {"t0": torch.full((1200, 1000), float(v))})
    s.save(sys.argv[1])
"""


def _kill_mid_write(tmp_path: Path, program: str, directory: Path, kills: int) -> list[set[str]]:
    """Run ``program`` (it writes in ``directory`` forever) and SIGKILL it while a file other than the state is
    being written (one with bytes that was not there, or changed since), ``kills`` times; what each kill left
    besides the state."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from processes import ENV, ROOT

    def others() -> dict[str, tuple[int, int, int]]:
        seen = {}
        for entry in os.scandir(directory):
            if entry.name != STATE_FILE:
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    if st.st_size:  # a file just created, empty, is not yet a write (nor worth removing)
                        seen[entry.name] = (st.st_ino, st.st_mtime_ns, st.st_size)
        return seen

    left = []
    for _ in range(kills):
        before = others()
        proc = subprocess.Popen([sys.executable, "-c", program, str(directory)], cwd=ROOT, env=ENV)
        try:
            deadline = time.monotonic() + 120
            while not any(before.get(name) != st for name, st in others().items()):
                assert proc.poll() is None and time.monotonic() < deadline, "no write in progress to kill"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        left.append(set(os.listdir(directory)) - {STATE_FILE})
    return left


def test_saves_killed_mid_write_leave_nothing_after_the_next_save(tmp_path: Path) -> None:
    """safetensors' save_file wrote through a temporary file of its own (".tmpXXXXXX", 14 MB here); every kill
    during a save left one for good, until a device that loses power often had its flash full."""
    first = ClientState("c", 0.125, global_tensors={"t0": torch.zeros(1200, 1000), "t1": torch.zeros(1200, 1000)})
    first.save(tmp_path)
    left = _kill_mid_write(tmp_path, _SAVER, tmp_path, kills=3)
    assert all(left), "every kill landed in a save"
    state = ClientState.load(tmp_path)  # whole: the state before a killed save, or a save that completed
    assert state is not None
    values = {float(t[0, 0]) for t in state.global_tensors.values()} | {
        float(t[-1, -1]) for t in state.global_tensors.values()
    }
    assert len(values) == 1
    if values != {0.0}:
        v = int(values.pop())
        assert set(state.versions.values()) == {v} and state.pending is not None and state.pending.update_id == f"id{v}"
    state.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]


def test_the_temporary_files_of_earlier_versions_go_at_the_next_save_and_no_other(tmp_path: Path) -> None:
    """A device updated from a version that saved through safetensors' save_file has its leftovers back; a file
    of the same kind of name that holds no client state is not this code's and stays."""
    state = ClientState("c", 0.125, global_tensors={"t": torch.ones(4)})
    state.save(tmp_path)
    old_saver = """
import sys, json, numpy as np
from safetensors.numpy import save_file
while True:
    save_file({"global/t": np.ones((3000, 1000), np.float32)}, sys.argv[1] + "/state.safetensors",
              metadata={"fedatoms": json.dumps({"format": 1})})
"""
    left = _kill_mid_write(tmp_path, old_saver, tmp_path, kills=2)
    old = set().union(*left)
    assert old and all(name.startswith(".tmp") and len(name) == 10 for name in old), old
    (tmp_path / ".tmpOther1").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"__metadata__":{"x":"y"}}')
    (tmp_path / ".tmpNotMe2").write_text("another program's")
    state.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([STATE_FILE, ".tmpOther1", ".tmpNotMe2"])
    assert torch.equal(ClientState.load(tmp_path).global_tensors["t"], torch.ones(4))


def test_the_state_file_is_what_safetensors_reads(tmp_path: Path) -> None:
    """The file is written here, not by safetensors: its own reader takes it back, every dtype a state holds."""
    from safetensors import safe_open

    tensors = {
        "w": torch.randn(3, 4),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "half": torch.randn(5).to(torch.bfloat16),
        "fp16": torch.randn(2, 2).half(),
        "mask": torch.tensor([True, False, True]),
        "steps": torch.arange(7),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "f64": torch.randn(3, dtype=torch.float64),
    }
    ClientState("c", 1.0, global_tensors=tensors).save(tmp_path)
    with safe_open(str(tmp_path / STATE_FILE), framework="pt") as f:
        back = {k.removeprefix("global/"): f.get_tensor(k) for k in f.keys()}
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == tensors[k].dtype and torch.equal(back[k], tensors[k]) for k in tensors)


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch, directory: Path, watched: str) -> list[str]:
    """os.fsync records, for each call, what it synced: "dir" with whether ``watched`` was in it already (the
    rename came first), or "file"."""
    import os

    real = os.fsync
    synced: list[str] = []
    dir_stat = os.stat(directory)

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (dir_stat.st_dev, dir_stat.st_ino):
            synced.append(f"dir with {watched}" if (directory / watched).exists() else "dir")
        else:
            synced.append("file")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_a_durable_save_syncs_its_directory_after_the_rename(tmp_path: Path, monkeypatch) -> None:
    """A synced file renamed into an unsynced directory can come back after a power cut under its old name."""
    synced = _record_fsyncs(monkeypatch, tmp_path, STATE_FILE)
    ClientState("c", 1.0, global_tensors={"w": torch.ones(3)}).save(tmp_path)
    assert synced == ["file", f"dir with {STATE_FILE}"]
    synced.clear()
    ClientState("c", 1.0, global_tensors={"w": torch.ones(3)}).save(tmp_path, fsync=False)  # a simulation's
    assert synced == []


def test_credentials_are_synced_with_their_directory(tmp_path: Path, monkeypatch) -> None:
    from client_agent.agent import CREDENTIALS_FILE, Credentials

    synced = _record_fsyncs(monkeypatch, tmp_path, CREDENTIALS_FILE)
    Credentials("c1", "secret-token", 1.0, "{}", "default", 20.0).save(tmp_path)
    assert synced == ["file", f"dir with {CREDENTIALS_FILE}"]
    assert Credentials.load(tmp_path) is not None
