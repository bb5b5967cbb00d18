"""`--engine ray` against the local engine: wall time per round, the driver's peak memory, a Flower-shaped round.

Runs, each engine in a process of its own (the Ray one starts a local Ray with ``--cpus``):

- 1,000 clients (digits split IID), fraction 0.1, digits-cnn, 5 rounds, in process and over
  gRPC: the mean of the records' ``wall_seconds`` over rounds 2–5 (round 1 also builds every
  worker's or actor's data shards), Ray ÷ local. At equal cores: the local gRPC engine runs 2
  worker processes, the Ray engine one actor per CPU (one CPU per client, the default
  resources); in process the local engine trains in the driver, the Ray engine on the actors.
- The Ray driver's peak RSS (``ru_maxrss``) after in-process runs of 100, then 1,000 clients,
  and after the gRPC run (whose driver also hosts the aggregator).
- 10 clients, fraction 1, 5 rounds, the issue's Flower-shaped round: a model of about 100k
  parameters and no training work. The model is :func:`idle_mlp` (digits' 64 pixels → 1,400 → 10,
  105k parameters), one SGD step each on its shard (batch size above the shard, ``lr = 1e-9``): every
  code path of a real round runs (fetch through the codec, a step, push, fold, close, each client's
  evaluation, the server's), but its arithmetic costs microseconds, as the idle client Flower is
  timed with does nothing. Flower's Ray engine took 0.21 s for a round of this shape on the reference
  machine; with ``--flower-python PY`` (an interpreter with Flower, ``benchmarks/flower_round.py``) it
  is timed in the same run, on the same tensors, and the ratio printed.

``python benchmarks/ray_engine.py`` (add ``--cpus N``, ``--flower-python PY``); ``nice`` it on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIG: dict[str, Any] = dict(dataset="digits", clients=1000, fraction=0.1, rounds=5, partition="iid", seed=0)
SHAPE: dict[str, Any] = dict(
    dataset="digits",
    model="benchmarks.ray_engine:idle_mlp",  # imported by Ray's workers too: PYTHONPATH holds the checkout
    clients=10,
    fraction=1.0,
    rounds=5,
    partition="iid",
    batch_size=1000,
    lr=1e-9,
    seed=0,
)


def idle_mlp(num_classes: int = 10) -> Any:
    """The Flower-shaped round's model: about 100k parameters whose step costs next to nothing."""
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(64, 1400), nn.ReLU(), nn.Linear(1400, num_classes))


def _per_round(results: dict[str, Any]) -> float:
    rounds = results["rounds"][1:]
    return sum(r["wall_seconds"] for r in rounds) / len(rounds)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_engine(engine: str, cpus: int) -> dict[str, Any]:
    """Every measurement of one engine, in this process."""
    from fedatoms.simulate import SimulationConfig, run_simulation

    out: dict[str, Any] = {}
    if engine == "ray":
        import ray

        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        if engine == "ray":
            small = run_simulation(SimulationConfig(engine=engine, **{**BIG, "clients": 100, "rounds": 2}))
            out["peak_mb_100"] = _peak_mb()
            out["inprocess_100"] = _per_round(small)
        t = time.perf_counter()
        out["inprocess"] = _per_round(run_simulation(SimulationConfig(engine=engine, **BIG)))
        out["peak_mb_1000"] = _peak_mb()
        out["inprocess_total"] = time.perf_counter() - t
        t = time.perf_counter()
        out["grpc"] = _per_round(run_simulation(SimulationConfig(engine=engine, transport="grpc", **BIG)))
        out["peak_mb_grpc"] = _peak_mb()
        out["grpc_total"] = time.perf_counter() - t
        shape = run_simulation(SimulationConfig(engine=engine, **SHAPE))
        out["shape"] = _per_round(shape)
        out["shape_rounds"] = [r["wall_seconds"] for r in shape["rounds"]]
    finally:
        if engine == "ray":
            ray.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray (and cores compared) [2]")
    parser.add_argument("--flower-python", help="a Python with flwr[simulation] 1.42: time Flower's round in this run")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # one engine's run, in a process of its own
    args = parser.parse_args()
    if args.engine:
        print(json.dumps(run_engine(args.engine, args.cpus)))
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    got = {}
    for engine in ("local", "ray"):
        done = subprocess.run(
            [sys.executable, __file__, "--engine", engine, "--cpus", str(args.cpus)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if done.returncode != 0:
            sys.exit(f"{engine} run failed:\n{done.stderr[-4000:]}")
        got[engine] = json.loads(done.stdout.strip().splitlines()[-1])
    local, ray_ = got["local"], got["ray"]
    model = idle_mlp()
    params = sum(p.numel() for p in model.parameters())
    print(f"1,000 clients, fraction 0.1, digits-cnn, 5 rounds, {args.cpus} CPUs: s/round (mean of rounds 2-5)")
    print(f"{'':14}{'local':>10}{'ray':>10}{'ray/local':>11}")
    for key in ("inprocess", "grpc"):
        print(f"{key:14}{local[key]:>10.3f}{ray_[key]:>10.3f}{ray_[key] / local[key]:>10.2f}×")
    print(
        f"Ray driver peak RSS: {ray_['peak_mb_100']:.0f} MB after 100 clients, {ray_['peak_mb_1000']:.0f} MB after "
        f"1,000 (in process; +{ray_['peak_mb_1000'] - ray_['peak_mb_100']:.0f} MB), {ray_['peak_mb_grpc']:.0f} MB "
        f"after gRPC (driver with the aggregator); local engine: {local['peak_mb_1000']:.0f} MB in process"
    )
    print(
        f"10 clients, an MLP of {params / 1e3:.0f}k parameters, one tiny-lr step each (no training work): "
        f"ray {ray_['shape']:.3f} s/round, local {local['shape']:.3f} s/round (Flower's Ray engine: 0.21 s)"
    )
    print(f"  per round, ray: {', '.join(f'{s:.3f}' for s in ray_['shape_rounds'])}")
    if args.flower_python:
        shapes = [list(t.shape) for t in model.state_dict().values()]
        script = str(ROOT / "benchmarks" / "flower_round.py")
        done = subprocess.run(
            [args.flower_python, script, "--shapes", json.dumps(shapes), "--cpus", str(args.cpus)],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            check=False,
        )
        if done.returncode != 0:
            sys.exit(f"Flower run failed:\n{done.stderr[-4000:]}")
        flower = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"  Flower {flower['flwr']} Ray engine, same shape, this run: {flower['per_round']:.3f} s/round; "
            f"ray / Flower {ray_['shape'] / flower['per_round']:.2f}× (target < 1)"
        )


if __name__ == "__main__":
    main()
