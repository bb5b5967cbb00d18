"""Under float16 transport the server's state stays the mean of the clients' states.

SCAFFOLD's ``c``, FedDyn's ``h`` and FedDC's ``H`` are means of what each client keeps (``c_i``, ``∇L_k``,
``h_i``). The server adds what it receives (the rounded update ``ỹ`` and control delta) relative to the
model it sent (``x̃``); the clients must move their state by the same quantities, or the two sums part
by the rounding, round after round (16 % of ``|h|`` after 32 rounds before both sides used ``ỹ − x̃``).
Real client training (:func:`run_task`) and the real codec, two clients, eight rounds.
"""

from __future__ import annotations

import pytest
import torch

from aggregator_service.strategies import build_strategy
from aggregator_service.updates import ClientUpdate
from client_agent.pool import through_codec
from client_agent.state import ClientState
from client_agent.update import TrainTask, run_task
from fedcore.data import ArrayDataset
from fedcore.spec import ModelSpec
from fedcore.training import TrainConfig

SPEC = ModelSpec("digits-cnn", 10, "none")
GROUPS = {"server_control": "control", "h": "gradient", "drift": "drift"}


def data(k: int) -> ArrayDataset:
    g = torch.Generator().manual_seed(k)
    return ArrayDataset(torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 10, (40,), generator=g), 10, "rand")


@pytest.mark.parametrize(("name", "args"), [("scaffold", {}), ("feddyn", {"alpha": 0.1}), ("feddc", {"alpha": 0.1})])
def test_server_state_is_the_mean_of_the_client_states_under_fp16(name: str, args: dict) -> None:
    n, rounds = 2, 8
    if name != "scaffold":
        args = {**args, "fp16_transport": True}
    strategy = build_strategy(name, num_clients_total=n, spec=SPEC, **args)
    config = TrainConfig(batch_size=10, lr=0.05, momentum=0.0, bn_statistics="running", device="cpu")
    clients = [ClientState(f"c{k}", 1.0) for k in range(n)]
    x = dict(SPEC.initial_model(0).state_dict())
    for r in range(1, rounds + 1):
        acc = strategy.begin(x, list(x))
        for k, client in enumerate(clients):
            received, _ = through_codec(x, True, SPEC.owners)
            client.receive({t: (v, r - 1) for t, v in received.items()})
            control = strategy.server_control(SPEC) if strategy.client_config().get("scaffold") else None
            if control is not None:
                control, _ = through_codec(control, True, SPEC.owners)
            task = TrainTask(
                r, tuple(x), config, False, 100 * r + k, {**strategy.client_config(), "fp16_transport": True}, control
            )
            push = run_task(client, SPEC, task, data(k))
            tensors, _ = through_codec(push.tensors, True, SPEC.owners)
            delta = None if push.control_delta is None else through_codec(push.control_delta, True, SPEC.owners)[0]
            strategy.fold(acc, ClientUpdate(client.client_id, push.num_samples, 1.0, SPEC, tensors, delta))
        x = {**x, **strategy.finish(acc, x).tensors}
    state = strategy.state_dict()
    checked = 0
    for key, group in GROUPS.items():
        for tensor, server in state.get(key, {}).items():
            mean = sum(c.strategy_state[group][tensor] for c in clients) / n
            assert float(mean.abs().max()) > 0
            torch.testing.assert_close(server, mean, rtol=1e-4, atol=1e-6 * float(mean.abs().max()))
            checked += 1
    assert checked
