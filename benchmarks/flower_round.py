"""Flower's Ray simulation engine on the shape `benchmarks/ray_engine.py` times: seconds per round (not a test).

Run by ``ray_engine.py --flower-python PY`` with an interpreter that has Flower (``pip install
'flwr[simulation]==1.42.*'`` in a virtual environment of its own: it pins its own Ray and protobuf), so
both engines are timed in one run. 10 virtual clients, every client every round, a model of the
given tensor shapes (``ray_engine.idle_mlp``'s, about 105k parameters, passed as JSON); a client's ``fit``
returns the parameters it got and ``evaluate`` a fixed loss: no training work, as in our shape.
Flower's ``FedAvg`` (fit and evaluate on every client), a local Ray of ``--cpus`` CPUs, one CPU per
client. A round's time is the time between the ends of consecutive rounds' evaluations (round 1,
which starts the actors, is left out); printed as one JSON line.

    /path/to/flower-venv/bin/python benchmarks/flower_round.py --shapes '[[32, 1, 3, 3], ...]'
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", required=True, help="JSON list of the model's tensor shapes")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()

    import flwr as fl
    import numpy as np
    from flwr.common import ndarrays_to_parameters

    arrays = [np.zeros(shape, dtype=np.float32) for shape in json.loads(args.shapes)]
    ends: list[float] = []

    class Idle(fl.client.NumPyClient):
        def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[Any], int, dict[str, Any]]:
            return parameters, 1, {}

        def evaluate(self, parameters: list[Any], config: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
            return 0.0, 1, {}

    class Timed(fl.server.strategy.FedAvg):
        def aggregate_evaluate(self, server_round: int, results: Any, failures: Any) -> Any:
            out = super().aggregate_evaluate(server_round, results, failures)
            ends.append(time.perf_counter())
            return out

    n = args.clients
    fl.simulation.start_simulation(
        client_fn=lambda cid: Idle().to_client(),
        num_clients=n,
        config=fl.server.ServerConfig(num_rounds=args.rounds),
        strategy=Timed(
            fraction_fit=1.0,
            fraction_evaluate=1.0,
            min_fit_clients=n,
            min_evaluate_clients=n,
            min_available_clients=n,
            initial_parameters=ndarrays_to_parameters(arrays),
        ),
        client_resources={"num_cpus": 1},
        ray_init_args={"num_cpus": args.cpus, "include_dashboard": False, "log_to_driver": False},
    )
    rounds = [b - a for a, b in itertools.pairwise(ends)]
    print(json.dumps({"per_round": sum(rounds) / len(rounds), "rounds": rounds, "flwr": fl.__version__}))


if __name__ == "__main__":
    main()
