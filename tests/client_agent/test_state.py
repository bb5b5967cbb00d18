"""A client's state survives a save and a load exactly, pending update included; a save is atomic."""

from __future__ import annotations

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
